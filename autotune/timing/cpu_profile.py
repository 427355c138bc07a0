"""This CPU's speed, measured once by microbenchmarks and cached per machine.

Measured: ``torch.mm`` FLOP/s per precision at a few sizes (the peak is the best; smaller sizes
give the fraction a smaller matmul reaches), memory bandwidth of ``torch.add`` at a few sizes
(operands streamed from memory, not left in cache by the op before), kernel families a CPU runs
below those rates, and the fixed costs of an op, a module call and a checkpointed block. At one
thread every timing reads the thread's CPU clock (``clock``). The result is cached as JSON under
``$XDG_CACHE_HOME/autotune`` (``~/.cache/autotune``), keyed by the CPU model, the thread count, the
torch version and ``PROFILE_VERSION``; a cache file that does not hold finite, positive numbers is
ignored and measured again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from .costs import causal_share
from .roofline import DeviceSpeed
from .sharded_profile import SHARDED_FIELDS, measure_sharded_overheads

MATMUL_SIZES = (64, 128, 256, 512, 1024)
"""Square ``torch.mm`` sizes n (2n³ FLOPs each)."""
MEMORY_ELEMENTS = (2**10, 2**13, 2**16, 2**19, 2**22, 2**24)
"""fp32 elements per tensor of the bandwidth microbenchmark (4 KiB to 64 MiB; three tensors)."""
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHE_FILE = "cpu-speed.json"
PROFILE_VERSION = 8
"""2: the CPU clock at one thread, module-call, checkpoint-block and optimizer-op costs, layer
norm / softmax / embedding / NLL loss curves. 3: checkpoint costs from transformer-like layers.
4: pooling and batch-norm bytes by the step's own rule; FSDP2's and DTensor's per-call costs
(``sharded_profile``). 5: causal attention's rate per FLOP its mask keeps, as the counts now count
it (``costs.causal_share``). 6: each curve's sizes, and the runs each cost is the difference of
(FSDP2's and DTensor's too), timed in turns (``_op_times``); the bandwidth's outputs written before
they are timed. 7: in-place adds' curve (``inplace``); attention with and without ``is_causal``, two
families; GELU and SiLU curves; backward microbenchmarks that do not add their gradients into the
last run's."""
_MIN_SECONDS = 0.02
"""Each timed repetition runs at least this long; the median of ``_REPEATS`` counts."""
_REPEATS = 7


def cpu_speed(*, refresh: bool = False, cache_dir: Path | None = None) -> DeviceSpeed:
    """This CPU's ``DeviceSpeed`` at the current thread count: from the cache, or measured (and
    cached) when absent, unreadable or ``refresh``."""
    path = cache_path(cache_dir)
    key = machine_key()
    if not refresh:
        cached = load_cached(path, key)
        if cached is not None:
            return cached
    speed = measure_cpu_speed()
    save_cached(path, key, speed)
    return speed


def cache_path(cache_dir: Path | None = None) -> Path:
    """The cache file: under ``cache_dir``, or else ``default_cache_dir()``."""
    return (cache_dir or default_cache_dir()) / CACHE_FILE


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune"


def machine_key() -> str:
    """What the measurement depends on: the CPU, the threads torch uses, torch's version, and the
    microbenchmarks' own version (``PROFILE_VERSION``: entries measured by older ones are stale)."""
    return (f"{_cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|profile={PROFILE_VERSION}")


