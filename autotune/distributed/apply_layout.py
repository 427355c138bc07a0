"""Apply a plan's parallel layout to a freshly built model: the model-parallel splits first
(pipeline stages cut at the blocks, tensor parallel on the mesh's "tp" dim, inside each stage for
a pipeline), then FSDP2 over the data-parallel dims, as torchtitan orders them. The estimate (fake process group), the probe (real ranks) and the training loop all
call this one function, so they hold the same pieces of the model.

Context parallelism changes no parameter (it shards each batch's sequence around the step, see
``context_parallel``; FSDP2 here shards over its ranks too) and pipeline parallelism replaces the
step itself; their modules apply them where the step runs.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .layout import Layout
from .sharding.settings import Sharding
from .sharding.wrap import layout_fsdp_mesh, shard_model


def apply_layout(model: torch.nn.Module, *, mesh, parallel: Layout, sharding, precision="fp32",
                 workload=None) -> torch.nn.Module:
    """``model`` split as ``parallel`` says on ``mesh`` (``build_mesh(..., parallel)``), then
    sharded over the data-parallel dims when ``sharding`` is FSDP2; returns the model."""
    sharding = Sharding.parse(sharding)
    if parallel.pp > 1:
        from .pipeline import pipeline_model

        return pipeline_model(model, mesh=mesh, parallel=parallel, sharding=sharding,
                              precision=precision, workload=workload)
    if parallel.tp > 1:
        from .tensor_parallel import apply_tensor_parallel

        model = apply_tensor_parallel(model, mesh, workload=workload, parallel=parallel,
                                      sharding=sharding)
    if sharding.sharded:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # fully_shard joins a tensor-parallel parameter's dp and tp meshes into a new DeviceMesh,
        # whose set-up runs a data-dependent op on the (real) mesh tensor, which a fake-tensor
        # mode refuses. Outside the mode, FSDP2's ops on fake parameters still run in their mode.
        with unset_fake_temporarily():
            shard_model(model, mesh=layout_fsdp_mesh(mesh, parallel), sharding=sharding, precision=precision)
    return model


__all__ = ["apply_layout"]
