"""Seconds of compute from a step's counted costs: a roofline per op, plus its dispatch.

Each op takes the longer of its FLOPs at the device's achievable matmul (or attention) rate and
its bytes at the device's achievable memory bandwidth, plus the fixed cost of issuing one op
(``op_overhead_s``: a kernel launch on a GPU, a dispatch on the CPU). Achievable means a fraction
of the peak: for a GPU profile the constants below, each from a public benchmark; for this CPU
the fractions its own microbenchmark measured (``cpu_profile``), by op size.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ..precision import Precision
from .costs import StepCosts

BREAKDOWN = ("matmul", "attention", "elementwise", "optimizer", "other", "recompute")
"""``compute_time``'s parts: the op classes outside recompute, and recompute on its own."""

GPU_FRACTIONS = {
    # Large bf16/fp16 GEMMs reach about 80% of the dense datasheet peak on an H100 SXM and 86%
    # on an A100 SXM: "Maximum Achievable Matmul FLOPS" table, Stas Bekman, Machine Learning
    # Engineering, compute/accelerator/README.md (github.com/stas00/ml-engineering), measured
    # with its mamf-finder.py.
    "matmul": 0.80,
    # FlashAttention-2 (Dao, 2023, arXiv:2307.08691, abstract and section 4.1): "50-73% of the
    # theoretical maximum FLOPs/s on A100"; the backward pass sits at the low end. Its causal
    # rates count the FLOPs of the pairs the mask keeps, as the step's count does
    # (count._causal_share).
    "attention": 0.50,
    # Achievable memory bandwidth: BabelStream (Deakin et al., "Evaluating attainable memory
    # bandwidth of parallel programming models via BabelStream", 2018; github.com/UoB-HPC/
    # BabelStream results) reaches 85-90% of datasheet HBM bandwidth on NVIDIA data-centre GPUs.
    "memory": 0.85,
}