def measure_cpu_speed(precisions=tuple(PRECISIONS)) -> DeviceSpeed:
    """Runs the microbenchmarks (a few seconds) at the current thread count; matmuls in
    ``precisions`` (fp32 always)."""
    peaks, curves = {}, {}
    for name in dict.fromkeys(("fp32", *precisions)):
        dtype = PRECISIONS[name]
        times = _work_times([_mm(n, dtype) for n in MATMUL_SIZES])
        rates = [(2.0 * n**3, 2.0 * n**3 / seconds) for n, seconds in zip(MATMUL_SIZES, times)]
        peak = max(rate for _, rate in rates)
        peaks[name] = peak
        curves[name] = _at_least_smaller(tuple((flops, rate / peak) for flops, rate in rates))
    # Both adds read two tensors and write a third (the in-place one's output is one of the two).
    times = _work_times(_streaming_adds(MEMORY_ELEMENTS, inplace=True))
    rates, inplace = ([(3.0 * 4 * n, 3.0 * 4 * n / seconds) for n, seconds in zip(MEMORY_ELEMENTS, found)]
                      for found in (times[:len(MEMORY_ELEMENTS)], times[len(MEMORY_ELEMENTS):]))
    kernel_curves = {family: _at_least_smaller(tuple((flops, rate / peaks["fp32"]) for flops, rate in rates))
                     for family, rates in _kernel_rates().items()}
    byte_rates = _memory_kernel_rates()
    byte_rates.update(_counted_kernel_rates())
    byte_rates["inplace"] = inplace
    op_overhead = _training_op_overhead()
    cold_write = _cold_write_cost()
    checkpoint_block, recompute_op = _checkpoint_overheads(op_overhead)
    sharded = measure_sharded_overheads(op_overhead, _op_times, _dispatched_ops)
    # The bandwidth is the largest op's; smaller ops reach less of it (or more, where the
    # prefetchers and cache lines already in flight help).
    bandwidth = rates[-1][1]
    return DeviceSpeed(
        name=f"CPU: {_cpu_model()}, {_threads(torch.get_num_threads())}", peak_flops=peaks,
        memory_bandwidth=bandwidth, fractions={"matmul": 1.0, "attention": 1.0, "memory": 1.0},
        op_overhead_s=op_overhead, recompute_op_overhead_s=recompute_op,
        optimizer_op_overhead_s=_optimizer_op_overhead(),
        module_call_s=_module_call_overhead(), checkpoint_block_s=checkpoint_block,
        cold_write_s_per_byte=cold_write, **dataclasses.asdict(sharded), matmul_curve=curves,
        kernel_curves=kernel_curves,
        kernel_byte_curves={family: tuple((moved, rate / bandwidth) for moved, rate in rates)
                            for family, rates in byte_rates.items()},
        memory_curve=tuple((moved, rate / bandwidth) for moved, rate in rates),
        sources={"all": "measured on this machine by autotune.timing.cpu_profile"})


def speed_probe() -> tuple[float, float, float]:
    """A fraction of a second's look at the CPU's speed now: (FLOP/s of a 256² matmul, bytes/s of
    a streamed add of 2^19 elements, seconds of a one-element op). ``scaled_speed`` rescales a
    full measurement by two of these, taken then and now, on a machine whose load drifts."""
    n, elements = 256, 2**19
    call, matmul, add = _op_times([_add(1), _mm(n, torch.float32), _streaming_adds([elements])[0]])
    return 2.0 * n**3 / _less_call(matmul, call), 3.0 * 4 * elements / _less_call(add, call), call


def scaled_speed(speed: DeviceSpeed, then: tuple, now: tuple) -> DeviceSpeed:
    """``speed`` (measured when ``speed_probe`` gave ``then``) at the speed ``now`` shows: peaks
    by the matmul's ratio, bandwidth (and the cold write's cost per byte) by the add's, every
    per-call cost (FSDP2's and DTensor's too) by the one-element op's."""
    flops, moved, call = now[0] / then[0], now[1] / then[1], now[2] / then[2]
    return dataclasses.replace(
        speed, peak_flops={k: v * flops for k, v in speed.peak_flops.items()},
        memory_bandwidth=speed.memory_bandwidth * moved,
        cold_write_s_per_byte=speed.cold_write_s_per_byte / moved,
        op_overhead_s=speed.op_overhead_s * call,
        recompute_op_overhead_s=speed.recompute_op_overhead_s * call,
        optimizer_op_overhead_s=speed.optimizer_op_overhead_s * call,
        module_call_s=speed.module_call_s * call, checkpoint_block_s=speed.checkpoint_block_s * call,
        loop_micro_step_s=speed.loop_micro_step_s * call, loop_window_s=speed.loop_window_s * call,
        **{name: getattr(speed, name) * call for name in SHARDED_FIELDS})


