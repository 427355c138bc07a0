"""The most samples per second per GPU a model-parallel layout could be predicted at, from data
parallelism's counted step: what lets a layout search ranked by throughput skip a layout that
cannot win, where counting and probing it would cost a planner's whole search.

A rank of a layout that splits each sample's work over d = tp × cp × pp GPUs runs, per op, no less
than 1/d of the op data parallelism runs on the same micro-batch: tensor parallelism splits a
matmul's FLOPs and weight bytes over tp and keeps its norms and residuals whole, context
parallelism's ring runs cp attention kernels per block over the same pairs, a pipeline's slowest
stage is no faster than the mean of its stages, and FSDP2 copies at least 1/(tp × pp) of the
parameters data parallelism's FSDP2 copies. On a GPU profile an op's time is its launch overhead
plus the longer of its FLOPs and bytes at fixed achievable rates (``roofline.op_seconds``), which never falls below 1/d
of the whole op's when its FLOPs and bytes fall to 1/d. So each phase of a micro-step of m
samples costs a rank at least f(m) / d of compute, f being data parallelism's counted phase
(forward; backward and, every block checkpointed, the recompute); its optimizer phase,
other collectives and loop count nothing here but FSDP2's (below); the tensor-parallel
collectives nothing overlaps and the schedule's bubble count as ``timing.layout.with_layout`` adds
them to the layout's own prediction.

FSDP2 over the layout's whole data-parallel group (× cp: context-parallel ranks shard with it)
gathers at least 1/tp of what data parallelism's FSDP2 gathers each micro-step (a rank gathers its
tensor-parallel shard of each block, norms whole), and reduce-scatters as much at least once a
window (the last micro-step, where gradients wait unsharded until then). The prediction hides a
phase's collectives under that phase's compute and never more (``comm.exposed_communication``:
the first all-gather waits, each later one hides under one block), so a phase costs at least the
longer of its compute and its collectives, each timed as one collective of all their bytes (one
latency: at most what the calls cost). Not for a pipeline, whose slowest stage need not gather
the most.

f is drawn through two micro-batches data parallelism counted (``StepModel.at``): each op's time
is convex in the micro-batch (a maximum of lines), so that line is at or below f outside the two
and above it only between them, by a hair; ``SLACK`` covers that.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from dataclasses import dataclass

from ..distributed.layout import Layout
from .comm import Network, collective_time
from .costs import CollectiveCall, StepCosts
from .layout import with_layout
from .roofline import DeviceSpeed, python_seconds
from .window import MicroStep, StepModel, WindowTime

SLACK = 0.97
"""The share of the drawn compute the bound keeps. Between two counted micro-batches the line lies
above a convex step (a roofline op turning from bytes- to FLOP-bound); data parallelism's split
counts adjacent sizes (or one, and the next is counted), so only a pinned micro-batch's remainder
leaves sizes between them. A margin, not a measurement: tests/test_throughput_bound.py checks
that every bound stays above the layout's own prediction."""

@dataclass(frozen=True)
class ReferenceStep:
    """One of data parallelism's counted settings, as a step at any micro-batch."""

    model: StepModel
    every_block: bool
    """Every block checkpointed: its recompute is a floor for any layout's with every block."""
    sharded_calls: tuple[CollectiveCall, ...] = ()
    """Its micro-step's FSDP2 all-gathers and reduce-scatters, where it shards over its whole
    world (empty: DDP, or a shard group)."""


def phase_floors(references: list[ReferenceStep], micro_batch: int, *, recompute: bool) -> tuple[float, float]:
    """The least (forward, backward) compute seconds data parallelism's counted steps draw for one
    micro-step of ``micro_batch``; the backward with the every-block recompute where ``recompute``
    and a counted setting had it (none counted: no recompute, a lower floor)."""
    forward = min(_phases(r.model, micro_batch, ("forward",)) for r in references)
    backward = min(_phases(r.model, micro_batch, ("backward",)) for r in references)
    redone = [_phases(r.model, micro_batch, ("backward", "recompute")) for r in references if r.every_block]
    if recompute and redone:
        backward = min(redone)
    return forward, backward


