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
from .search import useful_micro_batches, fit_memory_model, search_largest_fitting


def window_steps(n: int, share: int | None) -> int:
    """Accumulation steps of the window a trial at micro-batch ``n`` stands for (1: one step)."""
    if share is None or n >= share:
        return 1
    return math.ceil(share / n)


def search_with_share(run_trial: Callable[[int], Trial], *, budget: int, upper: int | None,
                      share: int | None, hint: int | None = None, estimate=None,
                      try_share: bool = True, steps_only: bool = False,
                      limit: int | None = None, least: int | None = None,
                      known=None, even: bool = False) -> tuple[int, list[Trial], MemoryModel]:
    """``search_largest_fitting`` for a probe that plans for ``share`` samples per rank.

    Where ``upper`` reaches the share, one step at the share is tried first (unless
    ``try_share`` is False: the caller knows from an estimate that it does not fit) and is the
    answer when it fits; otherwise the search runs below the share, on window trials, and its
    memory model is theirs. ``hint`` and ``estimate``: see ``search_largest_fitting``.
    ``steps_only``: below the share, try only the micro-batches that take fewer accumulation
    steps than every smaller one (``search_largest_fitting``'s ``share``): the answer is the
    largest of those that fits, and the plan's split the same as from the exact largest;
    ``even`` (a pipeline's equal micro-batches, with ``steps_only``): the divisors of the share.
    ``limit`` (what a plan may hold: the budget less the headroom): see ``_down_to_limit``.
    ``least`` (at least ``upper``): no micro-batch below ``upper`` is worth a trial (a smaller
    shard group is planned only where it reaches the whole world's steps): one trial at
    ``upper``, the answer ``upper`` where it fits, else 0. ``known(n)``: whether the trial at n
    costs nothing (see ``search_largest_fitting``)."""
    if least is not None and upper is not None and least >= upper:
        trial = run_trial(upper)
        return (upper if trial.fits else 0), [trial], fit_memory_model([trial])
    best, trials, model = _search(run_trial, budget=budget, upper=upper, share=share, hint=hint,
                                  estimate=estimate, try_share=try_share, steps_only=steps_only,
                                  known=known, even=even and steps_only)
    return _down_to_limit(run_trial, best, trials, model, share=share, limit=limit,
                          even=even and steps_only)


def _search(run_trial, *, budget, upper, share, hint, estimate, try_share, steps_only, known, even):
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
                                                 estimate=estimate, known=known, even=even,
                                                 share=share if steps_only and share is not None and upper is not None and upper < share
                                                 else None)
    return best, first + trials, model


def _down_to_limit(run_trial: Callable[[int], Trial], best: int, trials: list[Trial], model: MemoryModel,
                   *, share: int | None, limit: int | None,
                   even: bool = False) -> tuple[int, list[Trial], MemoryModel]:
    """Where the largest micro-batch that fits the budget (``best``, the probe's answer) holds
    more than ``limit``, the largest below it within ``limit``, measured: the plan's micro-batch
    is then a trial's, not the memory model's guess from points past the limit. 70B under FSDP on
    256 H100s fitted the share of 2 in one step at 74.55 GiB, past the 70.84 the headroom leaves,
    and the model put a window of 2 x 1 at 75.58 GiB, so no micro-batch was planned, where the
    window, measured, holds 45.80 GiB.

    Only the micro-batches that change the accumulation steps (below the share) are tried: the
    largest the memory model, refitted after each trial, puts within the limit, then the one
    above it, which prove the answer in two trials where the model is right; where the model
    puts none within, halving (the upper middle one first), until the largest within the limit
    is proven by a measured one above it. ``best`` stays the probe's raw maximum."""
    top = next((t for t in trials if t.micro_batch == best and t.fits), None)
    if limit is None or top is None or top.peak_bytes <= limit:
        return best, trials, model
    candidates = (useful_micro_batches(best - 1, share, even=even) if share is not None
                  else list(range(1, best)))
    added: list[Trial] = []
    within, trust = False, True
    while candidates:
        # The memory model, refitted to every trial so far, guesses (not twice in a row where
        # its guess did not hold); where it puts none within the limit, the one above the last
        # trial within proves it, else halve.
        guessed = [m for m in candidates if trust and model.points and model.predict(m) <= limit]
        n = guessed[-1] if guessed else candidates[0] if within else candidates[len(candidates) // 2]
        trial = run_trial(n)
        added.append(trial)
        within = trial.fits and trial.peak_bytes <= limit
        trust = within or not guessed
        candidates = [m for m in candidates if (m > n if within else m < n)]
        model = _window_model(trials + added)
    return best, trials + added, model


def _window_model(trials: list[Trial]) -> MemoryModel:
    """The memory model of the window trials where there are any (see the module docstring)."""
    return fit_memory_model([t for t in trials if t.window] or trials)


__all__ = ["search_with_share", "window_steps"]