def _work_times(ops) -> list[float]:
    """Each op's time less the cost of calling it (counted once per op as ``op_overhead_s``): a
    one-element op from Python, all call and no work, timed with them."""
    call, *times = _op_times([_add(1), *ops])
    return [_less_call(measured, call) for measured in times]


def _less_call(measured: float, call: float) -> float:
    # Never below half the measured time, where the two are too close to tell apart on a busy
    # machine.
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
    """Seconds per op of a training step's ops when their work is nil: a transformer-like block
    written with torch's functions (layer norm, linear, attention, GELU, cross-entropy, views) on
    a few elements, forward and backward, divided by the ops the dispatcher saw (forward,
    backward and the engine's own). Its ops are those models dispatch: composite functions,
    several outputs, the autograd nodes that save them; a chain of one-element adds costs half
    as much per op."""
    functional = torch.nn.functional
    x = torch.randn(2, 3, 4, requires_grad=True)
    qkv, qkv_bias = torch.randn(12, 4, requires_grad=True), torch.zeros(12, requires_grad=True)
    out, out_bias = torch.randn(4, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    scale, shift = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    targets = torch.tensor([1, 2, 0, 3, 1, 2])
    leaves = (x, qkv, qkv_bias, out, out_bias, scale, shift)

    def step():
        h = functional.layer_norm(x, (4,), scale, shift)
        q, k, v = functional.linear(h, qkv, qkv_bias).view(2, 3, 3, 1, 4).permute(2, 0, 3, 1, 4)
        a = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + functional.gelu(functional.linear(a.transpose(1, 2).reshape(2, 3, 4), out, out_bias))
        functional.cross_entropy(h.reshape(-1, 4), targets).backward()
        for leaf in leaves:
            leaf.grad = None

    return _op_time(step) / _dispatched_ops(step)


def _optimizer_op_overhead() -> float:
    """Seconds per op of the optimizer phase when its work is nil: gradient clipping and an AdamW
    step (its for-loop form, torch's default for CPU tensors) over one-element parameters, per
    op dispatched; its Python per parameter is spread over that parameter's ops."""
    params = [torch.zeros(1, requires_grad=True) for _ in range(_CHAIN)]
    optimizer = torch.optim.AdamW(params, foreach=False)
    for param in params:
        param.grad = torch.ones(1)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    step()  # the state is created by the first step
    return _op_time(step) / _dispatched_ops(step)


def _checkpoint_overheads(op_overhead: float) -> tuple[float, float]:
    """(seconds per checkpointed block, seconds per recomputed op) under non-reentrant
    checkpointing: a checkpointed stack of transformer-like layers (layer norm, linear, GELU,
    linear, residual; written with torch's functions, so no module calls) on a few elements, less
    the same stack without checkpointing, at one layer and at ``_CHECKPOINT_LAYERS``; the extra per
    extra recomputed op is the op's, what is left at one layer the block's (its set-up in forward,
    the recompute's entry in backward). Real layers' ops, not a chain of one-element tanh: their
    recompute packs and unpacks more saved tensors per op (weights, layer norm's statistics, GELU's
    input), about three times the tanh chain's cost per op."""
    def extra(layers: int) -> tuple[float, int]:
        # Checkpointing also runs ops of its own outside the recompute (detaches of the saved
        # tensors): the step counts them in their phase at ``op_overhead`` each.
        body, leaves = _checkpoint_layers(layers)
        plain, checkpointed = _plain_and_checkpointed(body, leaves)
        recomputed = _recomputed_ops(body, leaves)
        others = _dispatched_ops(checkpointed) - _dispatched_ops(plain) - recomputed
        checkpointed_time, plain_time = _op_times([checkpointed, plain])
        return checkpointed_time - plain_time - others * op_overhead, recomputed

    (short, short_ops), (long, long_ops) = extra(1), extra(_CHECKPOINT_LAYERS)
    per_op = max((long - short) / (long_ops - short_ops), 0.0)
    return max(short - per_op * short_ops, 0.0), per_op


def _plain_and_checkpointed(body, leaves):
    """Forward and backward of ``body`` on ``leaves[0]``: as it is, and checkpointed."""
    from torch.utils.checkpoint import checkpoint

    def clear():
        for leaf in leaves:
            leaf.grad = None

    def plain():
        body(leaves[0]).sum().backward()
        clear()

    def checkpointed():
        checkpoint(body, leaves[0], use_reentrant=False).sum().backward()
        clear()

    return plain, checkpointed


def _recomputed_ops(body, leaves) -> int:
    """The ops checkpoint's recompute of ``body`` reruns: it stops at the last saved tensor the
    backward needs, so fewer than the forward's."""
    return _dispatched_ops(_plain_and_checkpointed(body, leaves)[1], recomputed=True)


_CHECKPOINT_LAYERS = 8


def _checkpoint_layers(layers: int, width: int = 4):
    """A stack of ``layers`` pre-norm MLP layers on a (2, width) input, as a function of the
    input, and its leaves (the input first)."""
    functional = torch.nn.functional
    weights = [tuple(torch.randn(*shape, requires_grad=True) for shape in
                     ((4 * width, width), (4 * width,), (width, 4 * width), (width,), (width,), (width,)))
               for _ in range(layers)]

    def body(h):
        for up, up_bias, down, down_bias, scale, shift in weights:
            inner = functional.gelu(functional.linear(functional.layer_norm(h, (width,), scale, shift),
                                                      up, up_bias))
            h = h + functional.linear(inner, down, down_bias)
        return h

    return body, [torch.randn(2, width, requires_grad=True), *(w for layer in weights for w in layer)]


def _module_call_overhead() -> float:
    """Seconds of one ``nn.Module`` call beyond its op: a forward through a stack of modules
    that each run one one-element op, less the same ops inline, per module (grad mode on, as in
    training)."""
    modules = torch.nn.ModuleList(_Scale() for _ in range(_CHAIN))
    x = torch.ones(1, requires_grad=True)

    def through_modules():
        y = x
        for module in modules:
            y = module(y)
        return y

    def inline():
        y = x
        for _ in range(_CHAIN):
            y = y * 1.0001
        return y

    through_time, inline_time = _op_times([through_modules, inline])
    return max((through_time - inline_time) / _CHAIN, 0.0)


class _Scale(torch.nn.Module):
    def forward(self, y):
        return y * 1.0001


def _dispatched_ops(fn, *, recomputed: bool = False) -> int:
    """The ops ``fn`` dispatches; with ``recomputed``, only checkpoint's recompute (grad mode on
    inside a backward node: ``count``'s "recompute" phase)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not recomputed or (torch._C._current_autograd_node() is not None
                                  and torch.is_grad_enabled()):
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
            module_call_s=float(entry.get("module_call_s", 0.0)),
            optimizer_op_overhead_s=float(entry.get("optimizer_op_overhead_s", 0.0)),
            checkpoint_block_s=float(entry.get("checkpoint_block_s", 0.0)),
            loop_micro_step_s=float(entry.get("loop_micro_step_s", 0.0)),
            loop_window_s=float(entry.get("loop_window_s", 0.0)),
            cold_write_s_per_byte=float(entry.get("cold_write_s_per_byte", 0.0)),
            **{name: float(entry.get(name, 0.0)) for name in SHARDED_FIELDS},
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
        "module_call_s": speed.module_call_s, "checkpoint_block_s": speed.checkpoint_block_s,
        "optimizer_op_overhead_s": speed.optimizer_op_overhead_s,
        "loop_micro_step_s": speed.loop_micro_step_s, "loop_window_s": speed.loop_window_s,
        "cold_write_s_per_byte": speed.cold_write_s_per_byte,
        **{name: getattr(speed, name) for name in SHARDED_FIELDS},
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


def _kernel_rates() -> dict[str, list[tuple[float, float]]]:
    """FLOP/s of the kernel families a CPU runs far below its matmul rate (convolutions' backward,
    attention at small head sizes), forward and backward, at a few sizes: (FLOPs of one op, rate)."""
    points = []
    for cin, cout, side in CONVOLUTIONS:
        flops = 2.0 * 8 * cout * side * side * cin * 9
        x = torch.randn(8, cin, side, side, requires_grad=True)
        conv = torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        points.append(("convolution", flops, 2 * flops, lambda conv=conv, x=x: conv(x)))
    for head, length in ATTENTIONS:
        q, k, v = (torch.randn(2, 8, length, head, requires_grad=True) for _ in range(3))
        # torch's sdpa_flop_count: of every pair, and of the pairs the causal mask keeps (what the
        # counts time a causal kernel at); each kind its own family, as the counts tell them
        # apart (``count._kernel``): at 128 tokens this CPU's causal kernel does the whole
        # square's work, and a causal rate would time a masked or unmasked attention at twice it.
        flops = 4.0 * 2 * 8 * length * length * head
        for family, causal, counted in (("attention", False, flops),
                                        ("attention_causal", True, flops * causal_share(length, length))):
            def attend(q=q, k=k, v=v, causal=causal):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            points.append((family, counted, 2 * counted, attend))
    return _rates(points)


POOLED = ((8, 16, 32), (32, 32, 32), (32, 64, 64))
"""Batch, channels, image side of the pooling and batch-norm microbenchmarks (fp32)."""


def _memory_kernel_rates() -> dict[str, list[tuple[float, float]]]:
    """Bytes/s of the memory-bound kernel families a CPU runs far below an add's bandwidth
    (2×2 max pooling, training-mode batch norm), forward and backward: (bytes one op moves, rate)."""
    points = []
    for batch, channels, side in POOLED:
        x = torch.randn(batch, channels, side, side, requires_grad=True)
        norm = torch.nn.BatchNorm2d(channels)
        # Bytes by the step's own rule (``_family_bytes``), as the step's ops are priced: the
        # pooling backward reads the output's gradient, the input and the indices (2.75 times the
        # input's size), not the 1.75 its forward moves.
        for family, forward in (("pooling", lambda x=x: torch.nn.functional.max_pool2d(x, 2)),
                                ("batch_norm", lambda x=x, n=norm: n(x))):
            points.append((family, *_family_bytes(family, forward), forward))
    return _rates(points)


ROWS = ((64, 64), (512, 256), (4096, 512))
"""(rows, features) of the layer norm, softmax, activation and loss microbenchmarks (fp32);
embedding looks up ``rows`` tokens in a table of 8192 rows of ``features``."""


def _counted_kernel_rates() -> dict[str, list[tuple[float, float]]]:
    """Bytes/s of layer norm, softmax (and log-softmax), embedding, the NLL loss, GELU and SiLU,
    forward and backward, at a few sizes. Their bytes are counted as the step's are (``count``'s
    rule: every tensor an op reads and writes), so a lookup that reads a few rows of a large table,
    or a loss that reads one logit per row, gets the rate that rule needs."""
    functional = torch.nn.functional
    points = []
    for rows, features in ROWS:
        x = torch.randn(rows, features, requires_grad=True)
        weight, bias = torch.ones(features, requires_grad=True), torch.zeros(features, requires_grad=True)
        table = torch.randn(8192, features, requires_grad=True)
        tokens = torch.randint(0, 8192, (rows,))
        log_probs = torch.randn(rows, features).log_softmax(-1).requires_grad_()
        targets = torch.randint(0, features, (rows,))
        for family, forward in (
                ("layer_norm", lambda x=x, w=weight, b=bias: functional.layer_norm(x, x.shape[-1:], w, b)),
                ("softmax", lambda x=x: torch.softmax(x, -1)),
                ("embedding", lambda t=tokens, table=table: functional.embedding(t, table)),
                ("nll_loss", lambda p=log_probs, t=targets: functional.nll_loss(p, t)),
                ("gelu", lambda x=x: functional.gelu(x)),
                ("silu", lambda x=x: functional.silu(x))):
            points.append((family, *_family_bytes(family, forward), forward))
    return _rates(points)


def _family_bytes(family: str, forward) -> tuple[float, float]:
    """Bytes the step's count gives ``family``'s ops in ``forward`` and in its backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .count import _bytes_moved, _kernel

    moved = {family: 0.0, f"{family}_backward": 0.0}

    class _Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            kernel = _kernel(func._schema.name, 0.0)
            if kernel in moved:
                moved[kernel] += _bytes_moved(func, args, kwargs, out)
            return out

    with _Bytes():
        out = forward()
        out.backward(torch.ones_like(out))
    return moved[family], moved[f"{family}_backward"]


