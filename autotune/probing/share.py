"""The probe's search when it plans for a per-rank share: one step at the share, windows below it.

A plan that trains a rank's share of the target batch in one micro-batch takes one step per
optimizer step; any smaller micro-batch means accumulation, whose micro-steps after the first
start with every gradient alive (see ``TrialSession.window_micro_batches``). The two are
different steps with different peaks, so trials at n < share measure a window and the trial at
the share one step, and the memory model is fitted to the window trials alone.

Fitting stays monotone in each kind, but not across them: the share can fit in one step where
a window at share - 1 does not (the window holds the gradients through its micro-step). So the
share is tried first, on its own, and the search for the largest window runs below it.
"""

from __future__ import annotations

import math
from typing import Callable

from .result import MemoryModel, Trial
from .search import fit_memory_model, search_largest_fitting


def window_steps(n: int, share: int | None) -> int:
    """Accumulation steps of the window a trial at micro-batch ``n`` stands for (1: one step)."""
    if share is None or n >= share:
        return 1
    return math.ceil(share / n)


def search_with_share(run_trial: Callable[[int], Trial], *, budget: int, upper: int | None,
                      share: int | None, hint: int | None = None, estimate=None,
                      try_share: bool = True, steps_only: bool = False) -> tuple[int, list[Trial], MemoryModel]:
    """``search_largest_fitting`` for a probe that plans for ``share`` samples per rank.

    Where ``upper`` reaches the share, one step at the share is tried first (unless
    ``try_share`` is False: the caller knows from an estimate that it does not fit) and is the
    answer when it fits; otherwise the search runs below the share, on window trials, and its
    memory model is theirs. ``hint`` and ``estimate``: see ``search_largest_fitting``.
    ``steps_only``: below the share, try only the micro-batches that take fewer accumulation
    steps than every smaller one (``search_largest_fitting``'s ``share``): the answer is the
    largest of those that fits, and the plan's split the same as from the exact largest."""
    first: list[Trial] = []
    if share is not None and upper is not None and upper >= share:
        if try_share:
            trial = run_trial(share)
            if trial.fits:
                return share, [trial], fit_memory_model([trial])
            first = [trial]
        upper = share - 1
        if upper < 1:
            return 0, first, fit_memory_model([])
        if hint is not None:
            hint = min(hint, upper)
    best, trials, model = search_largest_fitting(run_trial, budget=budget, upper=upper, hint=hint,
                                                 estimate=estimate,
                                                 share=share if steps_only and share is not None and upper is not None and upper < share
                                                 else None)
    return best, first + trials, model


__all__ = ["search_with_share", "window_steps"]
