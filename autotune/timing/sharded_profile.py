"""What FSDP2 and DTensor cost this CPU beyond the ops they dispatch, measured by microbenchmarks.

A sharded step runs Python that a plain one does not: FSDP2's pre/post forward and backward hooks
on every unit (issuing and waiting for the all-gather, setting each parameter's unsharded view,
registering the post-backward, turning each gradient into a sharded DTensor) and DTensor's
dispatch of every op on a sharded tensor (the optimizer's and the gradient clipping's). The fake
step counts the ops these dispatch (copy-in, copy-out, views; the local ops) but not that Python.

Both are measured on tiny tensors (the work is nil: what is left is the per-call cost) in a fake
process group of ``WORLD`` ranks, whose collectives return at once: the collectives' own work is
gloo's or NCCL's, priced by the communication model (``comm``, and ``gloo.measure_gloo_cpu`` for
the CPU time gloo takes on CPU ranks). Each is the sharded run less the same run unsharded, less
the extra ops the fake step counts at ``op_overhead_s`` each, on ``cpu_profile``'s clock; every run
a cost is derived from is timed in turns with the others (``cpu_profile._op_times``), since a cost
is a difference of differences that a machine's drift between two timings would move:

- FSDP2: a stack of ``L`` units of ``K`` one-element-wide ``Linear`` layers, each unit and the root
  ``fully_shard``-ed as ``distributed.sharding.wrap.shard_model`` does (units reshard after
  forward, the root does not), forward and backward, at (L, K) = (1, 1), (8, 1), (8, 4): the
  extra per parameter from the last two, per unit from the first two, and what is left a step's.
- DTensor: an ``AdamW(foreach=False)`` step (the path torch takes for CPU DTensors) over
  ``_PARAMS`` sharded parameters, per DTensor op; and gradient clipping over them, whose foreach
  ops take the parameters as lists: what is left beyond its ops, per DTensor in those lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WORLD = 2
SHARDED_FIELDS = ("fsdp_step_s", "fsdp_unit_s", "fsdp_param_s", "dtensor_op_s", "dtensor_list_tensor_s")
"""``ShardedOverheads``' fields, which ``roofline.DeviceSpeed`` holds under the same names."""
_PARAMS = 50
_UNIT_SHAPES = ((1, 1), (8, 1), (8, 4))
"""(units, Linear layers per unit) of the FSDP2 microbenchmark."""
_WIDTH = 4


@dataclass(frozen=True)
class ShardedOverheads:
    """Seconds of FSDP2's and DTensor's Python beyond the ops they dispatch."""

    fsdp_step_s: float
    """Per sharded micro-step (forward and backward), beyond its units."""
    fsdp_unit_s: float
    """Per FSDP2 unit (root included) per micro-step."""
    fsdp_param_s: float
    """Per sharded parameter per micro-step."""
    dtensor_op_s: float
    """Per op dispatched on DTensors, beyond its local op."""
    dtensor_list_tensor_s: float
    """Per DTensor passed in a tensor list (foreach ops), beyond the op's own."""


