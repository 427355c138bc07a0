"""The eval micro-batch in a plan: pure, from what the eval probe found."""

from __future__ import annotations

import dataclasses

from .types import Plan


def with_eval_batch(plan: Plan, micro_batch: int | None, reason: str) -> Plan:
    """``plan`` with its eval micro-batch (None: not planned, ``reason`` says why) recorded.

    The training split is untouched: the eval batch is a second answer about the same setting.
    A warning is added where the forward alone fits less than the training micro-batch (a model
    whose eval forward holds more than a training step, e.g. generation in ``loss_fn``)."""
    warnings = list(plan.warnings)
    if micro_batch is not None and micro_batch < plan.micro_batch:
        warnings.append(f"the eval forward fits {micro_batch} per micro-batch, fewer than the "
                        f"training micro-batch {plan.micro_batch}: evaluate at "
                        f"{micro_batch} (per_device_eval_batch_size)")
    return dataclasses.replace(plan, eval_micro_batch=micro_batch, warnings=warnings,
                               reasons={**plan.reasons, "eval": reason})


__all__ = ["with_eval_batch"]
