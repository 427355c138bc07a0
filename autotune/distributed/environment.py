"""Which launch this process is part of: the process group it runs in and the world size a plan is for."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError, given, option


def torchrun_group() -> bool:
    """Whether this process is one rank of a process group already set up (torchrun)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_world_size(world_size: int | None, distributed: bool) -> int:
    """The ranks a plan is for: torchrun's when launched by it (``world_size`` must agree), else
    ``world_size``, else the WORLD_SIZE environment variable, else 1."""
    if distributed:
        ranks = torch.distributed.get_world_size()
        if world_size is not None and world_size != ranks:
            raise ConfigError(f"{given('world_size', world_size)} differs from the {ranks} ranks "
                              f"torchrun started; omit {option('world_size')} or launch {world_size} processes")
        return ranks
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return 1
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={env!r} is not a positive int; "
                          f"unset it or pass {option('world_size')} N")
    return value


def real_ranks() -> int:
    """The ranks of a real process group (torchrun); 1 without one, or with the estimate's fake one."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        return 1
    return dist.get_world_size()
