"""A plan applied to a Lightning ``Trainer``: ``AutotuneCallback``.

    trainer = Trainer(**trainer_arguments(plan), max_epochs=3, callbacks=[AutotuneCallback(plan)])

At ``setup`` the callback applies the plan: the micro-batch to ``batch_size`` on the datamodule or
the module (or its ``hparams``, as Lightning's batch-size finder looks for it),
``accumulate_grad_batches`` and gradient clipping to the Trainer, and checkpointing to the
module's repeated blocks (a Hugging Face model inside switched with its own switch). Precision is
fixed when the Trainer is built, so it is checked, not changed: ``trainer_arguments(plan)`` gives
it. Without a plan, ``AutotuneCallback(workload="model.py", target_batch=256, ...)`` plans at
``setup`` (``autotune.plan`` with the remaining keyword arguments).
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from ..errors import ConfigError
from ..planning.api import plan as make_plan
from ..planning.export import even_split, to_lightning
from ..planning.types import Plan
from ..training.checks import load_plan
from ..workload.activation_checkpointing import enable_checkpointing


def trainer_arguments(plan) -> dict:
    """``Trainer(**...)`` arguments for ``plan``: accelerator, devices, precision, accumulation, clip."""
    return dict(to_lightning(load_plan(plan)).config["trainer"])


class AutotuneCallback(Callback):
    """Applies a plan (or one made at ``setup``) to the Trainer, the data and the module."""

    def __init__(self, plan=None, *, workload=None, target_batch: int | None = None, **plan_options):
        if (plan is None) == (workload is None):
            raise ConfigError("AutotuneCallback takes a plan (a Plan or a plan-file path), or a "
                              "workload and target_batch to plan at setup; give one of the two")
        if workload is not None and target_batch is None:
            raise ConfigError("AutotuneCallback(workload=...) needs target_batch=N (the effective "
                              "batch per optimizer step) to plan")
        self.plan: Plan | None = load_plan(plan) if plan is not None else None
        self._planning = (workload, target_batch, plan_options)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.plan is None:
            workload, target_batch, options = self._planning
            options.setdefault("even", True)  # Lightning takes one micro-batch size
            self.plan = make_plan(workload, target_batch=target_batch, **options)
        apply_plan(self.plan, trainer, pl_module)


def apply_plan(plan: Plan, trainer, pl_module) -> None:
    """Set the plan's batch size, accumulation, clipping and checkpointing; check its precision."""
    expected = to_lightning(plan).config["trainer"]
    if str(trainer.precision) != expected["precision"]:
        raise ConfigError(f"the Trainer runs precision {trainer.precision!r} and the plan "
                          f"{plan.precision} ({expected['precision']!r}); build the Trainer with "
                          f"Trainer(**autotune.integrations.lightning.trainer_arguments(plan), ...)")
    if trainer.world_size != plan.world_size:
        raise ConfigError(f"the Trainer runs {trainer.world_size} process(es) and the plan "
                          f"{plan.world_size}; use devices={plan.world_size} (trainer_arguments(plan))")
    even = even_split(plan)
    target = trainer.datamodule if trainer.datamodule is not None and hasattr(
        trainer.datamodule, "batch_size") else pl_module
    if not lightning_hasattr(pl_module, "batch_size") and not hasattr(target, "batch_size"):
        raise ConfigError("the plan's micro-batch needs a batch_size attribute on the datamodule "
                          "or the LightningModule (or in its hparams) that its train_dataloader uses")
    if target is pl_module:
        lightning_setattr(pl_module, "batch_size", even.micro_batch)
    else:
        target.batch_size = even.micro_batch
    trainer.accumulate_grad_batches = even.accumulation_steps
    trainer.gradient_clip_val = plan.clip_grad_norm
    trainer.gradient_clip_algorithm = "norm" if plan.clip_grad_norm is not None else None
    if plan.checkpointing:
        enable_checkpointing(pl_module, source=type(pl_module).__name__)
