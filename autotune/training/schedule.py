"""The learning rate a plan asks for, and the scheduler stepped once per optimizer step."""

from __future__ import annotations

import torch

from ..errors import WorkloadError
from ..planning.lr import WARMUP_EPOCHS
from ..workload.optimizer_steps import plan_group_lrs, set_group_lr


def apply_plan_lr(optimizer: torch.optim.Optimizer, plan) -> None:
    """Set every parameter group's lr to the plan's (left as the optimizer's when it has none);
    a group with an lr of its own keeps its ratio to the optimizer's (``plan_group_lrs``).

    Done before the scheduler exists, because schedulers remember the lr they start from.
    """
    lr = getattr(plan.lr, "lr", None)
    if lr is None:
        return
    for group, group_lr_ in zip(optimizer.param_groups, plan_group_lrs(optimizer, lr)):
        set_group_lr(group, group_lr_)


def build_scheduler(workload, optimizer: torch.optim.Optimizer, plan):
    """The model file's ``build_scheduler(optimizer, plan)``, or the plan's warmup then constant."""
    if workload.build_scheduler is not None:
        scheduler = workload.build_scheduler(optimizer, plan)
        missing = [name for name in ("step", "state_dict", "load_state_dict")
                   if not callable(getattr(scheduler, name, None))]
        if missing:
            raise WorkloadError(
                f"{workload.source}: build_scheduler(optimizer, plan) must return an LR scheduler "
                f"(with {', '.join(missing)}), got {type(scheduler).__name__}"
            )
        return scheduler
    warmup = int(getattr(plan.lr, "warmup_steps", 0) or 0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then_constant(warmup))


def describe_warmup(plan, workload) -> str:
    """What the run does about warmup, for the start-of-run line: never "warmup 0 steps" where the
    plan advised a warmup it could not count (no dataset size)."""
    if workload.build_scheduler is not None:
        return "the model file's build_scheduler"
    steps = int(getattr(plan.lr, "warmup_steps", 0) or 0)
    if steps:
        return f"warmup {steps} steps"
    if getattr(plan.lr, "lr", None) is not None and getattr(plan.lr, "scale", 1.0) > 1:
        return (f"no warmup: the plan advises warming the ×{plan.lr.scale:.4g} LR up over about "
                f"{WARMUP_EPOCHS} epochs, but it did not know the dataset size to count them; "
                f"define build_dataset() and re-plan, or build_scheduler(optimizer, plan) in the "
                f"model file")
    return "no warmup"


class _warmup_then_constant:
    """lr × (k+1)/warmup for the first ``warmup`` steps, then lr (a class so it pickles)."""

    def __init__(self, warmup: int):
        self.warmup = warmup

    def __call__(self, step: int) -> float:
        if self.warmup <= 0 or step >= self.warmup:
            return 1.0
        return (step + 1) / self.warmup