def measure_sharded_overheads(op_overhead: float, time_ops, count_ops) -> ShardedOverheads:
    """Runs the microbenchmarks (a few seconds) in a fake process group; in a process that
    already has a process group (a fake one cannot be made beside it), in a fresh process.
    ``time_ops(fns)``: seconds per call of each of ``fns``, timed in turns; ``count_ops(fn)``: the
    ops ``fn`` dispatches (``cpu_profile``'s, on its clock)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_measure_in_fresh_process, torch.get_num_threads(), op_overhead,
                               time_ops, count_ops).result()
    return _measure(op_overhead, time_ops, count_ops)


def _measure_in_fresh_process(threads: int, op_overhead: float, time_ops, count_ops):
    torch.set_num_threads(threads)
    return _measure(op_overhead, time_ops, count_ops)


def _measure(op_overhead: float, time_ops, count_ops) -> ShardedOverheads:
    from ..distributed.sharding.ranks import fake_process_group
    from ..distributed.sharding.wrap import build_mesh

    with fake_process_group(WORLD):
        mesh = build_mesh("cpu", WORLD, WORLD)
        step, unit, param = _fsdp_overheads(mesh, op_overhead, time_ops, count_ops)
        op, listed = _dtensor_overheads(mesh, time_ops)
    return ShardedOverheads(fsdp_step_s=step, fsdp_unit_s=unit, fsdp_param_s=param,
                            dtensor_op_s=op, dtensor_list_tensor_s=listed)


def _fsdp_overheads(mesh, op_overhead: float, time_ops, count_ops) -> tuple[float, float, float]:
    (e1, u1, p1), (e2, u2, p2), (e3, u3, p3) = _fsdp_extras(
        [_fsdp_steps(mesh, units, layers, count_ops) for units, layers in _UNIT_SHAPES], op_overhead, time_ops)
    param = max((e3 - e2) / (p3 - p2), 0.0)
    unit = max((e2 - e1 - param * (p2 - p1)) / (u2 - u1), 0.0)
    step = max(e1 - unit * u1 - param * p1, 0.0)
    return step, unit, param


def _fsdp_extra(mesh, units: int, layers: int, op_overhead: float, time_ops,
                count_ops) -> tuple[float, int, int]:
    """(seconds a sharded forward and backward takes beyond the plain one and the extra ops it
    dispatches, FSDP2 units, sharded parameters) of the stack (``units``, ``layers``)."""
    return _fsdp_extras([_fsdp_steps(mesh, units, layers, count_ops)], op_overhead, time_ops)[0]


def _fsdp_extras(stacks, op_overhead: float, time_ops) -> list[tuple[float, int, int]]:
    """``_fsdp_extra`` of each of ``stacks`` (``_fsdp_steps``), every step timed in turns."""
    times = time_ops([step for sharded, plain, *_ in stacks for step in (sharded, plain)])
    return [(times[2 * i] - times[2 * i + 1] - extra_ops * op_overhead, units, params)
            for i, (_, _, extra_ops, units, params) in enumerate(stacks)]


def _fsdp_steps(mesh, units: int, layers: int, count_ops):
    """(sharded step, plain step, the extra ops the sharded one dispatches, FSDP2 units, sharded
    parameters) of the stack (``units``, ``layers``): forward and backward."""
    from torch.distributed.fsdp import fully_shard

    plain, sharded = _unit_stack(units, layers), _unit_stack(units, layers)
    for block in list(sharded)[1:]:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh)
    x = torch.ones(2, _WIDTH)

    def step_of(model):
        def step():
            model(x).sum().backward()
            for p in model.parameters():
                p.grad = None
        return step

    plain_step, sharded_step = step_of(plain), step_of(sharded)
    sharded_step()  # FSDP2's lazy initialisation
    extra_ops = count_ops(sharded_step) - count_ops(plain_step)
    return sharded_step, plain_step, extra_ops, units + 1, sum(1 for _ in sharded.parameters())


def _unit_stack(units: int, layers: int) -> torch.nn.Sequential:
    """A root ``Linear`` and ``units`` units of ``layers`` ``Linear`` layers each."""
    def unit():
        return torch.nn.Sequential(*(torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(layers)))

    return torch.nn.Sequential(torch.nn.Linear(_WIDTH, _WIDTH), *(unit() for _ in range(units)))


def _dtensor_overheads(mesh, time_ops) -> tuple[float, float]:
    """(seconds per DTensor op, per DTensor in a tensor list) beyond the same ops on plain
    tensors of the local shards' size (their local ops, which the fake step prices, cancel)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = [torch.nn.Parameter(torch.ones(_WIDTH // WORLD)) for _ in range(_PARAMS)]
    sharded = [torch.nn.Parameter(distribute_tensor(torch.ones(_WIDTH), mesh, [Shard(0)]))
               for _ in range(_PARAMS)]
    for p in (*plain, *sharded):
        p.grad = torch.ones_like(p)

    def adam(params):
        optimizer = torch.optim.AdamW(params, foreach=False)
        optimizer.step()  # the state is created by the first step
        return optimizer.step

    def clip(params):
        return lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)

    adam_ops, _ = _dtensor_dispatches(adam(sharded))
    clip_ops, listed = _dtensor_dispatches(clip(sharded))
    adam_sharded, adam_plain, clip_sharded, clip_plain = time_ops(
        [adam(sharded), adam(plain), clip(sharded), clip(plain)])
    per_op = max((adam_sharded - adam_plain) / max(adam_ops, 1), 0.0)
    extra = clip_sharded - clip_plain - clip_ops * per_op
    return per_op, max(extra / max(listed, 1), 0.0)


def _dtensor_dispatches(fn) -> tuple[int, int]:
    """(ops ``fn`` dispatches on DTensors, DTensors it passes in tensor lists), as the fake
    step's count sees them (``count._OpRecorder``)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    counts = [0, 0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs))):
                counts[0] += 1
                counts[1] += sum(isinstance(t, DTensor) for a in (*args, *kwargs.values())
                                 if isinstance(a, (list, tuple)) for t in a)
            return func(*args, **kwargs)

    with _Count():
        fn()
    return counts[0], counts[1]


__all__ = ["SHARDED_FIELDS", "ShardedOverheads", "WORLD", "measure_sharded_overheads"]
