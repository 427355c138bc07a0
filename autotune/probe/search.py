"""The search for the largest micro-batch that fits, independent of devices and torch.

``search_largest_fitting(run_trial, budget, upper)`` needs only a function that runs one trial:
fit a memory model to the trials that fit, try the largest n it predicts to fit, and use every
outcome to narrow the bracket [largest that fits, smallest that does not]. Predictions are only
ever *suggestions*: the answer is proven by a fitting trial at n and a failing one at n + 1 (or
by reaching the upper bound), so it is exact whatever shape memory has in n.
"""

from __future__ import annotations

from typing import Callable

from .result import MemoryModel, Trial

GROWTH_LIMIT = 1 << 24
"""With no upper bound and memory that does not grow, stop doubling here."""


def fit_memory_model(trials: list[Trial]) -> MemoryModel:
    """Fit activation(n) and step(n) to the trials that fit (see ``MemoryModel``)."""
    points = sorted({t.micro_batch: t for t in trials if t.fits}.values(), key=lambda t: t.micro_batch)
    if not points:
        return MemoryModel(points=0)
    act = [(t.micro_batch, _activation(t)) for t in points]
    step = [(t.micro_batch, t.step_peak_bytes or 0) for t in points]
    if len(points) == 1:
        # One point: charge everything above the baseline to the samples. That over-states the
        # slope, so the first prediction lands below the answer and gives a well-spread second point.
        n, peak = act[0]
        base = points[0].baseline_bytes or 0
        slope = max(peak - base, 1) / n
        return MemoryModel(activation=(float(base), float(slope), 0.0), step=(float(step[0][1]), 0.0),
                           kind="linear", points=1)
    top = act[-3:]
    step_line = _line(step[-3:][0], step[-1])
    if len(top) == 3:
        quad = _quadratic(*top)
        line = _line(top[0], top[2])
        middle_n, middle_peak = top[1]
        linear_error = abs(line[0] + line[1] * middle_n - middle_peak) / max(middle_peak, 1)
        if quad[2] > 0 and linear_error > 0.01:
            return MemoryModel(activation=quad, step=step_line, kind="quadratic", points=len(points))
    line = _line(top[0], top[-1])
    return MemoryModel(activation=(line[0], line[1], 0.0), step=step_line, kind="linear",
                       points=len(points))


def _activation(trial: Trial) -> int:
    return trial.activation_peak_bytes if trial.activation_peak_bytes is not None else trial.peak_bytes


def _line(p, q) -> tuple[float, float]:
    (n1, y1), (n2, y2) = p, q
    if n1 == n2:
        return float(y2), 0.0
    slope = (y2 - y1) / (n2 - n1)
    return float(y1 - slope * n1), float(slope)


def _quadratic(p, q, r) -> tuple[float, float, float]:
    (x1, y1), (x2, y2), (x3, y3) = p, q, r
    d1 = (y2 - y1) / (x2 - x1)
    d2 = (y3 - y2) / (x3 - x2)
    c = (d2 - d1) / (x3 - x1)
    b = d1 - c * (x1 + x2)
    a = y1 - b * x1 - c * x1 * x1
    return float(a), float(b), float(c)


def search_largest_fitting(
    run_trial: Callable[[int], Trial], *, budget: int, upper: int | None
) -> tuple[int, list[Trial], MemoryModel]:
    """Exact largest n in [1, upper] for which ``run_trial(n).fits``; 0 when n = 1 does not fit.

    Assumes fitting is monotone in n (if n fits, every smaller n fits).
    """
    trials: list[Trial] = []
    lo, hi = 0, (upper + 1 if upper is not None else None)

    def record(n: int) -> Trial:
        nonlocal lo, hi
        trial = run_trial(n)
        trials.append(trial)
        if trial.fits:
            lo = max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        return trial

    if not record(1).fits:
        return 0, trials, fit_memory_model(trials)
    missed = False
    while hi is None or hi - lo > 1:
        model = fit_memory_model(trials)
        predicted = model.largest_within(budget, limit=GROWTH_LIMIT)
        candidate = _next_candidate(predicted, lo, hi, missed)
        if candidate is None:
            break  # memory does not grow: doubling reached GROWTH_LIMIT without a failure
        expected_fit = model.predict(candidate) <= budget
        missed = record(candidate).fits != expected_fit
    return lo, trials, fit_memory_model(trials)


def _next_candidate(predicted, lo, hi, missed) -> int | None:
    if hi is None and (predicted is None or predicted >= GROWTH_LIMIT):
        return None if lo >= GROWTH_LIMIT else min(lo * 2, GROWTH_LIMIT)
    top = hi - 1 if hi is not None else GROWTH_LIMIT
    candidate = min(max(predicted if predicted is not None else top, lo + 1), top)
    at_edge = candidate in (lo + 1, top)
    if missed and at_edge and hi is not None and hi - lo > 2:
        # The model was just wrong and points at the bracket's edge: creeping there one step at
        # a time could take many trials, so halve the bracket instead.
        return (lo + hi) // 2
    if missed and hi is None and candidate == lo + 1:
        return lo * 2
    return candidate
