"""Learning-rate scaling rules and warmup advice: pure functions, no torch.

lr = base_lr × rule(target_batch / base_batch), where rule is
- ``linear`` (k) for SGD-like optimizers (Goyal et al. 2017, "Accurate, Large Minibatch SGD"),
- ``sqrt`` (√k) for Adam-family / adaptive optimizers (Malladi et al. 2022, "On the SDEs and
  Scaling Rules for Adaptive Gradient Algorithms"),
- ``none`` (1).
``auto`` picks from the class of the optimizer that ``build_optimizer`` returns.
"""

from __future__ import annotations

import math
import re

from ..errors import ConfigError
from .types import LRDecision

RULES = ("auto", "linear", "sqrt", "none")

LINEAR_VALIDATED_BATCH = 8192
"""Goyal et al. validated the linear rule up to a batch of about 8k on ImageNet."""

WARMUP_EPOCHS = 5
"""Goyal et al. warm up linearly over 5 epochs."""

_LINEAR_OPTIMIZERS = {"sgd", "asgd", "lars"}
_SQRT_OPTIMIZERS = {"adam", "adamw", "adamax", "nadam", "radam", "sparseadam", "adagrad",
                    "adadelta", "rmsprop", "lamb", "adafactor", "ademamix"}
_LOW_BIT = re.compile(r"^(paged)?(.+?)(8bit|4bit|32bit|fp8)?$")
"""bitsandbytes' and torchao's variants keep the algorithm and change how the state is stored
(``PagedAdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, ``SGD8bit``): the rule is the algorithm's."""


def _algorithm(optimizer: str | None) -> str:
    return _LOW_BIT.match((optimizer or "").lower() or "?").group(2)


def rule_for_optimizer(optimizer: str | None) -> tuple[str, str]:
    """The rule ``auto`` means for an optimizer class name, and why."""
    name = _algorithm(optimizer)
    if name in _LINEAR_OPTIMIZERS:
        return "linear", f"{optimizer} is SGD-like: linear rule (Goyal et al. 2017)"
    if name in _SQRT_OPTIMIZERS:
        return "sqrt", f"{optimizer} is adaptive (Adam family): square-root rule (Malladi et al. 2022)"
    return "none", (f"no rule is known for optimizer {optimizer or '?'}; the LR is not rescaled "
                    f"(pass --lr-rule linear or sqrt to choose one)")


def scale_factor(rule: str, ratio: float) -> float:
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "none":
        return 1.0
    raise ConfigError(f"--lr-rule {rule!r} is not a rule; use one of {', '.join(RULES)}")


def decide_lr(
    *,
    rule: str,
    target_batch: int,
    base_lr: float | None,
    base_batch: int | None,
    optimizer: str | None,
    optimizer_lr: float | None = None,
    dataset_size: int | None = None,
) -> LRDecision:
    """The learning rate for ``target_batch``, given a reference ``base_lr`` at ``base_batch``."""
    if rule not in RULES:
        raise ConfigError(f"--lr-rule {rule!r} is not a rule; use one of {', '.join(RULES)}")
    why = ""
    if rule == "auto":
        rule, why = rule_for_optimizer(optimizer)
    if base_lr is None:
        own = f" (lr={optimizer_lr:g})" if optimizer_lr is not None else ""
        return LRDecision(rule=rule, base_batch=base_batch, note=(
            f"LR left as the optimizer's own{own}: no base LR was given, so there is nothing to "
            f"rescale; pass --base-lr and --base-batch (or define BASE_LR and BASE_BATCH in the "
            f"model file) to rescale it for batch {target_batch}"))
    if not (isinstance(base_lr, (int, float)) and math.isfinite(base_lr) and base_lr > 0):
        raise ConfigError(f"--base-lr {base_lr!r} must be a finite number more than 0 (--base-lr or "
                          f"BASE_LR in the model file), e.g. --base-lr 3e-4")
    if base_batch is None:
        raise ConfigError(f"--base-lr {base_lr:g} needs --base-batch (the batch that LR was tuned "
                          f"for), e.g. --base-batch 32; or define BASE_BATCH in the model file")
    if base_batch <= 0:
        raise ConfigError(f"--base-batch {base_batch!r} must be a positive int, e.g. --base-batch 32")
    scale = scale_factor(rule, target_batch / base_batch)
    lr = base_lr * scale
    if not math.isfinite(lr):
        raise ConfigError(f"--base-lr {base_lr:g} × {scale:.4g} overflows to {lr}; give a sane --base-lr")
    if lr <= 0:  # a float underflow: a plan with lr 0 would train nothing (and is not readable)
        raise ConfigError(
            f"--base-lr {base_lr:g} at --base-batch {base_batch} scaled by --lr-rule {rule} to "
            f"--target-batch {target_batch} is {base_lr:g} × {scale:.4g}, which underflows to "
            f"{lr:g}; give a larger --base-lr (or BASE_LR in the model file), a --base-batch "
            f"nearer the target batch, or --lr-rule none")
    notes = [why] if why else []
    notes.append(f"lr = {base_lr:g} × {rule}({target_batch}/{base_batch}) = {base_lr:g} × "
                 f"{scale:.4g} = {lr:.4g}")
    warmup = 0
    if scale > 1:
        warmup, advice = _warmup_advice(target_batch, dataset_size)
        notes.append(advice)
    return LRDecision(rule=rule, base_lr=base_lr, base_batch=base_batch, scale=scale, lr=lr,
                      warmup_steps=warmup, note="; ".join(notes))


def _warmup_advice(target_batch: int, dataset_size: int | None) -> tuple[int, str]:
    # A large LR from step 0 diverges early; Goyal et al. ramp linearly from the base LR over
    # 5 epochs. In optimizer steps (one per target batch, not per micro-batch).
    tail = ("; step the LR scheduler once per optimizer step (after the last micro-batch of each "
            "accumulation window), not once per micro-batch")
    if dataset_size:
        steps = max(1, math.ceil(WARMUP_EPOCHS * dataset_size / target_batch))
        return steps, (f"the LR grows, so warm up linearly over {steps} optimizer steps "
                       f"({WARMUP_EPOCHS} epochs of {dataset_size} samples at batch {target_batch}; "
                       f"Goyal et al. 2017){tail}")
    return 0, (f"the LR grows, so warm up linearly over about {WARMUP_EPOCHS} epochs of optimizer "
               f"steps (Goyal et al. 2017; the dataset size is unknown, so no step count is given: "
               f"define build_dataset() in the model file to get one){tail}")


def lr_warnings(decision: LRDecision, target_batch: int) -> list[str]:
    if decision.rule == "linear" and decision.lr is not None and target_batch > LINEAR_VALIDATED_BATCH:
        return [f"the linear LR rule was validated up to a batch of about {LINEAR_VALIDATED_BATCH} "
                f"(Goyal et al. 2017); at --target-batch {target_batch} consider a layer-wise "
                f"adaptive optimizer (LARS for SGD, LAMB for Adam)"]
    return []