def _rates(points) -> dict[str, list[tuple[float, float]]]:
    """``points``: (family, forward's amount, backward's amount, forward), in FLOPs or bytes. Each
    family's forward and backward rates, (amount of one op, amount per second), in order of
    amount. A FLOP-counted backward is twice its forward's FLOPs (gradients of the input and of
    the weights or keys); a byte-counted one, the bytes the step's own rule gives it."""
    times = _forward_backward_times([forward for *_, forward in points])
    rates: dict[str, list] = {}
    for (family, forward_amount, backward_amount, _), (forward_time, backward_time) in zip(points, times):
        rates.setdefault(family, []).append((forward_amount, forward_amount / forward_time))
        rates.setdefault(f"{family}_backward", []).append((backward_amount, backward_amount / backward_time))
    return {family: sorted(found) for family, found in rates.items()}


def _forward_backward_times(forwards) -> list[tuple[float, float]]:
    """Seconds of each of ``forwards`` and of its backward (forward and backward less the
    forward), all timed together (``_op_times``). The backward returns its leaves' gradients
    (``torch.autograd.grad``) rather than adding them into ``.grad``: run again and again,
    ``backward()`` would add each new gradient into the last (an add over every input, up to as
    many bytes as the kernel's own), which a step's activations never pay and its parameters'
    accumulation is counted for as ops of its own."""
    def both(forward):
        out = forward()
        grad, leaves = torch.ones_like(out), _leaves(out)
        return lambda: torch.autograd.grad(forward(), leaves, grad)

    times = _work_times([*forwards, *(both(forward) for forward in forwards)])
    forward_times = times[:len(forwards)]
    return [(forward, max(together - forward, 0.5 * forward))
            for forward, together in zip(forward_times, times[len(forwards):])]


