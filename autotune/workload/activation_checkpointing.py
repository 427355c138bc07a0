"""Activation checkpointing around a model's repeated blocks, applied and removed in place.

The probe and the training loop share this, so a plan's checkpointing means the same thing in
both. The blocks are the children of the model's outermost ``nn.ModuleList`` / ``nn.Sequential``
containers with at least two children (and parameters); K of them, spread evenly, or all of them,
run under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

A model with its own switch (Hugging Face's ``supports_gradient_checkpointing`` with
``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``) is switched with it when
every block is checkpointed, so the probe measures what HF Trainer runs; for K of N its blocks are
wrapped here. Either way every key-value cache the model keeps (each module's ``config.use_cache``:
T5's decoder keeps its own config) is turned off as HF Trainer does: recomputing with a cache on
breaks (T5: "a different number of tensors was saved") or costs memory the trainer would not spend.

Recomputation runs a block's forward again in backward; BatchNorm layers would update their
running statistics a second time, so their buffers are put back after each recomputation.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import WorkloadError
from .adapters import prefix_tuned

_MARK = "_autotune_checkpointed"
_HF_MARK = "_autotune_hf_checkpointing"
"""Set on a model switched with its own checkpointing switch."""
_CACHE_MARK = "_autotune_cache_off"
"""Set on a checkpointed model: each config its modules keep, with the use_cache it had before."""


def repeated_blocks(model: torch.nn.Module, *, skip=()) -> list[torch.nn.Module]:
    """The children of the outermost ModuleList/Sequential containers with two or more children
    (not looking inside the modules in ``skip``)."""
    blocks: list[torch.nn.Module] = []

    def visit(module):
        for child in module.children():
            if any(child is s for s in skip):
                continue
            if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and len(child) >= 2:
                blocks.extend(child)
            else:
                visit(child)

    if any(model is s for s in skip):
        return []
    if isinstance(model, (torch.nn.ModuleList, torch.nn.Sequential)) and len(model) >= 2:
        return list(model)
    visit(model)
    return blocks


def has_own_switch(model: torch.nn.Module) -> bool:
    """Whether the model carries its own checkpointing switch (Hugging Face models)."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        callable(getattr(model, "activation_checkpointing_enable", None))
        or callable(getattr(model, "gradient_checkpointing_enable", None)))


def checkpointable_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks that have parameters: the ones checkpointing can wrap, in order."""
    return [b for b in repeated_blocks(model) if any(True for _ in b.parameters())]


def checkpointing_refusal(model: torch.nn.Module) -> str | None:
    """Why activation checkpointing cannot train ``model`` although it has blocks to wrap, or None.

    peft's prefix tuning hands its learned prefix to every layer through the key-value cache, which
    each layer extends as it runs: a block recomputed in backward sees the cache its first run
    left, and its attention's shapes no longer match (peft issue 869; peft 2191 makes peft refuse
    the pair with gradient checkpointing)."""
    if prefix_tuned(model):
        return ("peft's prefix tuning passes its prefix through the key-value cache, which a "
                "block recomputed in backward extends again (peft issue 869), so activation "
                "checkpointing cannot train it")
    return None


_SINGLE_OP_LAYERS = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.modules.conv._ConvNd, torch.nn.Embedding,
                     torch.nn.EmbeddingBag, torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm,
                     torch.nn.modules.batchnorm._NormBase)
"""torch's layers that run one op on their input: what their backward keeps is their input (and,
for the norms, a statistic per row or channel)."""


def checkpointing_futile(model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> str | None:
    """Why checkpointing ``model``'s blocks (``checkpointable_blocks``, where the caller has them)
    frees next to nothing, or None: every block is one of torch's single-op layers (an MLP as a
    Sequential of Linear and activation layers). A checkpoint keeps its block's input, which such
    a layer keeps for its own backward anyway."""
    blocks = checkpointable_blocks(model) if blocks is None else blocks
    if not blocks or own_switch_models(model) or not all(
            isinstance(b, _SINGLE_OP_LAYERS) and not any(True for _ in b.children()) for b in blocks):
        return None
    kinds = collections.Counter(type(block).__name__ for block in blocks)
    layers = ", ".join(f"{count} {name}" for name, count in kinds.items())
    return (f"its repeated blocks are single layers ({layers}): a checkpoint keeps each one's input, "
            f"which the layer keeps for its own backward anyway, so checkpointing frees next to nothing")


def spread_evenly(count: int, total: int) -> list[int]:
    """Indices of ``count`` of ``total`` blocks, spread evenly from the first (2 of 6: 0 and 3)."""
    if not 0 <= count <= total:
        raise ValueError(f"cannot choose {count} of {total} blocks")
    return [i * total // count for i in range(count)]


def enable_checkpointing(model: torch.nn.Module, *, source: str = "model", blocks: int | None = None,
                         indices: list[int] | None = None) -> int:
    """Checkpoint ``blocks`` of the model's repeated blocks (spread evenly; None: all of them),
    or the blocks at ``indices`` (wrapped here, never by a model's own switch); returns how many
    blocks are checkpointed.

    With every block, models with their own switch are switched with it, also where they sit
    inside the model (a Hugging Face model in a LightningModule), and the repeated blocks outside
    them are wrapped. Blocks wrapped before stay wrapped (call ``disable_checkpointing`` first to
    change how many); enabling an already checkpointed model changes nothing.
    """
    refused = checkpointing_refusal(model)
    if refused is not None:
        raise WorkloadError(f"{source}: {refused}; use checkpointing off")
    candidates = checkpointable_blocks(model)
    switched = own_switch_models(model)
    if not candidates and not switched:
        raise WorkloadError(
            f"{source}: activation checkpointing needs repeated blocks to wrap (an nn.ModuleList or "
            f"nn.Sequential of layers with parameters), and this model has none; use checkpointing off"
        )
    _cache_off(model)
    if indices is not None:
        count, chosen = 0, [candidates[i] for i in indices]
    elif blocks is None or blocks == len(candidates):
        count = sum(_enable_own_switch(m) for m in switched)
        chosen = [b for b in repeated_blocks(model, skip=switched) if any(True for _ in b.parameters())]
    else:
        if not 0 <= blocks <= len(candidates):
            raise WorkloadError(f"{source}: cannot checkpoint {blocks} blocks; the model has "
                                f"{len(candidates)} repeated blocks (use 0 to {len(candidates)})")
        count = 0
        chosen = [candidates[i] for i in spread_evenly(blocks, len(candidates))]
    for block in chosen:
        if getattr(block, _MARK, False):
            continue
        original = block.forward
        block.forward = functools.partial(_checkpointed_forward, original, _context_fn(block))
        setattr(block, _MARK, True)
    return count + len(chosen)


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Undo ``enable_checkpointing`` (the instance attributes it set are removed)."""
    for module in model.modules():
        if hasattr(module, _HF_MARK):
            _disable_own_switch(module)
        if hasattr(module, _CACHE_MARK):
            _restore_cache(module)
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)


