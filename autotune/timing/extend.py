"""A step's costs for a model of N identical blocks, from its costs counted on small builds.

Small builds of a model whose blocks are identical (``probing.affine_blocks``) differ from one
another, and from the whole model, by whole units of blocks: each unit adds the same ops to the
micro-steps (its matmuls, attention, elementwise ops), the same collectives (FSDP2's all-gather
and reduce-scatter of its parameters), module calls, checkpointed blocks, FSDP units and
parameters. The optimizer phase changes otherwise: its foreach ops read every parameter in one
call (each call grows by a unit's parameters), a per-parameter loop adds a unit's calls, a
sharded gradient norm's all-reduce carries one value per parameter. So from steps counted with
``m``, ``m + 1`` and ``m + 2`` units the step with ``N`` follows:

- the micro-steps' ops, each alike (class, phase, one call's FLOPs and bytes, kernel) in both
  builds, in calls along the line through the first two (an op of one build only: not extended);
- the collectives and the optimizer's ops in the order they ran (``StepCosts.optimizer_calls``):
  the calls the second build inserts inserted ``N - m`` times where it inserts them, calls of one
  kind whose size changes with the size along the line;
- the counts (module calls, DTensor ops, checkpointed blocks, FSDP units) along the line.

The third build is the check: where it is not what the first two predict, the costs do not
extend and the caller counts the whole model (``extend_step_costs`` gives None).

Pure data, no torch: tests/test_extend_costs.py checks the rules on hand-made costs and real
layouts' counts against the whole model's, op by op; tests/test_recorded_steps.py a synthesized
probe's record.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections import Counter

from .costs import CollectiveCall, OpCost, StepCosts


def extend_step_costs(costs, *, units: int, repeats: int) -> StepCosts | None:
    """The step with ``repeats`` units of blocks, from ``costs``: the steps counted with ``units``,
    ``units + 1`` and ``units + 2`` (at the same micro-batch); None where the third is not the
    line through the first two. Two steps (``units`` and ``units + 1``): where a third build
    checked the same builds' step at another micro-batch (``extend_checked_step_costs``)."""
    if repeats < units:
        raise ValueError(f"extending from {units} units to {repeats}: only to more units")
    low, high, *third = costs
    if len(third) > 1:
        raise ValueError(f"extending from {len(costs)} builds' steps: two or three")
    if third and _extended(low, high, 2) != normal_form(third[0]):
        return None
    return _extended(low, high, repeats - units)


def extend_checked_step_costs(counted: list[dict[int, StepCosts]], *, units: int,
                              repeats: int) -> dict[int, StepCosts] | None:
    """{micro-batch: the step with ``repeats`` units} from ``counted``, each small build's steps
    ({micro-batch: StepCosts}, builds of ``units``, ``units + 1`` and ``units + 2``), the third
    build counted at the smallest micro-batch only: its check there holds for the others, where
    what makes a build's units differ (the model's code per block, FSDP2's units, the
    optimizer's calls over the parameters) does not depend on the micro-batch, only each op's
    size does, and that the line through the first two builds carries. None where a step does not
    extend. A count of 8B's split [2, 3] on the builds of 2, 3 and 4 blocks skips the largest
    build's step at 3 (0.65 of 4.7 CPU s)."""
    *pair, third = counted
    checked = min(third)
    extended = {}
    for n in sorted(pair[0]):
        steps = [build[n] for build in pair] + ([third[n]] if n == checked else [])
        extended[n] = extend_step_costs(steps, units=units, repeats=repeats)
        if extended[n] is None:
            return None
    return extended


def normal_form(costs: StepCosts) -> StepCosts:
    """``costs`` in the form ``_extended`` gives: ops in one order, zero counts left out."""
    return dataclasses.replace(
        costs, ops=_ops(_per_call(costs.ops)), module_calls=_nonzero(costs.module_calls),
        dtensor_ops=_nonzero(costs.dtensor_ops), dtensor_list_tensors=_nonzero(costs.dtensor_list_tensors))


def _extended(low: StepCosts, high: StepCosts, k: int) -> StepCosts | None:
    """The step with ``k`` more units than ``low``, ``high`` having one more; None where a count
    or size would fall below zero, or the two differ otherwise than by added units."""
    if (low.micro_batch, low.tokens) != (high.micro_batch, high.tokens):
        raise ValueError("steps of one micro-batch extend; these differ")
    if not (_in_order(low) and _in_order(high)):
        return None
    optimizer = _extended_sequence(low.optimizer_calls, high.optimizer_calls, k, _op_kind, _resized_op)
    ops = _extended_ops(_per_call(op for op in low.ops if op.phase != "optimizer"),
                        _per_call(op for op in high.ops if op.phase != "optimizer"), k)
    calls = _extended_sequence(low.collectives, high.collectives, k, _collective_kind,
                               _resized_collective)
    scalars = {name: _line(getattr(low, name), getattr(high, name), k)
               for name in ("checkpoint_blocks", "sharded_units", "sharded_params")}
    counts = {name: _extended_counts(getattr(low, name), getattr(high, name), k)
              for name in ("module_calls", "dtensor_ops", "dtensor_list_tensors")}
    if optimizer is None or ops is None or calls is None or min(scalars.values()) < 0 \
            or any(v is None for v in counts.values()):
        return None
    for name, op_class, flops, moved, kernel, fresh in optimizer:
        ops[(op_class, "optimizer", flops, moved, kernel, fresh)] += 1
    return dataclasses.replace(low, ops=_ops(ops), collectives=calls, optimizer_calls=optimizer,
                               **scalars, **counts)


