"""Apply a plan's FSDP2 sharding to a model: ``fully_shard`` on each repeated block, then the root.

The blocks are the ones activation checkpointing wraps (``repeated_blocks``), so the estimate,
the probe and the training loop all shard the same units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ...precision import Precision
from ...workload.activation_checkpointing import repeated_blocks
from .settings import Sharding, mesh_shape

MESH_DIM_NAMES = {1: ("shard",), 2: ("replicate", "shard")}


def build_mesh(device_type: str, world_size: int, shard_group: int, parallel=None):
    """The device mesh for ``world_size`` ranks in shard groups of ``shard_group`` (needs an
    initialised process group).

    With a model-parallel ``parallel`` layout (``autotune.distributed.layout.Layout``) the mesh
    has its dims (``Layout.mesh_dims``: pp, dp_replicate, dp_shard, cp, tp) and ``shard_group``
    counts data-parallel ranks; ``data_parallel_mesh`` is then the part FSDP2 shards over.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if parallel is not None and not parallel.trivial:
        dims = parallel.mesh_dims(world_size, shard_group)
        return init_device_mesh(device_type, tuple(size for _, size in dims),
                                mesh_dim_names=tuple(name for name, _ in dims))
    shape = mesh_shape(world_size, shard_group)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES[len(shape)])


def data_parallel_mesh(mesh):
    """The dims of ``mesh`` that hold different samples: the whole mesh of a data-parallel plan
    ("replicate", "shard"), else its ("dp_replicate",) "dp_shard" part."""
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names:
        return mesh
    dp = tuple(name for name in ("dp_replicate", "dp_shard") if name in names)
    return mesh[dp] if len(dp) > 1 else mesh[dp[0]]


def layout_fsdp_mesh(mesh, parallel):
    """The part of a layout's ``mesh`` FSDP2 shards over: the data-parallel dims, and under
    context parallelism (``parallel.cp`` > 1) the cp dim with them: its ranks hold different
    tokens of the same samples, so their gradients are reduced with the data-parallel ones
    (torchtitan's dp_shard_cp, ``context_parallel.fsdp_mesh``)."""
    if parallel is None or parallel.cp == 1:
        return data_parallel_mesh(mesh)
    from ..context_parallel import fsdp_mesh

    return fsdp_mesh(mesh)


def fsdp_policies(sharding: Sharding, precision: Precision) -> dict:
    """Keyword arguments for ``fully_shard``: bf16 plans compute in bf16 and reduce in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options = {}
    if precision is Precision.BF16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if sharding.offload:
        # Pinned host memory needs a CUDA driver; without one the shards live in plain CPU memory.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return options


def shard_model(model: torch.nn.Module, *, mesh, sharding, precision="fp32") -> torch.nn.Module:
    """``fully_shard`` every repeated block and the root of ``model`` in place; returns it.

    Blocks reshard after forward (their parameters are gathered again in backward); the root's
    parameters stay gathered until backward, as FSDP2 does by default for the root.
    """
    from torch.distributed.fsdp import fully_shard

    sharding = Sharding.parse(sharding)
    options = fsdp_policies(sharding, Precision.parse(precision))
    with _few_fake_chunks():
        for block in repeated_blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=True, **options)
        fully_shard(model, mesh=mesh, **options)
    return model


class _NarrowedChunks(Sequence):
    """``torch.chunk(tensor, count, dim)`` padded with empty tensors to ``count``, as FSDP2's
    ``_chunk_with_empty`` returns it, made one chunk at a time when asked: FSDP2 reads its rank's
    chunk and the first, and on fake tensors every chunk is a fake tensor built through the
    dispatch cache (a 70B model sharded over 128 ranks made 2.9 million of them, a third of its
    plan's CPU time). Each chunk is the same view ``torch.chunk`` makes (``narrow``)."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int):
        self._tensor, self._count, self._dim = tensor, count, dim
        size = tensor.size(dim)
        self._length = -(-size // count)
        self._made = -(-size // self._length)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        if index >= self._made:
            return self[0].new_empty(0)
        start = index * self._length
        return self._tensor.narrow(self._dim, start, min(self._length, self._tensor.size(self._dim) - start))


@contextlib.contextmanager
def _few_fake_chunks():
    """FSDP2's chunking of fake parameters as ``_NarrowedChunks``; real ones as before."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    chunked = getattr(_fsdp_param, "_chunk_with_empty", None)
    if chunked is None:
        yield
        return

    def chunk_with_empty(tensor, num_chunks, dim):
        if isinstance(tensor, FakeTensor) and tensor.size(dim) > 0:
            return _NarrowedChunks(tensor, num_chunks, dim)
        return chunked(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = chunked


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """FSDP2's ``no_sync``: with sync off, backward accumulates this rank's unsharded gradients
    and reduce-scatters nothing; the next backward with sync on reduce-scatters the sum. A model
    that is not FSDP2's (tensor parallel alone) reduces in forward and backward: nothing to do."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)


def local_unsharded_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's accumulated, not yet reduced gradients of a sharded ``model`` (after a backward
    with gradient sync off): what ``p.grad`` is under DDP's ``no_sync``.

    FSDP2 keeps them on its private ``FSDPParam`` objects (``unsharded_accumulated_grad`` when
    the reduce dtype differs from the compute dtype, else the unsharded parameter's ``.grad``);
    no public accessor exists, so a torch that moved them raises instead of returning nothing.
    """
    grads = []
    for module in model.modules():
        if not is_sharded(module):
            continue
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
        if groups is None:
            raise AttributeError("this torch's FSDP2 state has no _fsdp_param_groups")
        for group in groups:
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.unsharded_accumulated_grad
                if grad is None:
                    grad = fsdp_param._unsharded_param.grad
                if grad is not None:
                    grads.append(grad)
    return grads


def drop_unsharded_grads(model: torch.nn.Module) -> None:
    """Forget the unsharded gradients FSDP2 accumulated with gradient sync off (a window that
    ran out of memory before its last micro-step): what ``zero_grad`` does for sharded ones."""
    for module in model.modules():
        if not is_sharded(module):
            continue
        for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or ():
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def full_state_dict(model: torch.nn.Module) -> dict:
    """The unsharded state dict of a sharded ``model`` on CPU, on rank 0 (empty elsewhere).

    Every rank must call it (it all-gathers shard by shard); keys are the original module's, so
    the result loads into a freshly built model without torch.distributed.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..tensor_parallel import quiet_redistribution

    with quiet_redistribution():
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


__all__ = ["build_mesh", "data_parallel_mesh", "layout_fsdp_mesh", "drop_unsharded_grads", "fsdp_policies", "full_state_dict", "is_sharded",
           "local_unsharded_grads", "set_gradient_sync", "shard_model"]
