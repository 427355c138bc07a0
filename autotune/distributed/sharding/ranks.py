"""The process group a sharded step runs in: the real one under torchrun, or a fake one that lets a
single process shard to any world size (collectives return at once and move no data).

With a fake group and fake tensors, ``fully_shard`` gives rank 0 exactly the shards, gathered
parameters and reduce-scatter buffers it would hold in a real run of ``world_size`` ranks, so the
probe's step, counted on fake tensors, is the per-rank peak without the other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist

from ...errors import ConfigError
from .settings import Sharding, resolve_shard_group
from .wrap import build_mesh, shard_model
from .. import context_parallel


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of ``world_size`` ranks in this one process (this is rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(f"a sharded estimate for --world-size {world_size} needs its own (fake) "
                          f"process group, and one is already initialised (torchrun?); under "
                          f"torchrun the probe measures with the real ranks instead")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def sharded_step(workload, *, sharding, world_size: int, shard_group=None, precision="fp32",
                 device_type: str = "cpu", cp: int = 1):
    """The workload with a model factory that shards the model as the plan would.

    Without an initialised process group a fake one of ``world_size`` ranks is made for the
    duration. The device mesh is built here, before any fake-tensor mode is entered: inside one,
    building it fails on a data-dependent op.

    ``cp`` > 1: context parallelism, every sequence sharded over groups of ``cp`` ranks (see
    ``autotune.distributed.context_parallel``); FSDP2 then shards over the data-parallel ranks
    and the cp ranks together, as torchtitan does.
    """
    sharding = Sharding.parse(sharding)
    if cp > 1 and not sharding.sharded:
        raise ConfigError(f"context parallelism (cp {cp}) shards the model with FSDP2 over the "
                          f"data-parallel and cp ranks; plan it with sharding fsdp, not {sharding.value}")
    if not sharding.sharded:
        yield workload
        return
    group = resolve_shard_group(shard_group, world_size)
    if workload.model_is_instance:
        raise ConfigError(f"{workload.source}: sharding needs a model factory (build_model() "
                          f"in a model file), not a model instance: fully_shard replaces the "
                          f"instance's parameters")
    with contextlib.ExitStack() as stack:
        if not dist.is_initialized():
            stack.enter_context(fake_process_group(world_size))
        elif dist.get_world_size() != world_size:
            raise ConfigError(f"--world-size {world_size} differs from the {dist.get_world_size()} "
                              f"ranks of the process group; omit --world-size under torchrun")
        if cp > 1:
            mesh, cp_mesh = context_parallel.meshes(device_type, world_size, group, cp)
            workload = stack.enter_context(context_parallel.context_parallel_step(workload, cp_mesh))
        else:
            mesh = build_mesh(device_type, world_size, group)

        def build_sharded():
            return shard_model(workload.new_model(), mesh=mesh, sharding=sharding, precision=precision)

        yield dataclasses.replace(workload, model=build_sharded)


__all__ = ["fake_process_group", "sharded_step"]
