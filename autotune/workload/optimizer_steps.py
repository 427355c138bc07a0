"""Optimizer steps wherever autotune counts memory: what some optimizers need to run there.

torchao's low-bit optimizers (``torchao.optim.AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) compile
their per-parameter update with ``torch.compile(fullgraph=True)``, and torch.compile refuses to
run while a Python dispatch mode is active — which is how the CPU backend and the fake-tensor
estimate count bytes. Under such a mode their update runs eagerly (``force_eager``): the same
state, and the eager update's temporaries, which are what the mode then counts (an upper bound
of the compiled update's, which fuses them). On CUDA no mode is active and the update compiles
as it does in the user's own loop.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def counted_step():
    """Around ``optimizer.step()``: ``torch.compile`` inside the step runs eagerly while a
    dispatch mode counts memory (see the module docstring); otherwise nothing changes."""
    if _get_current_dispatch_mode_stack():  # the fake-tensor mode is on it too
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def set_group_lr(group: dict, lr: float) -> None:
    """Sets a parameter group's learning rate; in place where the optimizer keeps it as a tensor
    (torchao's low-bit AdamW refuses a float there)."""
    current = group.get("lr")
    if isinstance(current, torch.Tensor):
        current.fill_(lr)
    else:
        group["lr"] = lr


def group_lr(group: dict) -> float:
    lr = group["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) else lr


__all__ = ["counted_step", "group_lr", "set_group_lr"]
