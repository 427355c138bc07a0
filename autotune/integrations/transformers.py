"""A plan applied to Hugging Face ``Trainer``: its ``TrainingArguments`` and a first-step check.

    args = training_arguments("plan.json", output_dir="out", num_train_epochs=3)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[PlanCallback("plan.json")])

``training_arguments`` builds the arguments from the plan's ``hf`` export (one micro-batch size:
plan with ``--even`` for the best even split), so they are device-aware (``use_cpu`` on CPU
plans), carry the precision, the warmup and checkpointing through the model's own switch
(``activation_checkpointing``, which Trainer applies with the cache off). ``PlanCallback`` checks
at the start that the arguments are the plan's, and after the first optimizer step that its peak
stays within this device's budget less the plan's headroom (CUDA; the CPU has no peak counter).
"""

from __future__ import annotations

import logging
from dataclasses import fields

from transformers import TrainerCallback, TrainingArguments

from ..errors import ConfigError
from ..memory.cpu import CPUMemoryBackend
from ..planning.export import to_hf
from ..planning.policy import largest_divisor_at_most, usable_bytes
from ..planning.types import Plan
from ..probing.trial import optimizer_state_tensors
from ..training.metrics import PeakMeter
from ..training.checks import load_plan
from ..units import format_bytes

logger = logging.getLogger("autotune")


def training_arguments(plan, **overrides) -> TrainingArguments:
    """``TrainingArguments`` for ``plan`` (a Plan or a plan-file path); ``overrides`` win."""
    plan = load_plan(plan)
    exported = to_hf(plan)
    for note in exported.notes:
        logger.info("autotune: %s", note)
    values = dict(exported.config)
    names = {f.name for f in fields(TrainingArguments)}
    if plan.checkpointing and not plan.sharding.sharded:  # FSDP checkpoints in fsdp_config
        kwargs = "activation_checkpointing_kwargs" if "activation_checkpointing_kwargs" in names \
            else "gradient_checkpointing_kwargs"
        values[kwargs] = {"use_reentrant": False}
    values.update(overrides)
    return TrainingArguments(**values)


class PlanCallback(TrainerCallback):
    """Checks that Trainer runs the plan, and that the plan's micro-batch fits this device.

    ``report`` holds what the first-step check found (None before it ran).
    """

    def __init__(self, plan):
        self.plan: Plan = load_plan(plan)
        self.report: str | None = None
        self._budget: int | None = None
        self._measuring = None
        """While the first step runs: (the PeakMeter, its step context)."""

    def on_train_begin(self, args, state, control, **kwargs):
        check_arguments(self.plan, args)
        if args.device.type == "cuda":
            from ..memory.cuda import CUDAMemoryBackend

            self._budget = CUDAMemoryBackend(args.device.index or 0).info().budget_bytes
        elif args.device.type == "cpu":
            self._budget = _cpu_budget(self.plan)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # The training loop's own meter: torch's allocated bytes on CUDA; on the CPU the step's
        # tensors counted as the probe counts them (the process's RSS would hold the interpreter
        # and libraries too).
        if self.report is not None or self._budget is None or self._measuring is not None:
            return
        meter = PeakMeter(args.device, total_steps=1)
        live = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer)]
        context = meter.step(1, live)
        context.__enter__()
        self._measuring = (meter, context)

    def on_step_end(self, args, state, control, **kwargs):
        if self.report is not None:
            return
        if self._measuring is None:
            self.report = (f"not checked: the first step's peak is measured on CUDA and the CPU only "
                           f"(this is {args.device.type}); run `autotune verify PLAN` to check the "
                           f"plan here")
            logger.info("autotune: %s", self.report)
            return
        meter, context = self._measuring
        context.__exit__(None, None, None)
        self._measuring = None
        peak = meter.peak
        problem = first_step_problem(self.plan, peak_bytes=peak, budget_bytes=self._budget,
                                     micro_batch=args.per_device_train_batch_size)
        self.report = problem or (f"fits: the first step's peak {format_bytes(peak)} is within "
                                  f"{format_bytes(usable_bytes(self._budget, self.plan.headroom))}")
        (logger.warning if problem else logger.info)("autotune: %s", self.report)


def _cpu_budget(plan: Plan) -> int:
    """The budget a CPU plan was made for (its --memory-limit), else the CPU backend's default."""
    if plan.device is not None and plan.device.kind == "cpu":
        return plan.device.budget_bytes
    return CPUMemoryBackend().info().budget_bytes


def check_arguments(plan: Plan, args) -> None:
    """Raise ConfigError when Trainer's batch arithmetic is not the plan's."""
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if effective != plan.target_batch or args.world_size != plan.world_size:
        raise ConfigError(
            f"TrainingArguments give per_device_train_batch_size {args.per_device_train_batch_size} × "
            f"gradient_accumulation_steps {args.gradient_accumulation_steps} × {args.world_size} "
            f"process(es) = {effective}, but the plan is {plan.target_batch} on {plan.world_size} "
            f"process(es); build them with autotune.integrations.transformers.training_arguments(plan)")


def first_step_problem(plan: Plan, *, peak_bytes: int, budget_bytes: int,
                       micro_batch: int | None = None) -> str | None:
    """What to do when the first step's peak passes this device's budget less the plan's headroom;
    None when it fits. ``micro_batch``: the one that ran (Trainer runs the plan's even split,
    which can be smaller than the plan's largest micro-batch; the default is that one)."""
    usable = usable_bytes(budget_bytes, plan.headroom)
    if peak_bytes <= usable:
        return None
    share = plan.per_device_batch
    # The smaller split scales the micro-batch that measured this peak, not the plan's.
    micro = micro_batch or max(plan.micro_batches)
    smaller = largest_divisor_at_most(share, max(1, int(micro * usable / peak_bytes)))
    predicted = (f"; the plan predicted {format_bytes(plan.predicted_peak_bytes)} on "
                 f"{plan.device.name if plan.device else 'its device'}" if plan.predicted_peak_bytes else "")
    return (f"the first step's peak {format_bytes(peak_bytes)} passes {format_bytes(usable)} (this "
            f"device's {format_bytes(budget_bytes)} less the plan's {plan.headroom:.0%} headroom)"
            f"{predicted}. Re-plan on this device (autotune plan MODEL --target-batch "
            f"{plan.target_batch} --even) or check the plan here (autotune verify PLAN); the same "
            f"batch with a smaller micro-batch: per_device_train_batch_size={smaller}, "
            f"gradient_accumulation_steps={share // smaller}")
