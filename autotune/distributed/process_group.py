"""Process-group set-up and the few collectives the loop needs (no-ops on one process).

Under torchrun (WORLD_SIZE > 1 in the environment) the loop joins the process group itself:
nccl on CUDA, gloo on the CPU. Rank 0 alone logs and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives
from .environment import env_count
from ..compiled import eager_module
from ..errors import TrainError
from ..memory import resolve_device
from .sharding import wrap as sharding


@dataclass
class DistContext:
    world_size: int
    rank: int
    device: torch.device
    initialized_here: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device=None, *, sharded: bool = False) -> DistContext:
    """Join the process group (torchrun), or run alone.

    A sharded plan on one process still needs a process group (FSDP2 shards over a device mesh,
    even of one rank, e.g. to offload to the CPU): one is made in-process with a ``HashStore``.
    """
    world_size = env_count(os.environ, "WORLD_SIZE", default=1)
    if world_size <= 1 and not (dist.is_available() and dist.is_initialized()):
        resolved = resolve_device(device)
        if not sharded:
            return DistContext(world_size=1, rank=0, device=resolved)
        dist.init_process_group(backend="nccl" if resolved.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
        return DistContext(world_size=1, rank=0, device=resolved, initialized_here=True)
    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    initialized_here = False
    if not dist.is_initialized():
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        _init_process_group("nccl" if resolved.type == "cuda" else "gloo")
        initialized_here = True
    return DistContext(world_size=dist.get_world_size(), rank=dist.get_rank(), device=resolved,
                       initialized_here=initialized_here)


_TIMEOUT = datetime.timedelta(minutes=10)


def _init_process_group(backend: str) -> None:
    """``init_process_group`` from torchrun's environment, safe on torchrun's restarts.

    torchrun's agent keeps one store across restarts (shared with its own rendezvous), and the
    previous attempt's keys are still in it: there the new ranks could read the dead ranks'
    addresses and wait on them. Every restart therefore uses keys of its own.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0"):
        dist.init_process_group(backend=backend, timeout=_TIMEOUT)
        return
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://", timeout=_TIMEOUT))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"autotune/attempt-{attempt}", store),
                            rank=rank, world_size=world_size, timeout=_TIMEOUT)


def settle(ctx: DistContext) -> None:
    """After the ranks' last collective, on every rank: see ``collectives.settle``."""
    if ctx.distributed:
        collectives.settle()


def teardown(ctx: DistContext) -> None:
    if ctx.initialized_here and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """DDP around ``model`` on several ranks; a sharded (FSDP2) model, or a pipeline's stages
    (which the schedule runs), is already distributed."""
    from .pipeline import PipelinedModel

    if not ctx.distributed or sharding.is_sharded(model) or isinstance(model, PipelinedModel):
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def sync_context(model: torch.nn.Module, *, final: bool):
    """Gradients reduced on the last micro-step of a window only: DDP's ``no_sync()`` on the
    others, FSDP2's gradient sync switched off for them."""
    model = eager_module(model)  # a compiled DDP module: the DDP module it wraps
    if sharding.is_sharded(model):
        sharding.set_gradient_sync(model, final)
        return contextlib.nullcontext()
    if final or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def forget_failed_window(model: torch.nn.Module) -> None:
    """Reset DDP's reducer after a window abandoned for out-of-memory (every rank calls this).

    A rank that ran the last micro-step's forward outside ``no_sync`` left its reducer expecting
    that backward; without a reset the redo's first ``no_sync`` backward would launch a gradient
    all-reduce the other ranks never join. ``_reset_state`` is DDP's own hook for exactly this
    ("forward can run despite previous backward not succeeding"); it is private, hence the check.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    reset = getattr(model.reducer, "_reset_state", None)
    if reset is None:
        raise TrainError(f"torch {torch.__version__}'s DistributedDataParallel has no private "
                         f"reducer._reset_state, which out-of-memory recovery under DDP relies on "
                         f"(torch 2.13 to 2.14 have it); train with a torch in that range, or "
                         f"plan a micro-batch with more headroom so no window is redone")
    model._has_rebuilt_buckets = False
    reset()


def local_grads(model: torch.nn.Module, params) -> list[torch.Tensor]:
    """This rank's own accumulated gradients before the window's reduction (noise scale)."""
    if sharding.is_sharded(model):
        return sharding.local_unsharded_grads(model)
    return [p.grad for p in params if p.grad is not None]


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        collectives.all_reduce(tensor, dist.ReduceOp.SUM)
    return tensor


def barrier(ctx: DistContext) -> None:
    """Every rank waits here for every other (one small all-reduce; a no-op on one process)."""
    if ctx.distributed:
        collectives.min_across_ranks(0)


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when ``flag`` is true on any rank (so all ranks take the same path)."""
    if not ctx.distributed:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    return bool(collectives.all_reduce(value, dist.ReduceOp.MAX).item())


def gather_objects(obj, ctx: DistContext) -> list:
    """Every rank's ``obj`` (rank order), on every rank."""
    if not ctx.distributed:
        return [obj]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
