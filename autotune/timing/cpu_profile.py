"""This CPU's speed, measured once by microbenchmarks and cached per machine.

Measured: ``torch.mm`` FLOP/s per precision at a few sizes (the peak is the best; smaller sizes
give the fraction a smaller matmul reaches), memory bandwidth of ``torch.add`` at a few sizes
(operands streamed from memory, not left in cache by the op before), and the cost of dispatching one tiny op. The result is
cached as JSON under ``$XDG_CACHE_HOME/autotune`` (``~/.cache/autotune``), keyed by the CPU
model, the thread count and the torch version; a cache file that does not hold finite, positive
numbers is ignored and measured again.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from .roofline import DeviceSpeed

MATMUL_SIZES = (64, 128, 256, 512, 1024)
"""Square ``torch.mm`` sizes n (2n³ FLOPs each)."""
MEMORY_ELEMENTS = (2**10, 2**13, 2**16, 2**19, 2**22, 2**24)
"""fp32 elements per tensor of the bandwidth microbenchmark (4 KiB to 64 MiB; three tensors)."""
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHE_FILE = "cpu-speed.json"
_MIN_SECONDS = 0.02
"""Each timed repetition runs at least this long; the median of ``_REPEATS`` counts."""
_REPEATS = 7


def cpu_speed(*, refresh: bool = False, cache_dir: Path | None = None) -> DeviceSpeed:
    """This CPU's ``DeviceSpeed`` at the current thread count: from the cache, or measured (and
    cached) when absent, unreadable or ``refresh``."""
    path = (cache_dir or default_cache_dir()) / CACHE_FILE
    key = machine_key()
    if not refresh:
        cached = load_cached(path, key)
        if cached is not None:
            return cached
    speed = measure_cpu_speed()
    save_cached(path, key, speed)
    return speed


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune"


def machine_key() -> str:
    """What the measurement depends on: the CPU, the threads torch uses, torch's version."""
    return f"{_cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def measure_cpu_speed(precisions=tuple(PRECISIONS)) -> DeviceSpeed:
    """Runs the microbenchmarks (a few seconds) at the current thread count; matmuls in
    ``precisions`` (fp32 always)."""
    call = _op_time(_add(1))  # a one-element op from Python: all call, no work
    peaks, curves = {}, {}
    for name in dict.fromkeys(("fp32", *precisions)):
        dtype = PRECISIONS[name]
        rates = [(2.0 * n**3, 2.0 * n**3 / _work_time(_mm(n, dtype), call)) for n in MATMUL_SIZES]
        peak = max(rate for _, rate in rates)
        peaks[name] = peak
        curves[name] = _at_least_smaller(tuple((flops, rate / peak) for flops, rate in rates))
    rates = []
    for n in MEMORY_ELEMENTS:
        moved = 3.0 * 4 * n  # add reads two tensors and writes a third
        rates.append((moved, moved / _work_time(_streaming_add(n), call)))
    kernel_curves = {family: _at_least_smaller(tuple((flops, rate / peaks["fp32"]) for flops, rate in rates))
                     for family, rates in _kernel_rates(call).items()}
    byte_rates = _memory_kernel_rates(call)
    # The bandwidth is the largest op's; smaller ops reach less of it (or more, where the
    # prefetchers and cache lines already in flight help).
    bandwidth = rates[-1][1]
    return DeviceSpeed(
        name=f"CPU: {_cpu_model()}, {torch.get_num_threads()} threads", peak_flops=peaks,
        memory_bandwidth=bandwidth, fractions={"matmul": 1.0, "attention": 1.0, "memory": 1.0},
        op_overhead_s=_training_op_overhead(), recompute_op_overhead_s=_recompute_op_overhead(),
        matmul_curve=curves, kernel_curves=kernel_curves,
        kernel_byte_curves={family: tuple((moved, rate / bandwidth) for moved, rate in rates)
                            for family, rates in byte_rates.items()},
        memory_curve=tuple((moved, rate / bandwidth) for moved, rate in rates),
        sources={"all": "measured on this machine by autotune.timing.cpu_profile"})


def _work_time(op, call: float) -> float:
    # The op's time less the cost of calling it (counted once per op as op_overhead_s); never
    # below half the measured time, where the two are too close to tell apart on a busy machine.
    measured = _op_time(op)
    return max(measured - call, 0.5 * measured)


def _at_least_smaller(curve):
    """A larger matmul reaches at least the rate of a smaller one (it can be tiled into them):
    a dip is a busy moment of the machine, not the kernel."""
    best, out = 0.0, []
    for flops, fraction in curve:
        best = max(best, fraction)
        out.append((flops, best))
    return tuple(out)


