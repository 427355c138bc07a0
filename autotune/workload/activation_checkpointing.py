"""Activation checkpointing around a model's repeated blocks, applied and removed in place.

The probe and the training loop share this, so a plan's checkpointing means the same thing in
both: the children of the model's outermost ``nn.ModuleList`` / ``nn.Sequential`` containers with
at least two children (and parameters) are the blocks, and K of them, spread evenly, run under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (all of them unless K is given).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import WorkloadError

_MARK = "_autotune_checkpointed"


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the outermost ModuleList/Sequential containers with two or more children."""
    blocks: list[torch.nn.Module] = []

    def visit(module):
        for child in module.children():
            if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and len(child) >= 2:
                blocks.extend(child)
            else:
                visit(child)

    if isinstance(model, (torch.nn.ModuleList, torch.nn.Sequential)) and len(model) >= 2:
        return list(model)
    visit(model)
    return blocks


def checkpointable_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks that have parameters: the ones checkpointing can wrap, in order."""
    return [b for b in repeated_blocks(model) if any(True for _ in b.parameters())]


def spread_evenly(count: int, total: int) -> list[int]:
    """Indices of ``count`` of ``total`` blocks, spread evenly from the first (2 of 6: 0 and 3)."""
    if not 0 <= count <= total:
        raise ValueError(f"cannot choose {count} of {total} blocks")
    return [i * total // count for i in range(count)]


def enable_checkpointing(model: torch.nn.Module, *, source: str = "model", blocks: int | None = None) -> int:
    """Wrap the forward of ``blocks`` repeated blocks (spread evenly; None: all of them) in
    checkpoint(); returns how many blocks are wrapped. Blocks wrapped before stay wrapped (call
    ``disable_checkpointing`` first to change how many)."""
    candidates = checkpointable_blocks(model)
    if not candidates:
        raise WorkloadError(
            f"{source}: activation checkpointing needs repeated blocks to wrap (an nn.ModuleList or "
            f"nn.Sequential of layers with parameters), and this model has none; use checkpointing off"
        )
    if blocks is not None and not 0 <= blocks <= len(candidates):
        raise WorkloadError(f"{source}: cannot checkpoint {blocks} blocks; the model has "
                            f"{len(candidates)} repeated blocks (use 0 to {len(candidates)})")
    chosen = candidates if blocks is None else [candidates[i] for i in spread_evenly(blocks, len(candidates))]
    for block in chosen:
        if getattr(block, _MARK, False):
            continue
        original = block.forward
        block.forward = functools.partial(_checkpointed_forward, original)
        setattr(block, _MARK, True)
    return len(chosen)


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Undo ``enable_checkpointing`` (the instance attributes it set are removed)."""
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
