"""The process group a sharded step runs in: the real one under torchrun, or a fake one that lets a
single process shard to any world size (collectives return at once and move no data).

With a fake group and fake tensors, ``fully_shard`` gives rank 0 exactly the shards, gathered
parameters and reduce-scatter buffers it would hold in a real run of ``world_size`` ranks, so the
probe's step, counted on fake tensors, is the per-rank peak without the other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys
from unittest import mock

import torch.distributed as dist

from ...errors import ConfigError
from .settings import Sharding, resolve_shard_group
from .wrap import build_mesh, shard_model


@contextlib.contextmanager
def fake_process_group(world_size: int, *, rank: int = 0):
    """A process group of ``world_size`` ranks in this one process (this is rank ``rank``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(f"a sharded estimate for --world-size {world_size} needs its own (fake) "
                          f"process group, and one is already initialised (torchrun?); under "
                          f"torchrun the probe measures with the real ranks instead")
    made: list = []
    # init_process_group wraps sys.excepthook to prefix "[rank{r}]" to tracebacks, and never
    # unwraps it: one fake group per trial nested it hundreds of times in one plan (a traceback
    # after plan() printed "[rank0]: [rank0]: ... [rank4]:" on every line, and a long session
    # of plans would pass the recursion limit printing one).
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _recording_meshes(made):
            yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _retire_meshes(made)


@contextlib.contextmanager
def _recording_meshes(made: list):
    """Every DeviceMesh built meanwhile (submeshes and flattened ones included) into ``made``.
    Kept by identity: meshes of the same shape compare equal. Scanning the heap instead
    (``gc.get_objects``) cost 11% of a small pipeline plan's time."""
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    @functools.wraps(init)
    def recording_init(mesh, *args, **kwargs):
        init(mesh, *args, **kwargs)
        made.append(mesh)

    with mock.patch.object(DeviceMesh, "__init__", recording_init):
        yield


_retired = itertools.count(1)


def _retire_meshes(meshes) -> None:
    """Make this group's meshes unequal to any later one.

    DTensor caches each op's output placements by its inputs' specs, and a DeviceMesh compares
    equal to another of the same shape and names whatever its process groups: a later fake
    group's meshes (the next pipeline rank's estimate) would get cached specs on meshes whose
    groups are destroyed. Clearing torch's native cache instead
    (``torch.distributed.tensor.debug._clear_sharding_prop_cache``) crashed the process (abort or
    segfault) after some hours of other estimates in it. A mesh's ``_thread_id`` is part of its
    equality and hash (threaded test groups use it); a negative one is no thread's, so stale
    entries miss. Each mesh's cached hash is dropped with it (the cache compares hashes first).
    """
    for mesh in meshes:
        mesh._thread_id = -next(_retired)
        mesh._hash = None
    try:
        from torch.distributed.tensor.debug import _clear_python_sharding_prop_cache
    except ImportError:  # a torch without the Python cache
        return
    _clear_python_sharding_prop_cache()


@contextlib.contextmanager
def sharded_step(workload, *, sharding, world_size: int, shard_group=None, precision="fp32",
                 device_type: str = "cpu", parallel=None, fake_rank: int = 0):
    """The workload with a model factory that shards the model as the plan would.

    Without an initialised process group a fake one of ``world_size`` ranks is made for the
    duration. The device mesh is built here, before any fake-tensor mode is entered: inside one,
    building it fails on a data-dependent op. ``parallel``: the plan's model-parallel
    ``Layout`` (None or trivial: data parallel only); ``shard_group`` then counts data-parallel
    ranks. ``fake_rank``: the rank this process is in a fake group (a pipeline's ranks differ).
    """
    sharding = Sharding.parse(sharding)
    parallel = parallel if parallel is not None and not parallel.trivial else None
    if not sharding.sharded and parallel is None:
        yield workload
        return
    if parallel is not None:
        data_parallel = parallel.data_parallel(world_size)
        group = resolve_shard_group(shard_group, data_parallel)
    else:
        group = resolve_shard_group(shard_group, world_size)
    if workload.model_is_instance:
        raise ConfigError(f"{workload.source}: sharding needs a model factory (build_model() "
                          f"in a model file), not a model instance: fully_shard replaces the "
                          f"instance's parameters")
    with contextlib.ExitStack() as stack:
        if not dist.is_initialized():
            stack.enter_context(fake_process_group(world_size, rank=fake_rank))
            if parallel is not None and parallel.pp > 1:
                from ..pipeline import sends_held_by_their_work

                stack.enter_context(sends_held_by_their_work())
        elif dist.get_world_size() != world_size:
            raise ConfigError(f"--world-size {world_size} differs from the {dist.get_world_size()} "
                              f"ranks of the process group; omit --world-size under torchrun")
        mesh = build_mesh(device_type, world_size, group, parallel)
        if parallel is not None and parallel.cp > 1:
            from ..context_parallel import context_parallel_step, fsdp_mesh

            fsdp_mesh(mesh)  # its group is made here, before any fake-tensor mode
            workload = stack.enter_context(context_parallel_step(workload, mesh["cp"]))
        if parallel is not None and parallel.tp > 1:
            from ..tensor_parallel import tensor_parallel_step

            workload = stack.enter_context(tensor_parallel_step(workload, parallel))

        def build_sharded():
            model = workload.new_model()
            if parallel is not None:
                from ..apply_layout import apply_layout  # it imports this package
                return apply_layout(model, mesh=mesh, parallel=parallel, sharding=sharding,
                                    precision=precision, workload=workload)
            return shard_model(model, mesh=mesh, sharding=sharding, precision=precision)

        yield dataclasses.replace(workload, model=build_sharded)


__all__ = ["fake_process_group", "sharded_step"]