GPU_OP_OVERHEAD_S = 5e-6
"""A CUDA kernel launch from eager PyTorch costs a few microseconds of CPU time each ("Accelerating
PyTorch with CUDA Graphs", pytorch.org/blog/accelerating-pytorch-with-cuda-graphs/, 2021), the
floor of any op whose kernel is shorter."""


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast a device computes: peaks, achievable fractions and the per-op cost.

    ``fractions``: the achievable fraction of ``peak_flops`` per op class ("matmul",
    "attention") and of ``memory_bandwidth`` ("memory"). ``matmul_curve`` / ``memory_curve``
    (optional, measured): (FLOPs, or bytes, of one op -> fraction) points, interpolated on a log
    scale, for devices where small ops reach less of the peak than large ones (this CPU).
    """

    name: str
    peak_flops: dict[str, float]
    """FLOP/s per precision ("fp32", "bf16", "fp16"); a precision's matmuls run at its rate."""
    memory_bandwidth: float
    """Bytes/s."""
    fractions: dict[str, float]
    op_overhead_s: float = 0.0
    recompute_op_overhead_s: float = 0.0
    """Fixed cost of one recomputed op under activation checkpointing, where it differs from
    ``op_overhead_s`` (0: the same): on the CPU, checkpoint's Python pack/unpack hooks and
    re-entry run on the same thread as the ops."""
    optimizer_op_overhead_s: float = 0.0
    """Fixed cost of one optimizer-phase op, where it differs from ``op_overhead_s`` (0: the
    same): in-place, without autograd, with the optimizer's Python per parameter around it."""
    module_call_s: float = 0.0
    """Python cost of one ``nn.Module`` call beyond its ops (``__call__``'s hook checks and
    dispatch to ``forward``); on a GPU it overlaps the kernels already queued (0: not counted)."""
    checkpoint_block_s: float = 0.0
    """Fixed cost of one checkpointed block beyond its recomputed ops: ``checkpoint``'s set-up in
    the forward and the recompute's entry in backward (0: not counted)."""
    fsdp_step_s: float = 0.0
    """FSDP2's Python per sharded micro-step beyond its units' (the root's hooks), and..."""
    fsdp_unit_s: float = 0.0
    """...per unit (``StepCosts.sharded_units``) and..."""
    fsdp_param_s: float = 0.0
    """...per sharded parameter, per micro-step, beyond the ops the hooks dispatch (measured on
    this CPU by ``sharded_profile``; 0: not counted, as on a GPU, where the Python runs ahead of
    the queued kernels)."""
    dtensor_op_s: float = 0.0
    """DTensor's dispatch per op on DTensors beyond the local op (``StepCosts.dtensor_ops``), and..."""
    dtensor_list_tensor_s: float = 0.0
    """...per DTensor in a tensor list (``StepCosts.dtensor_list_tensors``); 0: not counted."""
    loop_micro_step_s: float = 0.0
    """The training loop's own work per micro-step beyond the step's ops (``autotune train``'s
    ``StepRunner``: moving the batch, counting items, scaling the loss; measured on this CPU by
    ``tuning.loop_cost``; 0: not counted)."""
    loop_window_s: float = 0.0
    """...and per window (one optimizer step: zero_grad, the scheduler, metrics)."""
    cold_write_s_per_byte: float = 0.0
    """Seconds per byte a forward op of a kernel family (``kernel_curves``,
    ``kernel_byte_curves``) takes beyond its curve to write its new tensors (``OpCost.fresh``):
    the families' microbenchmarks write into memory the last call freed, in cache, where a step's
    forward (and checkpoint's recompute) writes the activations it keeps into memory last touched
    a step (a block's backward) ago (``COLD_WRITE_PHASES``; the memory curve's adds already write
    out of cache). Measured on this CPU; 0: not counted (a GPU profile)."""
    matmul_curve: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Per precision, (FLOPs of one matmul, fraction of that precision's peak), ascending."""
    memory_curve: tuple[tuple[float, float], ...] = ()
    """(bytes one op moves, fraction of ``memory_bandwidth``), ascending."""
    kernel_curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Per kernel family (``costs.KERNELS``; measured: this CPU), (FLOPs of one op, fraction of
    the precision's peak), ascending; a family without one takes ``matmul_curve``."""
    kernel_byte_curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Per memory-bound kernel family (measured: this CPU), (bytes one op moves, fraction of
    ``memory_bandwidth``), ascending; a family without one takes ``memory_curve``."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number comes from."""
    cuda: bool = False
    """A CUDA device's speed (a GPU profile's): the steps it times are counted as that device runs
    them (``count.count_steps_costs(for_gpu=name)``: optimizers on their foreach path)."""

    def __post_init__(self):
        numbers = [*self.peak_flops.values(), self.memory_bandwidth, *self.fractions.values(),
                   self.op_overhead_s, self.recompute_op_overhead_s, self.module_call_s,
                   self.optimizer_op_overhead_s,
                   self.checkpoint_block_s, self.loop_micro_step_s, self.loop_window_s,
                   self.cold_write_s_per_byte,
                   self.fsdp_step_s, self.fsdp_unit_s, self.fsdp_param_s, self.dtensor_op_s,
                   self.dtensor_list_tensor_s]
        numbers += [v for curve in self.matmul_curve.values() for point in curve for v in point]
        numbers += [v for point in self.memory_curve for v in point]
        numbers += [v for curves in (self.kernel_curves, self.kernel_byte_curves)
                    for curve in curves.values() for point in curve for v in point]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in numbers):
            raise ValueError(f"device speed {self.name!r}: every number must be finite and >= 0")
        if self.memory_bandwidth <= 0 or any(v <= 0 for v in self.fractions.values()):
            raise ValueError(f"device speed {self.name!r}: bandwidth and fractions must be > 0")

    def flop_rate(self, precision: Precision, op_class: str, flops_per_op: float,
                  kernel: str = "") -> float:
        """FLOP/s one op of ``flops_per_op`` (of the kernel family ``kernel``) reaches."""
        peak = self.peak_flops.get(precision.value) or self.peak_flops["fp32"]
        curve = (self.kernel_curves.get(kernel) or self.matmul_curve.get(precision.value)
                 or self.matmul_curve.get("fp32"))
        if curve and op_class in ("matmul", "attention"):
            return peak * _interpolate(curve, flops_per_op)
        return peak * self.fractions.get(op_class, self.fractions["matmul"])

    def byte_rate(self, bytes_per_op: float, kernel: str = "") -> float:
        """Bytes/s one op moving ``bytes_per_op`` (of the family ``kernel``) reaches."""
        curve = self.kernel_byte_curves.get(kernel)
        if curve:
            return self.memory_bandwidth * _interpolate(curve, bytes_per_op)
        if self.memory_curve:
            return self.memory_bandwidth * _interpolate(self.memory_curve, bytes_per_op)
        return self.memory_bandwidth * self.fractions["memory"]

    def best_flop_rate(self, precision: Precision, op_class: str) -> float:
        """The most FLOP/s ``flop_rate`` gives an op of ``op_class`` at any size or kernel."""
        peak = self.peak_flops.get(precision.value) or self.peak_flops["fp32"]
        fractions = [self.fractions.get(op_class, self.fractions["matmul"])]
        if op_class in ("matmul", "attention"):
            fractions += [y for curve in (*self.kernel_curves.values(), *self.matmul_curve.values())
                          for _, y in curve]
        return peak * max(fractions)

    def best_byte_rate(self) -> float:
        """The most bytes/s ``byte_rate`` gives an op at any size or kernel."""
        fractions = [self.fractions["memory"]] + [y for curve in (self.memory_curve, *self.kernel_byte_curves.values())
                                                  for _, y in curve]
        return self.memory_bandwidth * max(fractions)

    def op_overhead(self, phase: str) -> float:
        """The fixed cost of one op in ``phase``."""
        if phase == "recompute" and self.recompute_op_overhead_s:
            return self.recompute_op_overhead_s
        if phase == "optimizer" and self.optimizer_op_overhead_s:
            return self.optimizer_op_overhead_s
        return self.op_overhead_s


def compute_time(costs: StepCosts, speed: DeviceSpeed, precision="fp32") -> dict[str, float]:
    """Seconds of the step's compute, split as ``BREAKDOWN`` (plus "total"): per op, the longer
    of its FLOPs at the achievable rate and its bytes at the achievable bandwidth, plus the
    device's per-op overhead; and the Python cost of each module call and checkpointed block, where
    the device has one (in "other", or "recompute" for the recomputed forward). Collectives are not
    included (the communication model's part)."""
    precision = Precision.parse(precision)
    parts = dict.fromkeys(BREAKDOWN, 0.0)
    for op in costs.ops:
        parts["recompute" if op.phase == "recompute" else op.op_class] += op_seconds(op, speed, precision)
    for phase, seconds in python_seconds(costs, speed):
        parts["recompute" if phase == "recompute" else "optimizer" if phase == "optimizer"
              else "other"] += seconds
    parts["total"] = sum(parts[k] for k in BREAKDOWN)
    return parts


def phase_time(costs: StepCosts, speed: DeviceSpeed, precision="fp32") -> dict[str, float]:
    """``compute_time``'s total split by phase (forward, backward, recompute, optimizer): each
    op in its phase, and each Python cost in the phase that pays it (``python_seconds``)."""
    precision = Precision.parse(precision)
    seconds: dict[str, float] = {}
    for op in costs.ops:
        seconds[op.phase] = seconds.get(op.phase, 0.0) + op_seconds(op, speed, precision)
    for phase, extra in python_seconds(costs, speed):
        if extra:
            seconds[phase] = seconds.get(phase, 0.0) + extra
    return seconds


def op_seconds(op, speed: DeviceSpeed, precision: Precision) -> float:
    """All ``op.count`` calls of one counted op: each its overhead and its roofline."""
    flops, moved = op.flops / op.count, op.bytes / op.count
    seconds = speed.op_overhead(op.phase)
    if flops:
        seconds += max(flops / speed.flop_rate(precision, op.op_class, flops, op.kernel),
                       moved / speed.byte_rate(moved))
    elif moved:
        seconds += moved / speed.byte_rate(moved, op.kernel)
    if op.phase in COLD_WRITE_PHASES and op.kernel:
        seconds += op.fresh / op.count * speed.cold_write_s_per_byte
    return seconds * op.count


COLD_WRITE_PHASES = ("forward", "recompute")
"""Phases whose new tensors are written out of cache (``DeviceSpeed.cold_write_s_per_byte``): the
forward's, which grow the step's memory by the activations backward reads, and checkpoint's
recompute, which writes a block's activations again into memory the backward of the block after
it freed, that block's traffic ago."""


def python_seconds(costs: StepCosts, speed: DeviceSpeed):
    """(phase, seconds) of the step's Python beyond its ops: module calls in their phase,
    checkpointed blocks in recompute, DTensor dispatch in its ops' phase, and FSDP2's hooks,
    half in the forward and half in the backward (pre/post forward; pre/post backward)."""
    for phase, calls in costs.module_calls.items():
        yield phase, calls * speed.module_call_s
    yield "recompute", costs.checkpoint_blocks * speed.checkpoint_block_s
    if costs.sharded_units:
        fsdp = (speed.fsdp_step_s + costs.sharded_units * speed.fsdp_unit_s
                + costs.sharded_params * speed.fsdp_param_s)
        yield "forward", fsdp / 2
        yield "backward", fsdp / 2
    for phase in {*costs.dtensor_ops, *costs.dtensor_list_tensors}:
        yield phase, (costs.dtensor_ops.get(phase, 0) * speed.dtensor_op_s
                      + costs.dtensor_list_tensors.get(phase, 0) * speed.dtensor_list_tensor_s)


def window_time(costs: StepCosts, speed: DeviceSpeed, micro_steps: int = 1,
                precision="fp32") -> dict[str, float]:
    """Seconds of one window of ``micro_steps`` micro-steps like ``costs`` (one optimizer step),
    as ``autotune train`` runs it: each micro-step's compute, the optimizer phase once, and the
    training loop's own work (``loop``: per window, and per micro-step). Split as ``BREAKDOWN``
    plus "loop" and "total"."""
    if micro_steps < 1:
        raise ValueError(f"window_time: micro_steps must be >= 1, got {micro_steps}")
    parts = compute_time(costs, speed, precision)
    parts.pop("total")
    window = {k: v if k == "optimizer" else v * micro_steps for k, v in parts.items()}
    window["loop"] = loop_time(speed, micro_steps)
    window["total"] = sum(window.values())
    return window


def loop_time(speed: DeviceSpeed, micro_steps: int) -> float:
    """The training loop's own seconds in a window of ``micro_steps`` (0 where ``speed`` has no
    loop costs, as a GPU profile)."""
    return speed.loop_window_s + micro_steps * speed.loop_micro_step_s


def speed_for_profile(profile) -> DeviceSpeed:
    """A GPU profile's speed: its datasheet peaks and bandwidth, the cited ``GPU_FRACTIONS``."""
    from ..gpus.catalog import load_profile

    profile = load_profile(profile)
    tera = 1e12
    peaks = {"fp32": profile.peak_tflops_fp32 * tera}
    for name in ("bf16", "fp16"):
        if profile.supports(name):
            peaks[name] = profile.peak_tflops(name) * tera
    return DeviceSpeed(
        name=profile.name, peak_flops=peaks, memory_bandwidth=profile.memory_bandwidth_gb_per_s * 1e9,
        fractions=dict(GPU_FRACTIONS), op_overhead_s=GPU_OP_OVERHEAD_S,
        sources={"peaks": profile.source or profile.path, "fractions": "roofline.GPU_FRACTIONS"},
        cuda=True)


def _interpolate(curve, x: float) -> float:
    """The curve's fraction at ``x``, linear in log(x) between points, flat beyond the ends."""
    xs = [point[0] for point in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


__all__ = ["BREAKDOWN", "COLD_WRITE_PHASES", "DeviceSpeed", "GPU_FRACTIONS", "GPU_OP_OVERHEAD_S",
           "compute_time", "loop_time", "op_seconds", "phase_time", "python_seconds",
           "speed_for_profile", "window_time"]
