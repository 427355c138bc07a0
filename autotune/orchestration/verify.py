"""``autotune verify``: run a plan's micro-batch on the device at hand and confirm it, or re-plan.

A plan's peak was predicted (from a probe elsewhere, or estimated for a GPU profile). Here the
plan's optimizer step runs a few times for real — its precision and checkpointing, the optimizer
state allocated, and with accumulation its window: the first micro-batch, the second with the
first one's gradients alive (and, sharded with sync on the last micro-step only, the last one
too), then the optimizer step, see ``plan_window`` — and its measured peak (plus the plan's DDP
buckets) must stay within the budget less the plan's headroom. The budget is the smaller of the
plan's and this device's: a plan made for a smaller GPU is checked against what that GPU offers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, PlanError, given
from ..memory import backend_for
from ..memory.base import DeviceInfo
from .planner import plan as make_plan
from ..planning.types import Plan
from ..planning.planfile import load_plan, load_planned_workload, model_file_not_found, planned_model_file
from ..planning.policy import usable_bytes
from ..precision import Precision
from ..probing.trial import SetupOutOfMemory, TrialSession
from ..probing.affine_blocks import layout_session

DEFAULT_STEPS = 3


@dataclass(kw_only=True)
class VerifyResult:
    plan: Plan
    """The plan that was checked."""
    device: DeviceInfo
    budget_bytes: int
    """What the check allowed before the headroom: min(the plan's budget, this device's)."""
    usable_bytes: int
    """``budget_bytes`` less the plan's headroom: the measured peak must stay within it."""
    measured_peak_bytes: int | None
    """Largest peak over the steps, plus the plan's DDP buckets; None when a step ran out of memory."""
    steps: int
    predicted_bytes: int | None = None
    """What the plan predicted of what was measured here (None: its ``predicted_peak_bytes``). A
    plan estimated for CUDA predicts reserved memory; checked where nothing reserves (the CPU),
    the measured tensors are compared with the tensors it predicted."""
    new_plan: Plan | None = None
    """The re-plan on this device, when the plan was not confirmed."""
    replan_error: str | None = None
    """Why no plan fits here either (the PlanError message), when re-planning failed."""

    @property
    def confirmed(self) -> bool:
        return self.measured_peak_bytes is not None and self.measured_peak_bytes <= self.usable_bytes

    @property
    def predicted(self) -> int | None:
        return self.predicted_bytes if self.predicted_bytes is not None else self.plan.predicted_peak_bytes

    @property
    def error_bytes(self) -> int | None:
        """Measured less predicted peak (positive: the plan under-estimated)."""
        predicted = self.predicted
        if self.measured_peak_bytes is None or predicted is None:
            return None
        return self.measured_peak_bytes - predicted

    @property
    def error_fraction(self) -> float | None:
        predicted = self.predicted
        return self.error_bytes / predicted if self.error_bytes is not None and predicted else None