def _training_op_overhead() -> float:
    """Seconds per op of a training step's tiny ops: a chain of one-element ops with autograd
    recording, then its backward, divided by the ops the dispatcher saw (forward, backward and
    the engine's own)."""
    x = torch.ones(1, requires_grad=True)

    def step():
        _chain(x).sum().backward()
        x.grad = None

    return _op_time(step) / _dispatched_ops(step)


def _recompute_op_overhead() -> float:
    """Seconds per recomputed op under non-reentrant checkpointing: the same chain, checkpointed,
    less the plain one, per op of its forward (each recomputed once, with checkpoint's hooks)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(1, requires_grad=True)

    def plain():
        _chain(x).sum().backward()
        x.grad = None

    def checkpointed():
        checkpoint(_chain, x, use_reentrant=False).sum().backward()
        x.grad = None

    forward_ops = _dispatched_ops(lambda: _chain(x.detach()))
    extra = _op_time(checkpointed) - _op_time(plain)
    return max(extra / forward_ops, 0.0)


def _chain(y):
    for _ in range(_CHAIN):
        y = torch.tanh(y * 1.0001)
    return y


def _dispatched_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.ops


_CHAIN = 50


def load_cached(path: Path, key: str) -> DeviceSpeed | None:
    """The cached speed for ``key``; None when there is none, or the file is unreadable or holds
    anything but finite, positive numbers (then it is measured again)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))[key]
        speed = DeviceSpeed(
            name=str(entry["name"]), peak_flops={str(k): float(v) for k, v in entry["peak_flops"].items()},
            memory_bandwidth=float(entry["memory_bandwidth"]),
            fractions={str(k): float(v) for k, v in entry["fractions"].items()},
            op_overhead_s=float(entry["op_overhead_s"]),
            recompute_op_overhead_s=float(entry.get("recompute_op_overhead_s", 0.0)),
            matmul_curve=_curves(entry["matmul_curve"]),
            memory_curve=tuple((float(x), float(y)) for x, y in entry["memory_curve"]),
            kernel_curves=_curves(entry.get("kernel_curves", {})),
            kernel_byte_curves=_curves(entry.get("kernel_byte_curves", {})),
            sources={str(k): str(v) for k, v in entry.get("sources", {}).items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not speed.peak_flops.get("fp32") or speed.op_overhead_s <= 0 or not speed.matmul_curve:
        return None
    return speed


def _curves(entry: dict) -> dict:
    return {str(k): tuple((float(x), float(y)) for x, y in v) for k, v in entry.items()}


def save_cached(path: Path, key: str, speed: DeviceSpeed) -> None:
    """Adds ``key``'s entry to the cache file (others kept), written whole then renamed."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {
        "name": speed.name, "peak_flops": speed.peak_flops, "memory_bandwidth": speed.memory_bandwidth,
        "fractions": speed.fractions, "op_overhead_s": speed.op_overhead_s,
        "recompute_op_overhead_s": speed.recompute_op_overhead_s,
        "matmul_curve": {k: [list(p) for p in v] for k, v in speed.matmul_curve.items()},
        "memory_curve": [list(p) for p in speed.memory_curve], "sources": speed.sources,
        "kernel_curves": {k: [list(p) for p in v] for k, v in speed.kernel_curves.items()},
        "kernel_byte_curves": {k: [list(p) for p in v] for k, v in speed.kernel_byte_curves.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    os.replace(partial, path)


CONVOLUTIONS = ((8, 16, 32), (32, 32, 32), (64, 64, 16), (128, 128, 16))
"""3×3 convolutions (in channels, out channels, image side) on batches of 8, fp32."""
ATTENTIONS = ((16, 32), (16, 128), (64, 128), (64, 512))
"""Causal scaled-dot-product attention (head size, sequence length), 8 heads × batch 2, fp32."""


def _kernel_rates(call: float) -> dict[str, list[tuple[float, float]]]:
    """FLOP/s of the kernel families a CPU runs far below its matmul rate (convolutions' backward,
    attention at small head sizes), forward and backward, at a few sizes: (FLOPs of one op, rate)."""
    rates: dict[str, list] = {"convolution": [], "convolution_backward": [], "attention": [],
                              "attention_backward": []}
    for cin, cout, side in CONVOLUTIONS:
        flops = 2.0 * 8 * cout * side * side * cin * 9
        x = torch.randn(8, cin, side, side, requires_grad=True)
        conv = torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        _add_rates(rates, "convolution", flops, lambda: conv(x), call)
    for head, length in ATTENTIONS:
        q, k, v = (torch.randn(2, 8, length, head, requires_grad=True) for _ in range(3))
        flops = 4.0 * 2 * 8 * length * length * head  # torch's sdpa_flop_count (no causal discount)

        def attend(q=q, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        _add_rates(rates, "attention", flops, attend, call)
    return {family: sorted(points) for family, points in rates.items()}


POOLED = ((8, 16, 32), (32, 32, 32), (32, 64, 64))
"""Batch, channels, image side of the pooling and batch-norm microbenchmarks (fp32)."""


def _memory_kernel_rates(call: float) -> dict[str, list[tuple[float, float]]]:
    """Bytes/s of the memory-bound kernel families a CPU runs far below an add's bandwidth
    (2×2 max pooling, training-mode batch norm), forward and backward: (bytes one op moves, rate)."""
    rates: dict[str, list] = {"pooling": [], "pooling_backward": [], "batch_norm": [],
                              "batch_norm_backward": []}
    for batch, channels, side in POOLED:
        x = torch.randn(batch, channels, side, side, requires_grad=True)
        size = 4.0 * x.numel()
        norm = torch.nn.BatchNorm2d(channels)
        # Pooling reads the input, writes a quarter of it and its indices (int64: twice fp32's);
        # its backward reads those and writes the input's gradient. Batch norm reads and writes
        # the input's size, both ways (its backward also reads the input).
        _add_byte_rates(rates, "pooling", size * 1.75, size * 1.75,
                        lambda x=x: torch.nn.functional.max_pool2d(x, 2), call)
        _add_byte_rates(rates, "batch_norm", size * 2, size * 3, lambda x=x, n=norm: n(x), call)
    return {family: sorted(points) for family, points in rates.items()}


def _add_byte_rates(rates: dict, family: str, forward_bytes: float, backward_bytes: float,
                    forward, call: float) -> None:
    forward_time, backward_time = _forward_backward_times(forward, call)
    rates[family].append((forward_bytes, forward_bytes / forward_time))
    rates[f"{family}_backward"].append((backward_bytes, backward_bytes / backward_time))


def _forward_backward_times(forward, call: float) -> tuple[float, float]:
    """Seconds of ``forward`` and of its backward (forward and backward less the forward)."""
    out = forward()
    grad = torch.ones_like(out)

    def both():
        forward().backward(grad)

    forward_time = _work_time(forward, call)
    return forward_time, max(_work_time(both, call) - forward_time, 0.5 * forward_time)


def _add_rates(rates: dict, family: str, flops: float, forward, call: float) -> None:
    """The forward's rate, and the backward's: forward and backward less the forward, for the
    backward's twice the forward's FLOPs (gradients of the input and of the weights or keys)."""
    forward_time, backward_time = _forward_backward_times(forward, call)
    rates[family].append((flops, flops / forward_time))
    rates[f"{family}_backward"].append((2 * flops, 2 * flops / backward_time))


def _mm(n: int, dtype: torch.dtype):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def _add(n: int):
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    return lambda: torch.add(a, b, out=out)


def _streaming_add(n: int):
    """``add`` of n elements whose operands were not touched by the last few ops: it cycles
    through sets of tensors larger together than the last-level cache, as a training step's ops
    read tensors that the ops between (other layers, the optimizer's other parameters) evicted."""
    sets = max(1, -(-_STREAM_BYTES // (3 * 4 * n)))
    tensors = [(torch.randn(n), torch.randn(n), torch.empty(n)) for _ in range(sets)]
    turn = iter(range(2**62))

    def op():
        a, b, out = tensors[next(turn) % sets]
        torch.add(a, b, out=out)

    return op


_STREAM_BYTES = 256 * 2**20
"""Above the last-level cache of the CPUs this runs on (tens of MiB per socket)."""


def _op_time(op) -> float:
    """Seconds per call of ``op``: the median of several timed runs of many calls (the machine's
    typical speed under the load it has, as the steps it predicts will see it)."""
    op()  # first call: allocations, kernel selection
    calls, start = 1, time.perf_counter()
    op()
    once = time.perf_counter() - start
    calls = max(1, int(_MIN_SECONDS / max(once, 1e-7)))
    runs = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            op()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


__all__ = ["cpu_speed", "default_cache_dir", "load_cached", "machine_key", "measure_cpu_speed",
           "save_cached"]
