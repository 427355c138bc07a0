"""A training window's time (one optimizer step on one GPU): compute (the roofline), exposed communication and pipeline bubble.

A window is one optimizer step: ``accumulation steps`` micro-steps (forward, backward and any
recompute each), then one optimizer phase. Communication follows the runtime: FSDP2 gathers the
parameters every micro-step and reduce-scatters either every micro-step or only on the last
(``reduce_every_micro_step``); DDP all-reduces its buckets on the last micro-step only (``no_sync``
before). The optimizer phase's collectives (a sharded gradient norm) run once.

MFU is the model's FLOPs (forward and backward, not the recompute nor the optimizer) over the
window's time and the device's peak for the precision, per GPU; causal attention's FLOPs are those
of the pairs its mask keeps, as counted (``count._causal_share``), where PaLM's and torchtitan's
6N + 12·L·H·Q·T counts the whole square ("we follow the convention and do not account for
sparsity in causal attention", torchtitan's ``get_num_flop_per_token``): by that convention the
same step reads a higher MFU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from ..memory.fake import fake_tensor_limits
from ..precision import Precision
from .comm import Network, exposed_communication, ring_exposure
from .costs import CollectiveCall, StepCosts
from .count import count_steps_costs
from .roofline import loop_time, op_seconds, phase_time

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's ``bucket_cap_mb`` default (torch.nn.parallel.DistributedDataParallel)."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), issued first so the
all-reduces start early in the backward."""

_MICRO_PHASES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class WindowTime:
    """One optimizer step (a window of micro-steps) on one GPU, in seconds, and its rates."""

    step_s: float
    compute_s: float
    """Every op's time: the micro-steps' forward, backward and recompute, and the optimizer."""
    exposed_comm_s: float
    """Communication not hidden under compute."""
    bubble_s: float
    """Pipeline stages waiting for work (0 without pipeline parallelism)."""
    recompute_s: float
    """Part of ``compute_s``: the forward recomputed under activation checkpointing."""
    samples_per_s: float
    """Per GPU."""
    tokens_per_s: float | None
    """Per GPU, where the batch has tokens."""
    mfu: float | None
    """Model FLOP utilisation (no recompute), where the device's peak is known."""
    comm_s: float = 0.0
    """All communication, exposed or hidden."""
    optimizer_s: float = 0.0
    """Part of ``compute_s``: the optimizer phase."""
    loop_s: float = 0.0
    """Part of ``step_s``, not of ``compute_s``: the training loop's own work (``speed``'s loop
    costs per window and per micro-step; 0 on a GPU profile)."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"WindowTime.{field.name} = {value!r} is not finite")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WindowTime":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a 1F1B / GPipe pipeline: (p - 1) / (m + p - 1)."""
    if stages <= 1:
        return 0.0
    return (stages - 1) / (micro_batches + stages - 1)


def ddp_bucket_calls(gradient_bytes: int, world_size: int) -> tuple[CollectiveCall, ...]:
    """DDP's bucket all-reduces for ``gradient_bytes`` of gradients: the fake process group runs
    no DDP, so its buckets are laid out as DDP's reducer does (a small first bucket, then the cap)."""
    if world_size <= 1 or gradient_bytes <= 0:
        return ()
    sizes = [min(DDP_FIRST_BUCKET_BYTES, gradient_bytes)]
    left = gradient_bytes - sizes[0]
    while left > 0:
        sizes.append(min(DDP_BUCKET_BYTES, left))
        left -= sizes[-1]
    return tuple(CollectiveCall(kind="all_reduce", bytes=int(b), group_size=world_size, phase="backward")
                 for b in sizes)


def phase_seconds(costs: StepCosts, speed, precision) -> dict[str, float]:
    """Compute seconds of each phase of ``costs`` on ``speed`` (``roofline.phase_time``: module
    calls, checkpointed blocks and the sharded step's Python each once, in their phase)."""
    return phase_time(costs, speed, precision)


@dataclass(frozen=True)
class MicroStep:
    """One counted (or interpolated) step: compute seconds by phase, the model's FLOPs (forward
    and backward), its tokens and its collectives."""

    seconds: dict
    model_flops: float
    tokens: float | None
    collectives: tuple
    attention_kernel_s: dict = dataclasses.field(default_factory=dict)
    """One attention kernel's seconds (the mean), by phase: what hides a ring collective."""


