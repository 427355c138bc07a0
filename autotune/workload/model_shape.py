"""The shapes a parallel layout depends on, read from a (fake) built model: attention heads and
key/value heads (tensor parallel splits whole heads), the residual width (what tensor, context
and pipeline parallel send between ranks) and the repeated blocks (pipeline stages).

Where they come from: a Hugging Face model's ``config`` (``num_attention_heads``,
``num_key_value_heads``, ``hidden_size``), else the attention modules' own attributes
(``num_heads`` as ``nn.MultiheadAttention`` and most hand-written attention keep it, and
``num_key_value_heads``/``num_kv_heads`` for grouped-query attention). A model that says none of
them has no known heads, and the layout search leaves tensor parallelism out for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .activation_checkpointing import checkpointable_blocks

_HEAD_NAMES = ("num_attention_heads", "num_heads", "n_heads", "n_head")
_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")


@dataclass(frozen=True)
class ModelShape:
    heads: int | None = None
    """Attention heads of every attention layer (None: not known, or layers differ)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); the heads where the model has no fewer."""
    hidden: int | None = None
    """The residual stream's width (None: not known)."""
    blocks: int = 0
    """Repeated blocks (the ones activation checkpointing wraps and a pipeline splits)."""

    @property
    def kv_hidden(self) -> int | None:
        """The width of one of K or V (hidden × kv_heads / heads)."""
        if self.hidden is None or not self.heads or not self.kv_heads:
            return self.hidden
        return self.hidden * self.kv_heads // self.heads


def model_shape(model: torch.nn.Module) -> ModelShape:
    """``model``'s heads, width and repeated blocks (see the module's docstring)."""
    config = getattr(model, "config", None)
    heads = _int_attr(config, _HEAD_NAMES)
    kv_heads = _int_attr(config, _KV_HEAD_NAMES)
    hidden = _int_attr(config, ("hidden_size", "n_embd", "d_model"))
    if heads is None:
        heads = _one_value(model, _HEAD_NAMES)
        kv_heads = _one_value(model, _KV_HEAD_NAMES)
    if hidden is None:
        hidden = next((m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return ModelShape(heads=heads, kv_heads=kv_heads or heads, hidden=hidden,
                      blocks=len(checkpointable_blocks(model)))


def _int_attr(obj, names) -> int | None:
    for name in names:
        value = getattr(obj, name, None) if obj is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _one_value(model: torch.nn.Module, names) -> int | None:
    """The one value the model's modules give for ``names`` (None: none, or they differ)."""
    found = {value for m in model.modules() if (value := _int_attr(m, names)) is not None}
    return found.pop() if len(found) == 1 else None


__all__ = ["ModelShape", "model_shape"]
