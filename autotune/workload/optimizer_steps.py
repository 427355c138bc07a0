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

import math

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


def plan_group_lrs(optimizer: torch.optim.Optimizer, lr: float) -> list[float]:
    """Each parameter group's LR under the plan's ``lr``: groups at the optimizer's own LR take
    ``lr``; a group given its own (a no-decay group at a third of it) keeps its ratio to the
    optimizer's LR, so the plan rescales every group alike. The ratio is read from the LR the
    group started from (``initial_lr``, where a scheduler has set it) and is 1 where either LR is
    not a positive finite number."""
    default = optimizer.defaults.get("lr")
    default = float(default) if isinstance(default, (int, float, torch.Tensor)) else None
    found = []
    for group in optimizer.param_groups:
        start = group.get("initial_lr", group.get("lr"))
        start = float(start) if isinstance(start, (int, float, torch.Tensor)) else None
        usable = (default is not None and start is not None and math.isfinite(default)
                  and math.isfinite(start) and default > 0 and start > 0)
        found.append(lr * start / default if usable else lr)
    return found


__all__ = ["counted_step", "group_lr", "plan_group_lrs", "set_group_lr"]
