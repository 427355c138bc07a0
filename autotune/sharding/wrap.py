"""Apply a plan's FSDP2 sharding to a model: ``fully_shard`` on each repeated block, then the root.

The blocks are the ones activation checkpointing wraps (``repeated_blocks``), so the estimate,
the probe and the training loop all shard the same units.
"""

from __future__ import annotations

import torch

from ..precision import Precision
from ..workload.activation_checkpointing import repeated_blocks
from .settings import Sharding, mesh_shape

MESH_DIM_NAMES = {1: ("shard",), 2: ("replicate", "shard")}


def build_mesh(device_type: str, world_size: int, shard_group: int):
    """The device mesh for ``world_size`` ranks in shard groups of ``shard_group`` (needs an
    initialised process group)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(world_size, shard_group)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES[len(shape)])


def fsdp_policies(sharding: Sharding, precision: Precision) -> dict:
    """Keyword arguments for ``fully_shard``: bf16 plans compute in bf16 and reduce in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options = {}
    if precision is Precision.BF16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if sharding.offload:
        options["offload_policy"] = CPUOffloadPolicy()
    return options


def shard_model(model: torch.nn.Module, *, mesh, sharding, precision="fp32") -> torch.nn.Module:
    """``fully_shard`` every repeated block and the root of ``model`` in place; returns it.

    Blocks reshard after forward (their parameters are gathered again in backward); the root's
    parameters stay gathered until backward, as FSDP2 does by default for the root.
    """
    from torch.distributed.fsdp import fully_shard

    sharding = Sharding.parse(sharding)
    options = fsdp_policies(sharding, Precision.parse(precision))
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=True, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


__all__ = ["build_mesh", "fsdp_policies", "shard_model"]