def _leaves(out: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors ``out``'s graph would accumulate gradients into."""
    found, nodes, seen = [], [out.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: the leaf it accumulates into
            found.append(node.variable)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


def _mm(n: int, dtype: torch.dtype):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def _add(n: int):
    a, b, out = torch.randn(n), torch.randn(n), torch.empty(n)
    return lambda: torch.add(a, b, out=out)


def _streaming_adds(sizes, *, inplace: bool = False):
    """For each of ``sizes``, an ``add`` of that many elements whose operands were not touched by
    the last few ops: each cycles through sets of tensors larger together than the last-level
    cache, as a training step's ops read tensors that the ops between (other layers, the
    optimizer's other parameters) evicted. The sets of every size are views of one buffer of
    ``_STREAM_BYTES``, or of two sets of the largest size where that is more (inputs in its first
    two thirds, outputs in the last), so the ops can be timed together (``_op_times``) in that
    memory, not in that memory once per size. ``inplace``: then, for each size, an in-place add
    (``output.add_(input)``) cycling through the same sets."""
    elements = max(_STREAM_BYTES // 4, 2 * 3 * max(sizes)) // 3
    # Outputs written once now: a first write to a page the kernel has not mapped yet costs a
    # page fault, which a step's outputs, in memory its allocator reuses, do not pay.
    inputs, outputs = torch.randn(2 * elements), torch.zeros(elements)
    kinds = (False, True) if inplace else (False,)
    return [_cycling_add(inputs, outputs, n, inplace=kind) for kind in kinds for n in sizes]


def _cycling_add(inputs: torch.Tensor, outputs: torch.Tensor, n: int, *, inplace: bool = False):
    sets = max(1, outputs.numel() // n)
    turn = iter(range(2**62))

    def op():
        i = next(turn) % sets
        if inplace:
            outputs[i * n:(i + 1) * n].add_(inputs[2 * i * n:(2 * i + 1) * n])
        else:
            torch.add(inputs[2 * i * n:(2 * i + 1) * n], inputs[(2 * i + 1) * n:(2 * i + 2) * n],
                      out=outputs[i * n:(i + 1) * n])

    return op


COLD_WRITE_ELEMENTS = 2**19
"""The copy ``_cold_write_cost`` times (fp32, 2 MiB: a transformer block's activation at a few
thousand tokens, and within this CPU's 4 MiB L2 with its source)."""


def _cold_write_cost() -> float:
    """Seconds per byte that writing a new tensor costs when its memory is out of cache, beyond
    writing it where the last call's output was: a copy of ``COLD_WRITE_ELEMENTS`` from one
    source into one output, and into the next of outputs cycling through ``_STREAM_BYTES`` written
    once before (so no page faults, as a step's reused memory has none), timed in turns. A step's
    forward writes its kept activations into memory the last step's backward freed: on this 2-core
    VM a copy, a GELU and an add so took 0.09-0.14 ms more per MiB, an addmm 0.16-0.37 (scratch,
    one thread; docs/step-time.md)."""
    n = COLD_WRITE_ELEMENTS
    source, hot = torch.randn(n), torch.zeros(n)
    hot_time, cold_time = _op_times([lambda: hot.copy_(source),
                                     _cycling_copy(source, torch.zeros(max(_STREAM_BYTES // 4, 2 * n)))])
    return max(cold_time - hot_time, 0.0) / (source.element_size() * n)


def _cycling_copy(source: torch.Tensor, outputs: torch.Tensor):
    """A copy of ``source`` into the next of the ``source``-sized sets of ``outputs`` each call."""
    n = source.numel()
    sets = outputs.numel() // n
    turn = iter(range(2**62))

    def op():
        i = next(turn) % sets
        outputs[i * n:(i + 1) * n].copy_(source)

    return op


_STREAM_BYTES = 256 * 2**20
"""Above the last-level cache of the CPUs this runs on (tens of MiB per socket)."""


def _op_time(op) -> float:
    return _op_times([op])[0]


def _op_times(ops) -> list[float]:
    """Seconds per call of each of ``ops``: the median of several timed runs of many calls (the
    machine's typical speed under the load it has, as the steps it predicts will see it), on
    ``clock()``. The ops' runs take turns, round by round: a curve is the rates of one kernel at
    several sizes, and a shared machine's speed drifts over a second; timed one after the other,
    each size would be timed at another moment, and the curve would bend with the drift (this
    machine's add curve moved 0.38-1.08 at 0.8 MB between profiles measured so; docs/step-time.md)."""
    now = clock()
    calls = []
    for op in ops:
        op()  # first call: allocations, kernel selection
        start = now()
        op()
        calls.append(max(1, int(_MIN_SECONDS / max(now() - start, 1e-7))))
    runs: list[list[float]] = [[] for _ in ops]
    for _ in range(_REPEATS):
        for op, count, found in zip(ops, calls, runs):
            start = now()
            for _ in range(count):
                op()
            found.append((now() - start) / count)
    return [statistics.median(found) for found in runs]


def clock():
    """The clock the microbenchmarks read: at one thread the thread's CPU time, which leaves out
    the time slices a shared machine gives other processes (a 3 ms step preempted once takes 7 ms
    of wall time) and so measures the work alone, as the step is measured (``time.thread_time``
    in ``tuning.measure``); with a thread pool, wall time (the pool's threads run in parallel)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _threads(count: int) -> str:
    return f"{count} thread" + ("" if count == 1 else "s")


__all__ = ["cache_path", "clock", "cpu_speed", "default_cache_dir", "load_cached", "machine_key", "measure_cpu_speed",
           "save_cached", "scaled_speed", "speed_probe"]