class StepModel:
    """Steps at any micro-batch from steps counted at a few, on one device: exact where counted,
    else linear in the micro-batch through the two nearest counted (a step's FLOPs, bytes and
    tokens are affine in it; its collectives move parameters, not activations)."""

    def __init__(self, costs: dict[int, StepCosts], speed, precision):
        if not costs:
            raise ValueError("a step model needs at least one counted step")
        self.speed, self.precision = speed, Precision.parse(precision)
        self.counted = {n: MicroStep(
            seconds=phase_seconds(c, speed, self.precision),
            model_flops=sum(op.flops for op in c.ops if op.phase in ("forward", "backward")),
            tokens=c.tokens, collectives=tuple(c.collectives),
            attention_kernel_s=_attention_kernel_seconds(c, speed, self.precision))
            for n, c in costs.items()}

    @property
    def peak_flops(self) -> float | None:
        return self.speed.peak_flops.get(self.precision.value)

    def at(self, n: int) -> MicroStep:
        if n in self.counted:
            return self.counted[n]
        lo, hi, t = self._around(n)
        a, b = self.counted[lo], self.counted[hi]

        def line(x, y):
            return max(0.0, x + t * (y - x))

        phases = set(a.seconds) | set(b.seconds)
        kernels = set(a.attention_kernel_s) | set(b.attention_kernel_s)
        return MicroStep(
            seconds={p: line(a.seconds.get(p, 0.0), b.seconds.get(p, 0.0)) for p in phases},
            model_flops=line(a.model_flops, b.model_flops),
            tokens=None if a.tokens is None or b.tokens is None else line(a.tokens, b.tokens),
            collectives=(a if abs(n - lo) <= abs(n - hi) else b).collectives,
            attention_kernel_s={p: line(a.attention_kernel_s.get(p, 0.0), b.attention_kernel_s.get(p, 0.0))
                                for p in kernels})


    def _around(self, n: int) -> tuple[int, int, float]:
        """The two counted sizes a line to ``n`` is drawn through, and ``n``'s place on it (0 at
        the first, 1 at the second)."""
        sizes = sorted(self.counted)
        if len(sizes) == 1:
            raise ValueError(f"micro-batch {n} was not counted (only {sizes[0]})")
        lo, hi = _bracket(sizes, n)
        return lo, hi, (n - lo) / (hi - lo)


def _attention_kernel_seconds(costs: StepCosts, speed, precision) -> dict:
    """The mean attention kernel's seconds in each phase that runs any (see ``MicroStep``)."""
    seconds, count = {}, {}
    for op in costs.ops:
        if op.op_class == "attention":
            seconds[op.phase] = seconds.get(op.phase, 0.0) + op_seconds(op, speed, precision)
            count[op.phase] = count.get(op.phase, 0) + op.count
    return {phase: seconds[phase] / count[phase] for phase in seconds}


def _bracket(sizes: list[int], n: int) -> tuple[int, int]:
    """The two counted sizes to draw the line through: around ``n``, else the two nearest."""
    below = [s for s in sizes if s < n]
    above = [s for s in sizes if s > n]
    if below and above:
        return below[-1], above[0]
    return (sizes[0], sizes[1]) if not below else (sizes[-2], sizes[-1])


def predict_window(model: StepModel, micro_batches, *, network: Network | None = None,
                   world_size: int = 1, sharding: str = "ddp", shard_group: int | None = None,
                   reduce_every_micro_step: bool = True, gradient_bytes: int = 0,
                   pipeline_stages: int = 1) -> WindowTime:
    """The window of ``micro_batches`` (one rank's split): each micro-step from ``model``, its
    exposed communication, then one optimizer phase, and the training loop's own work
    (``roofline.loop_time`` on ``model.speed``: give a CPU speed with loop costs,
    ``tuning.loop_cost.cpu_speed_with_loop()``).

    ``gradient_bytes`` sizes DDP's buckets (its all-reduces are not on the fake process group);
    ``network`` may be None for one rank."""
    split = [int(n) for n in micro_batches]
    if not split:
        raise ValueError("a window has at least one micro-batch")
    sharded = str(sharding) not in ("ddp", "none")
    hybrid = sharded and shard_group is not None and shard_group < world_size
    micro = recompute = model_flops = exposed = comm = optimizer_s = 0.0
    tokens: float | None = 0.0
    for i, n in enumerate(split):
        step = model.at(n)
        last = i == len(split) - 1
        micro += sum(step.seconds.get(p, 0.0) for p in _MICRO_PHASES)
        recompute += step.seconds.get("recompute", 0.0)
        model_flops += step.model_flops
        tokens = None if tokens is None or step.tokens is None else tokens + step.tokens
        if last:
            optimizer_s = step.seconds.get("optimizer", 0.0)
        calls = _window_calls(step.collectives, last=last, sharded=sharded, world_size=world_size,
                              reduce_every_micro_step=reduce_every_micro_step,
                              gradient_bytes=gradient_bytes)
        if calls and world_size > 1:
            if network is None:
                raise ValueError(f"{world_size} ranks communicate: give the network")
            ring = [c for c in calls if c.ring]
            timed = exposed_communication([c for c in calls if not c.ring], step.seconds, network,
                                          world_size=world_size, hybrid=hybrid)
            ringed = ring_exposure(ring, step.attention_kernel_s, network, world_size=world_size)
            exposed += timed.exposed_s + ringed.exposed_s
            comm += timed.total_s + ringed.total_s
    compute = micro + optimizer_s
    # Each of the p - 1 stages' fill and drain idles one micro-step: (p - 1) / m of the busy time,
    # the bubble_fraction of the whole.
    bubble = micro * (pipeline_stages - 1) / len(split)
    loop = loop_time(model.speed, len(split))
    step_s = compute + exposed + bubble + loop
    peak = model.peak_flops
    return WindowTime(
        step_s=step_s, compute_s=compute, exposed_comm_s=exposed, bubble_s=bubble,
        recompute_s=recompute, samples_per_s=sum(split) / step_s,
        tokens_per_s=tokens / step_s if tokens else None,
        mfu=model_flops / (step_s * peak) if peak else None, comm_s=comm, optimizer_s=optimizer_s,
        loop_s=loop)


