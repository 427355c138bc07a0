"""The sharding setting of a plan: pure values, no process group or device needed."""

from __future__ import annotations

from ...choices import Choice
from ...errors import ConfigError, given


class Sharding(Choice):
    """How each rank holds the model.

    - ``ddp``: a full replica per rank (parameters, gradients and optimizer state).
    - ``fsdp``: FSDP2 (``fully_shard``) on every repeated block and on the root, parameters,
      gradients and optimizer state sharded over the shard group, resharded after forward.
    - ``fsdp-offload``: as ``fsdp``, with the shards and the optimizer step on the CPU
      (``CPUOffloadPolicy``).
    """

    DDP = "ddp"
    FSDP = "fsdp"
    FSDP_OFFLOAD = "fsdp-offload"

    @property
    def sharded(self) -> bool:
        return self is not Sharding.DDP

    @property
    def offload(self) -> bool:
        return self is Sharding.FSDP_OFFLOAD


def resolve_shard_group(shard_group, world_size: int, *, option: str | None = None) -> int:
    """The number of ranks that share one copy of the model (the world size when not given).

    Hybrid sharding shards within groups of ``shard_group`` ranks and replicates across the
    ``world_size // shard_group`` groups, so the group must divide the world size.
    """
    if shard_group is None:
        return world_size
    if isinstance(shard_group, bool) or not isinstance(shard_group, int) or shard_group < 1:
        raise ConfigError(f"{given(option or 'shard_group', shard_group)} is not a number of ranks; give a positive int "
                          f"that divides the world size {world_size}")
    if world_size % shard_group:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"{given(option or 'shard_group', shard_group)} does not divide {given('world_size', world_size)}; "
                          f"use one of {', '.join(map(str, divisors))}")
    return shard_group


def mesh_shape(world_size: int, shard_group: int) -> tuple[int, ...]:
    """The device mesh for FSDP2: 1-D (shard) or 2-D (replicate, shard) for hybrid sharding."""
    if shard_group == world_size:
        return (world_size,)
    return (world_size // shard_group, shard_group)


__all__ = ["Sharding", "mesh_shape", "resolve_shard_group"]