def own_switch_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules (the model itself, or modules inside it) with their own switch."""
    found: list[torch.nn.Module] = []

    def visit(module):
        if has_own_switch(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _checkpointed_forward(forward, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _enable_own_switch(model) -> int:
    if not hasattr(model, _HF_MARK):
        setattr(model, _HF_MARK, True)
        kwargs = {"use_reentrant": False}
        context_fn = _context_fn(model)
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        # activation_checkpointing_enable is transformers 5's name; gradient_checkpointing_enable
        # (4.x) is a deprecated alias there that warns.
        if callable(getattr(model, "activation_checkpointing_enable", None)):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    flagged = sum(1 for m in model.modules() if m is not model and getattr(m, "gradient_checkpointing", False)
                  and _is_layer(m))
    return flagged or len(repeated_blocks(model))


def _cache_off(model) -> None:
    # Every config the model's modules keep, not only the model's own: T5's decoder keeps a copy
    # of the config with use_cache=True, and its K-of-N blocks then saved 57 tensors in forward and
    # 53 in recomputation (CheckpointError). HF's own switch covers only all blocks, not K of N.
    if hasattr(model, _CACHE_MARK):
        return
    before: list[tuple[object, object]] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if (config is not None and hasattr(config, "use_cache")
                and not any(config is seen for seen, _ in before)):
            before.append((config, config.use_cache))
            config.use_cache = False
    setattr(model, _CACHE_MARK, before)


def _restore_cache(model) -> None:
    for config, use_cache in getattr(model, _CACHE_MARK):
        config.use_cache = use_cache
    delattr(model, _CACHE_MARK)


def _is_layer(module) -> bool:
    # HF's per-layer blocks; stacks that also carry the flag (T5Stack) are not blocks.
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _disable_own_switch(model) -> None:
    if callable(getattr(model, "activation_checkpointing_disable", None)):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
    delattr(model, _HF_MARK)  # the caches are put back by _restore_cache


def _context_fn(scope: torch.nn.Module):
    """For ``checkpoint(context_fn=...)``: keep recomputation from updating BatchNorm's running
    statistics a second time; None where the scope has no BatchNorm tracking them."""
    norms = [m for m in scope.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return None
    return functools.partial(_batchnorm_contexts, norms)


def _batchnorm_contexts(norms):
    return contextlib.nullcontext(), _running_stats_kept(norms)


@contextlib.contextmanager
def _running_stats_kept(norms):
    buffers = [b for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
               if b is not None]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
