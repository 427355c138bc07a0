"""Activation checkpointing around a model's repeated blocks, applied and removed in place.

The probe and the training loop share this, so a plan's checkpointing means the same thing in
both: every child of the model's outermost ``nn.ModuleList`` / ``nn.Sequential`` containers with
at least two children is run under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
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


def enable_checkpointing(model: torch.nn.Module, *, source: str = "model") -> int:
    """Wrap each repeated block's forward in checkpoint(); returns how many blocks were wrapped."""
    blocks = [b for b in repeated_blocks(model) if any(True for _ in b.parameters())]
    if not blocks:
        raise WorkloadError(
            f"{source}: activation checkpointing needs repeated blocks to wrap (an nn.ModuleList or "
            f"nn.Sequential of layers with parameters), and this model has none; use checkpointing off"
        )
    for block in blocks:
        if getattr(block, _MARK, False):
            continue
        original = block.forward
        block.forward = functools.partial(_checkpointed_forward, original)
        setattr(block, _MARK, True)
    return len(blocks)


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