def predict_window_time(workload, micro_batches, *, speed, precision="fp32", checkpointing=False,
                      sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                      network: Network | None = None, reduce_every_micro_step: bool = True,
                      gradient_bytes: int | None = None) -> WindowTime:
    """The predicted time of one optimizer step of ``workload``: ``micro_batches`` (one rank's
    split, or one micro-batch) counted on fake tensors (``count.count_steps_costs``, the
    estimate's step) and timed on ``speed`` with ``network`` between ranks. For this CPU pass
    ``speed=tuning.loop_cost.cpu_speed_with_loop()`` so the loop's own cost is in the window
    (``timing`` sits below ``tuning`` and cannot measure it itself)."""
    split = [micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
    counted = count_steps_costs(workload, sorted(set(split)), precision=precision,
                                checkpointing=checkpointing, sharding=sharding,
                                world_size=world_size, shard_group=shard_group,
                                for_gpu=speed.name if speed.cuda else None)
    if gradient_bytes is None:
        gradient_bytes = trainable_bytes(workload) if world_size > 1 else 0
    counted = with_tokens(counted, tokens_per_sample(workload))
    return predict_window(StepModel(counted, speed, precision), split, network=network,
                          world_size=world_size, sharding=sharding, shard_group=shard_group,
                          reduce_every_micro_step=reduce_every_micro_step,
                          gradient_bytes=gradient_bytes)


def with_tokens(counted: dict, tokens: int | None) -> dict:
    """Counted steps with ``tokens`` per sample filled in where the count left them unknown."""
    if tokens is None:
        return counted
    return {n: c if c.tokens is not None else dataclasses.replace(c, tokens=n * tokens)
            for n, c in counted.items()}


def tokens_per_sample(workload) -> int | None:
    """Tokens in one sample where the batch holds token ids (an integer tensor of shape
    (batch, sequence)), from ``make_batch(1)``; None for batches without tokens."""
    ids = [t for t in tree_leaves(workload.batch(1)) if isinstance(t, torch.Tensor) and t.dim() == 2
           and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    return int(ids[0].shape[1]) if ids else None


def trainable_bytes(workload) -> int:
    """Bytes of the model's trainable parameters (its gradients), read from a fake model."""
    if workload.model_is_instance:
        model = workload.model
    else:
        with fake_tensor_limits(workload), FakeTensorMode(allow_non_fake_inputs=True):
            model = workload.new_model()
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def window_collectives(model: StepModel, micro_batches, *, sharding: str = "ddp", world_size: int = 1,
                       reduce_every_micro_step: bool = True,
                       gradient_bytes: int = 0) -> tuple[CollectiveCall, ...]:
    """Every collective one window of ``micro_batches`` issues, micro-step by micro-step, as
    ``predict_window`` times them (DDP's buckets laid out from ``gradient_bytes``)."""
    split = [int(n) for n in micro_batches]
    sharded = str(sharding) not in ("ddp", "none")
    return tuple(call for i, n in enumerate(split) for call in _window_calls(
        model.at(n).collectives, last=i == len(split) - 1, sharded=sharded, world_size=world_size,
        reduce_every_micro_step=reduce_every_micro_step, gradient_bytes=gradient_bytes))


def _window_calls(collectives, *, last: bool, sharded: bool, world_size: int,
                  reduce_every_micro_step: bool, gradient_bytes: int) -> tuple[CollectiveCall, ...]:
    """The collectives one micro-step of the window issues (the optimizer's on the last only)."""
    calls = [c for c in collectives if c.phase != "optimizer" or last]
    if sharded:
        if not (last or reduce_every_micro_step):  # sync off: the gradients stay unsharded
            calls = [c for c in calls if not (c.phase == "backward" and c.kind == "reduce_scatter")]
        return tuple(calls)
    if last and not any(c.kind == "all_reduce" and c.phase == "backward" for c in calls):
        calls += ddp_bucket_calls(gradient_bytes, world_size)
    return tuple(calls)


__all__ = ["DDP_BUCKET_BYTES", "MicroStep", "StepModel", "WindowTime", "bubble_fraction",
           "ddp_bucket_calls", "phase_seconds", "predict_window_time", "predict_window", "tokens_per_sample",
           "trainable_bytes", "window_collectives", "with_tokens"]
