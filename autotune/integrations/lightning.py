"""A plan applied to a Lightning ``Trainer``: ``AutotuneCallback``.

    trainer = Trainer(**trainer_arguments(plan), max_epochs=3, callbacks=[AutotuneCallback(plan)])

At ``setup`` the callback applies the plan: the micro-batch to ``batch_size`` on the datamodule or
the module (or its ``hparams``, as Lightning's batch-size finder looks for it),
``accumulate_grad_batches`` and gradient clipping to the Trainer, and checkpointing to the
module's repeated blocks (every block: a Hugging Face model inside switched with its own switch;
K of N: the same K blocks the plan measured). At ``on_fit_start``, once ``configure_optimizers``
has run, every optimizer's learning rate becomes the plan's (schedulers keep their shape and
start from it), as in autotune's own loop. Precision is
fixed when the Trainer is built, so it is checked, not changed: ``trainer_arguments(plan)`` gives
it. Without a plan, ``AutotuneCallback(workload="model.py", target_batch=256, ...)`` plans at
``setup`` (``autotune.plan`` with the remaining keyword arguments).
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from ..errors import ConfigError
from ..orchestration.planner import plan as make_plan
from ..planning.export import even_split, to_lightning
from ..planning.types import Plan
from ..training.checks import load_plan
from ..workload.activation_checkpointing import checkpointable_blocks, enable_checkpointing
from ..workload.optimizer_steps import plan_group_lrs


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

    def on_fit_start(self, trainer, pl_module) -> None:
        apply_plan_lr(self.plan, trainer)


def apply_plan(plan: Plan, trainer, pl_module) -> None:
    """Set the plan's batch size (and eval batch, on a ``val_batch_size`` attribute where the
    datamodule or module has one), accumulation, clipping and checkpointing; check its precision."""
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
    if plan.eval_micro_batch is not None and hasattr(target, "val_batch_size"):
        target.val_batch_size = plan.eval_micro_batch  # what its val_dataloader() batches by
    trainer.accumulate_grad_batches = even.accumulation_steps
    trainer.gradient_clip_val = plan.clip_grad_norm
    trainer.gradient_clip_algorithm = "norm" if plan.clip_grad_norm is not None else None
    if plan.checkpointing:
        enable_checkpointing(pl_module, source=type(pl_module).__name__,
                             blocks=_planned_blocks(plan, pl_module))


def _planned_blocks(plan: Plan, pl_module) -> int | None:
    """The plan's K of N blocks on the module (None: every block)."""
    blocks, total = plan.blocks, plan.total_blocks
    if blocks is None or total is None or blocks >= total:
        return None
    found = len(checkpointable_blocks(pl_module))
    if found != total:
        raise ConfigError(
            f"the plan checkpoints {blocks} of the {total} repeated blocks of "
            f"{plan.workload.source}'s model, and the {type(pl_module).__name__} has {found}; "
            f"checkpoint the model's blocks in the module (autotune.workload.activation_checkpointing"
            f".enable_checkpointing(model, blocks={blocks})) and build the plan's Trainer without "
            f"checkpointing, or plan the module itself")
    return blocks


def apply_plan_lr(plan: Plan, trainer) -> None:
    """Every parameter group of the Trainer's optimizers at the plan's LR (none: left as it is);
    a group with an LR of its own keeps its ratio to the optimizer's (``plan_group_lrs``).

    ``configure_optimizers`` has already made the schedulers, which remember the LR they start
    from: each one is moved to the plan's LR, keeping the factor it has applied so far."""
    lr = plan.lr.lr
    if lr is None:
        return
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    for optimizer in trainer.optimizers:
        starts = plan_group_lrs(optimizer, lr)
        for group, start_lr in zip(optimizer.param_groups, starts):
            start = group.get("initial_lr", group["lr"])
            factor = group["lr"] / start if start else 1.0
            group["lr"] = start_lr * factor
            if "initial_lr" in group:
                group["initial_lr"] = start_lr
        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is optimizer and hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = list(starts)