def recompute_floor(references: list[ReferenceStep], micro_batch: int) -> float:
    """The least seconds data parallelism's counted every-block steps draw for one micro-step's
    recompute of ``micro_batch`` (0 where none had every block checkpointed)."""
    return min((_phases(r.model, micro_batch, ("recompute",)) for r in references if r.every_block), default=0.0)


def micro_step_floor(references: list[ReferenceStep], micro_batch: int, *, recompute: bool) -> float:
    """``phase_floors``' sum: one micro-step's least compute seconds."""
    return sum(phase_floors(references, micro_batch, recompute=recompute))


def _phases(model: StepModel, micro_batch: int, phases) -> float:
    step = model.at(micro_batch)
    return sum(step.seconds.get(p, 0.0) for p in phases)


def sharded_seconds(references: list[ReferenceStep], layout: Layout, *, group: int,
                    network: Network) -> tuple[float, float, float] | None:
    """(forward all-gathers, backward all-gathers, reduce-scatters) of one of ``layout``'s
    micro-steps at least, FSDP2 over ``group`` ranks: data parallelism's bytes over tp, each kind
    of each phase as one collective; None where no reference shards over its whole world."""
    calls = next((r.sharded_calls for r in references if r.sharded_calls), ())
    if not calls or group <= 1:
        return None

    def timed(kind: str, phases) -> float:
        nbytes = sum(c.bytes for c in calls if c.kind == kind and c.phase in phases) / layout.tp
        return collective_time(kind, nbytes, group, network.link(group)) if nbytes else 0.0

    return (timed("all_gather", ("forward",)), timed("all_gather", ("backward", "recompute")),
            timed("reduce_scatter", ("backward", "recompute")))


def fastest_possible(references: list[ReferenceStep], layout: Layout, split: list[int], *,
                     recompute: bool, network: Network, seq_len: int | None, hidden: int | None,
                     blocks: int, activation_bytes: int, sharded_group: int | None = None,
                     slack: float = SLACK) -> float:
    """The most samples per second per GPU ``layout`` could be predicted at with the window
    ``split`` (one data-parallel rank's micro-batches): the module's floor of its compute, with
    FSDP2's collectives over ``sharded_group`` ranks where given, its tensor-parallel collectives
    and its bubble (``with_layout``)."""
    if not references or not split:
        raise ValueError("a bound needs data parallelism's counted steps and a split")
    degree = layout.tp * layout.cp * layout.pp
    sharded = (sharded_seconds(references, layout, group=sharded_group, network=network)
               if sharded_group and layout.pp == 1 else None)
    gather_f, gather_b, scatter = sharded or (0.0, 0.0, 0.0)
    window = 0.0
    # By size (a split has one or two): a share of thousands is split thousands of ways.
    for n, count in Counter(split).items():
        forward, backward = (slack * s / degree for s in phase_floors(references, n, recompute=recompute))
        window += count * (max(forward, gather_f) + max(backward, gather_b))
        if n == split[-1]:  # the last micro-step reduce-scatters
            window += max(backward, gather_b + scatter) - max(backward, gather_b)
    if window <= 0:
        return float("inf")
    samples = sum(split)
    rank = WindowTime(step_s=window, compute_s=window, exposed_comm_s=0.0, bubble_s=0.0,
                      recompute_s=0.0, samples_per_s=samples / window, tokens_per_s=None, mfu=None)
    return with_layout(rank, layout, micro_batches=split, seq_len=seq_len, hidden=hidden, blocks=blocks,
                       activation_bytes=activation_bytes, network=network).samples_per_s


