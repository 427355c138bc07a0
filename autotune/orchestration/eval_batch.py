"""The plan's eval micro-batch: probed after the training plan, in its precision."""

from __future__ import annotations

from ..errors import option
from ..planning.eval_plan import with_eval_batch
from ..planning.types import Plan
from ..probing.eval_batch import probe_eval
from ..units import format_bytes


def plan_eval_batch(planned: Plan, workload, backend, *, usable: int, extra: int,
                    upper: int | None, agree=None) -> Plan:
    """``planned`` with the largest eval micro-batch whose forward fits ``usable`` bytes (the
    budget less the headroom) less ``extra`` (DDP's buckets, alive in eval too); ``agree``
    (under torchrun) takes the smallest answer of the ranks."""
    if planned.sharding.sharded:
        return with_eval_batch(planned, None, (
            f"not planned: the eval forward of a {planned.sharding} plan is not probed (its "
            f"all-gathers differ from the training step's); evaluate at the training micro-batch "
            f"{planned.micro_batch}, which fits"))
    limit = usable - extra
    found = probe_eval(workload, backend, precision=planned.precision, limit_bytes=limit, upper=upper)
    best = agree(found.max_micro_batch) if agree is not None else found.max_micro_batch
    if best == 0:
        return with_eval_batch(planned, None, (
            f"not planned: the eval forward at micro-batch 1 does not fit within "
            f"{format_bytes(limit)} beside the optimizer state"))
    reason = found.note
    if agree is not None and best != found.max_micro_batch:
        reason += f"; {best}, the smallest answer of the ranks"
    if upper is not None and best == upper:
        reason += f" ({option('max_eval_batch')} {upper}; more may fit)"
    return with_eval_batch(planned, best, reason)


__all__ = ["plan_eval_batch"]
