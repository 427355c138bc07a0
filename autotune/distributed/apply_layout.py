"""Apply a plan's parallel layout to a freshly built model: the model-parallel splits first
(tensor parallel on the mesh's "tp" dim), then FSDP2 over the data-parallel dims, as torchtitan
orders them. The estimate (fake process group), the probe (real ranks) and the training loop all
call this one function, so they hold the same pieces of the model.

Context parallelism changes no parameter (it shards each batch's sequence around the step, see
``context_parallel``; FSDP2 here shards over its ranks too) and pipeline parallelism replaces the
step itself; their modules apply them where the step runs.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import context_parallel
from .layout import Layout
from .sharding.settings import Sharding
from .sharding.wrap import data_parallel_mesh, shard_model


def apply_layout(model: torch.nn.Module, *, mesh, parallel: Layout, sharding, precision="fp32",
                 workload=None) -> torch.nn.Module:
    """``model`` split as ``parallel`` says on ``mesh`` (``build_mesh(..., parallel)``), then
    sharded over the data-parallel dims when ``sharding`` is FSDP2; returns the model."""
    sharding = Sharding.parse(sharding)
    if parallel.pp > 1:
        from .pipeline import pipeline_model

        return pipeline_model(model, mesh=mesh, parallel=parallel, sharding=sharding,
                              precision=precision, workload=workload)
    for name, what in (("tp", "tensor"),):
        degree = getattr(parallel, name)
        if degree > 1:
            raise ConfigError(f"{name} {degree}: {what} parallelism is not available in this build "
                              f"of autotune; plan with --{name} 1")
    if sharding.sharded:
        # Context-parallel ranks hold different tokens of the same samples: FSDP2 shards over them
        # too, so their gradients are reduced with the data-parallel ones (torchtitan's dp_shard_cp).
        fsdp_mesh = data_parallel_mesh(mesh) if parallel.cp == 1 else context_parallel.fsdp_mesh(mesh)
        shard_model(model, mesh=fsdp_mesh, sharding=sharding, precision=precision)
    return model


__all__ = ["apply_layout"]