def _in_order(costs: StepCosts) -> bool:
    """Whether every optimizer op of ``costs`` is in its ``optimizer_calls``."""
    return sum(op.count for op in costs.ops if op.phase == "optimizer") == len(costs.optimizer_calls)


def _line(low, high, k):
    return low + k * (high - low)


def _per_call(ops) -> Counter:
    """{(class, phase, one call's FLOPs, one call's bytes, kernel, one call's fresh bytes): calls}."""
    keyed: Counter = Counter()
    for op in ops:
        keyed[(op.op_class, op.phase, op.flops / op.count, op.bytes / op.count, op.kernel,
               op.fresh / op.count)] += op.count
    return keyed


def _ops(keyed: Counter) -> tuple[OpCost, ...]:
    return tuple(OpCost(op_class=c, phase=p, flops=f * k, bytes=b * k, count=k, kernel=kernel,
                        fresh=fresh * k)
                 for (c, p, f, b, kernel, fresh), k in sorted(keyed.items(), key=lambda item: repr(item[0]))
                 if k)


def _extended_ops(low: Counter, high: Counter, k: int) -> Counter | None:
    """Ops of the micro-steps' phases, each alike in both steps: their calls along the line. An op
    of one step only (whose arguments grow with the blocks) does not extend: None."""
    if low.keys() != high.keys():
        return None
    out: Counter = Counter()
    for key in low:
        calls = _line(low[key], high[key], k)
        if calls < 0:
            return None
        out[key] = calls
    return out


def _extended_sequence(low, high, k: int, kind, resized) -> tuple | None:
    """A sequence of calls in order (collectives; the optimizer's ops): those ``high`` inserts into
    ``low`` (a unit's) inserted ``k`` times where it inserts them, and those of one ``kind`` in
    both but of another size (a foreach op over every parameter, a gradient norm's all-reduce over
    every one) along the line (``resized(a, b, k)``; None for a size below zero)."""
    out: list = []
    for tag, i1, i2, j1, j2 in _opcodes(low, high):
        if tag == "equal":
            out.extend(low[i1:i2])
        elif tag == "insert":
            out.extend(high[j1:j2] * k)
        elif tag == "replace":
            # Calls resized, perhaps with a unit's calls inserted among them: aligned by kind.
            for sub, a1, a2, b1, b2 in _opcodes([kind(c) for c in low[i1:i2]], [kind(c) for c in high[j1:j2]]):
                if sub == "insert":
                    out.extend(high[j1 + b1:j1 + b2] * k)
                    continue
                if sub != "equal":
                    return None
                for a, b in zip(low[i1 + a1:i1 + a2], high[j1 + b1:j1 + b2]):
                    call = resized(a, b, k)
                    if call is None:
                        return None
                    out.append(call)
        else:  # fewer calls with more blocks
            return None
    return tuple(out)


def _opcodes(low, high):
    return difflib.SequenceMatcher(None, low, high, autojunk=False).get_opcodes()


def _collective_kind(call: CollectiveCall) -> CollectiveCall:
    return dataclasses.replace(call, bytes=0)


def _op_kind(call: tuple) -> tuple:
    name, op_class, _, _, kernel, _ = call
    return name, op_class, kernel


def _resized_collective(a: CollectiveCall, b: CollectiveCall, k: int) -> CollectiveCall | None:
    size = _line(a.bytes, b.bytes, k)
    return dataclasses.replace(a, bytes=size) if size >= 0 else None


def _resized_op(a: tuple, b: tuple, k: int) -> tuple | None:
    (name, op_class, f1, b1, kernel, w1), (_, _, f2, b2, _, w2) = a, b
    flops, moved, fresh = _line(f1, f2, k), _line(b1, b2, k), _line(w1, w2, k)
    return (name, op_class, flops, moved, kernel, fresh) if min(flops, moved, fresh) >= 0 else None


def _extended_counts(low: dict, high: dict, k: int) -> dict | None:
    out = {}
    for key in {*low, *high}:
        value = _line(low.get(key, 0), high.get(key, 0), k)
        if value < 0:
            return None
        if value:
            out[key] = value
    return out


def _nonzero(counts: dict) -> dict:
    return {key: value for key, value in counts.items() if value}


__all__ = ["extend_checked_step_costs", "extend_step_costs", "normal_form"]