def verify_plan(plan, *, workload=None, device=None, memory_limit=None,
                steps: int = DEFAULT_STEPS, replan: bool = True) -> VerifyResult:
    """Check ``plan`` (a ``Plan`` or a plan file path) on this device; re-plan when it fails.

    ``workload`` defaults to the model file the plan records (a changed file is a
    ``PlanFileError``); a relative path is looked for beside the plan file, then from the current
    folder. ``replan=False`` only reports.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        # Zero steps measured nothing, so the plan read as not fitting and was re-planned.
        raise ConfigError(f"{given('steps', steps)}: verify runs the plan's window for at least one "
                          f"real step; give steps >= 1 (default {DEFAULT_STEPS})")
    plan_path = None if isinstance(plan, Plan) else plan
    plan = load_plan(plan) if not isinstance(plan, Plan) else plan
    if workload is None:
        workload = planned_model_file(plan, plan_path)
        if workload is None and not plan.workload.source.startswith("<"):
            raise model_file_not_found(plan, plan_path)
    workload = load_planned_workload(plan, workload if workload is not None else plan.workload.source,
                                     source=str(plan_path) if plan_path is not None else "<plan>")
    backend = backend_for(device, memory_limit, offload=plan.sharding.offload)
    info = backend.info()
    budget = min(info.budget_bytes, plan.budget_bytes or info.budget_bytes)
    usable = usable_bytes(budget, plan.headroom)
    try:
        trials = _measured_windows(plan, workload, backend, steps)
    except SetupOutOfMemory:
        trials = []  # parameters and optimizer state alone pass the budget: nothing fits
    fits = bool(trials) and all(t.fits for t in trials)
    planned_tensors = _planned_tensor_bytes(plan)
    reserved = planned_tensors is not None and all(t.reserved_peak_bytes is not None for t in trials)
    # A plan estimated for CUDA predicts reserved memory: measured so on CUDA, else its tensors.
    peaks = [t.reserved_peak_bytes if reserved else t.peak_bytes for t in trials]
    measured = max(peaks) + plan.ddp_bucket_bytes if fits else None
    predicted = (planned_tensors + plan.ddp_bucket_bytes
                 if planned_tensors is not None and not reserved else None)
    result = VerifyResult(plan=plan, device=info, budget_bytes=budget, usable_bytes=usable,
                          measured_peak_bytes=measured, steps=steps, predicted_bytes=predicted)
    if replan and not result.confirmed:
        try:
            result.new_plan = _replan(plan, workload, device=device, budget=budget)
        except PlanError as exc:  # nothing fits here: still an answer for the report
            result.replan_error = str(exc)
    return result


def _measured_windows(plan: Plan, workload, backend, steps: int) -> list:
    """``steps`` trials of the plan's window, in the probe's session for its layout
    (``layout_session``, on full builds): a sharded plan runs as one of its ranks, with a fake
    process group of the plan's world size outside torchrun, whose collectives move no data but
    whose buffers are as real as the rest; fsdp-offload keeps the shards and optimizer state in
    host memory as it trains; a pipelined plan runs its schedule over all its micro-batches on
    every pipeline rank in turn (outside torchrun), each trial the worst rank's, as its peak is."""
    # A pipeline's window is every micro-batch of the plan (one shape, at least pp of them).
    run = (dict(window=plan.accumulation_steps) if plan.parallel.pp > 1
           else dict(micro_batches=plan_window(plan)))
    with layout_session(workload, backend, session_type=TrialSession, precision=Precision.parse(plan.precision),
                        checkpointing=plan.checkpointing, sharding=plan.sharding, world_size=plan.world_size,
                        shard_group=plan.shard_group, reduce_every_micro_step=plan.reduce_every_micro_step,
                        few_blocks=False, parallel=plan.parallel) as session, session:
        return [session.run(plan.micro_batch, **run) for _ in range(steps)]


def _planned_tensor_bytes(plan: Plan) -> int | None:
    """The tensors' peak a plan estimated for CUDA predicted at its micro-batch (its peak is the
    modelled reserved memory); None for any other plan."""
    if plan.predicted_allocated_bytes is not None:
        return plan.predicted_allocated_bytes - plan.ddp_bucket_bytes
    trial = plan.planned_trial  # a plan made before the plan stated it
    return trial.allocated_peak_bytes if trial is not None else None


def plan_window(plan: Plan) -> list[int]:
    """The micro-steps that set a plan's window peak: the first (no gradients yet), the second
    (every gradient alive; the ones after it are no larger, the split being sorted largest first)
    and, sharded with gradient sync on the last micro-step only, the last (it reduce-scatters
    while the unsharded gradients are held)."""
    sizes = list(plan.micro_batches)
    if len(sizes) <= 2:
        return sizes
    if plan.sharding.sharded and not plan.reduce_every_micro_step:
        return [sizes[0], sizes[1], sizes[-1]]
    return sizes[:2]


def _replan(plan: Plan, workload, *, device, budget: int) -> Plan:
    lr = plan.lr
    return make_plan(
        workload, world_size=plan.world_size, device=device,
        # A token plan stays one: the same tokens per step at the same sequence length.
        **({"target_tokens": plan.target_tokens} if plan.target_tokens is not None
           else {"target_batch": plan.target_batch}), seq_len=plan.seq_len,
        memory_limit=budget, precision=plan.precision,
        # The same setting, so the new micro-batch answers for the one that did not fit.
        checkpointing=plan.checkpointing, headroom=plan.headroom,
        base_lr=lr.base_lr, base_batch=lr.base_batch,
        lr_rule=lr.rule if lr.base_lr is not None else "auto",
        sharding=str(plan.sharding), shard_group=plan.shard_group,
        # The same layout: a model-parallel plan re-planned as data parallel would answer for
        # another run.
        tp=plan.parallel.tp, cp=plan.parallel.cp, pp=plan.parallel.pp,
        pp_schedule=str(plan.parallel.pp_schedule), stages_per_rank=plan.parallel.stages_per_rank,
    )


__all__ = ["DEFAULT_STEPS", "VerifyResult", "plan_window", "verify_plan"]