class FloorSteps(StepModel):
    """A layout's own step at any micro-batch, never slower than its count there: exact where
    counted; elsewhere each phase's ops, grouped by class, at their FLOPs and bytes drawn through
    the counted sizes (affine in the micro-batch) and the fastest rates the device reaches at any
    size, and the fewest ops and Python of the counted sizes, less ``SLACK``. A line through
    two counted micro-batches is not a floor: a micro-batch of 1 skips some copies (a dimension
    of one), so the ops and bytes of 1 and 2 draw more per sample than the sizes beyond take
    (through 1 and 2, tests/sp_decoder_model.py's TP 2 step drew micro-batch 8 at 946 samples/s
    per GPU, where its count there predicts 1026; its bytes 3% above those counted), and where a
    device's rates grow with an op's size (a measured curve) a small op's time rises slower than
    its FLOPs. Its collectives are the largest counted size's at or below it (activations' grow
    with the micro-batch, parameters' do not), context parallelism's ring hidden whole under its
    attention."""

    def __init__(self, costs: dict[int, StepCosts], speed: DeviceSpeed, precision):
        super().__init__(costs, speed, precision)
        self._costs = costs
        self._groups = {n: _phase_groups(c) for n, c in costs.items()}

    def at(self, n: int) -> MicroStep:
        if n in self.counted:
            return self.counted[n]
        lo, hi, t = self._around(n)

        def line(x, y):
            return max(0.0, x + t * (y - x))

        seconds: dict[str, float] = defaultdict(float)
        for key in self._groups[lo].keys() | self._groups[hi].keys():
            a, b = self._groups[lo].get(key, (0, 0.0, 0.0)), self._groups[hi].get(key, (0, 0.0, 0.0))
            phase, op_class = key
            flops, moved = line(a[1], b[1]), line(a[2], b[2])
            seconds[phase] += SLACK * (min(a[0], b[0]) * self.speed.op_overhead(phase) + max(
                flops / self.speed.best_flop_rate(self.precision, op_class) if flops else 0.0,
                moved / self.speed.best_byte_rate()))
        python = [dict(_summed(python_seconds(self._costs[s], self.speed))) for s in (lo, hi)]
        for phase in python[0].keys() & python[1].keys():
            seconds[phase] += min(python[0][phase], python[1][phase])
        below = max((s for s in self.counted if s <= n), default=lo)
        a, b = self.counted[lo], self.counted[hi]
        return MicroStep(seconds=dict(seconds), model_flops=line(a.model_flops, b.model_flops),
                         tokens=None if a.tokens is None or b.tokens is None else line(a.tokens, b.tokens),
                         collectives=self.counted[below].collectives,
                         attention_kernel_s={p: float("inf") for p in a.attention_kernel_s})


class RecomputedFloorSteps(FloorSteps):
    """A layout's step with every block checkpointed, never slower than its step counted without
    checkpointing (``FloorSteps`` of those counts) plus a recompute no faster than 1/d of data
    parallelism's (``recompute_floor``, d = ``degree``, less ``SLACK``): the step with every block
    runs every op of the step without, and recomputes each block's forward, of which a rank of the
    layout runs at least 1/d of data parallelism's (see the module). No more time where data
    parallelism counted no recompute. The recompute's collectives (FSDP2's re-gathers, the ring's)
    are left out: a floor."""

    def __init__(self, costs: dict[int, StepCosts], speed: DeviceSpeed, precision,
                 references: list[ReferenceStep], degree: int):
        super().__init__(costs, speed, precision)
        self._references, self._degree = references, degree

    def at(self, n: int) -> MicroStep:
        step = super().at(n)
        seconds = dict(step.seconds)
        seconds["recompute"] = seconds.get("recompute", 0.0) + SLACK * recompute_floor(self._references, n) / self._degree
        return dataclasses.replace(step, seconds=seconds)


def _phase_groups(costs: StepCosts) -> dict[tuple[str, str], tuple[int, float, float]]:
    groups: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for op in costs.ops:
        group = groups[(op.phase, op.op_class)]
        group[0] += op.count
        group[1] += op.flops
        group[2] += op.bytes
    return {key: tuple(value) for key, value in groups.items()}


def _summed(pairs) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for phase, seconds in pairs:
        out[phase] += seconds
    return out


__all__ = ["FloorSteps", "RecomputedFloorSteps", "ReferenceStep", "SLACK", "fastest_possible", "micro_step_floor",
           "phase_floors", "recompute_floor", "sharded_seconds"]
