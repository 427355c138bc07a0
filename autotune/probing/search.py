"""The search for the largest micro-batch that fits, independent of devices and torch.

``search_largest_fitting(run_trial, budget, upper)`` needs only a function that runs one trial. It
keeps the bracket [lo, hi): lo the largest n seen to fit, hi the smallest seen to fail (or the
upper bound + 1), and proposes every next n strictly inside it, so each trial narrows the bracket
and the search ends whatever the trials say. The answer is proven by a fitting trial at n and a
failing one at n + 1 (or by reaching the upper bound): the memory model only *suggests* where to
look, so the answer is exact whatever shape memory has in n, as long as fitting is monotone.

How it suggests, from the trials that fit (the activation peak a(n) = batch + forward + backward,
and the optimizer-step peak s(n), each above the baseline b = parameters + buffers + optimizer
state, which stays live for the whole step):

- Peak memory is convex in n: the maximum of affine pieces (the end of backward, with every
  gradient live: b + G + small·n; the start of backward, activations: b + c + A·n with c ≈ 0,
  steeper), or quadratic with in-batch negatives. For a convex curve the secant through the two
  largest fitting points under-estimates memory beyond them, so its root is an *upper* estimate of
  the answer (U).
- Every piece above the baseline has a non-negative intercept, so the memory above the baseline
  per sample, (a(n) − b) / n, does not grow with n: the ray from the baseline through a fitting
  point over-estimates memory beyond it and its root is a *lower* estimate (L). Where the curve's
  piece passes through the baseline (activations) L and U meet and the answer is pinned down.
- The step peak is nearly flat (the batch is its only per-sample part) and is fitted as a line.

The next trial is U when the evidence says the curve is affine up to the answer (the three
largest fitting points agree on the slope, and the line's intercept is not the gradients' G,
which would mean a steeper activation piece may still take over), or when L and U nearly agree;
otherwise a point between L and U (geometric while they are far apart), so that a fit lands in the
large-n regime and a failure halves the bracket instead of creeping. A quadratic fit replaces the
line where the three largest points curve upward.
"""

from __future__ import annotations

import math
from typing import Callable

from .result import MemoryModel, Trial

GROWTH_LIMIT = 1 << 24
"""With no upper bound and memory that does not grow, stop doubling here."""

SLOPE_AGREEMENT = 0.01
"""Three points are collinear when the two secant slopes differ by at most this fraction."""

GRADIENT_LIKE = 0.4
"""A line whose intercept above the baseline is at least this share of the gradient bytes is the
end-of-backward regime: a steeper activation regime may lie beyond it."""

SUPERLINEAR = 0.002
"""A secant whose intercept is below the baseline by more than this share of the free budget
shows memory growing faster than linearly."""

CLOSE = 0.02
"""L and U within this fraction: take U directly."""

HAIR = 0.001
"""How far (a fraction of the budget) the fake-tensor estimate's peak may miss the real one and
still count as "a hair" (bench/estimate_accuracy.py: within 0.054% on every example). Where the
estimate's answer is closer than this to the budget, a real step there may not fit: the search
starts below it instead (see ``_estimate_trials``)."""


def fit_memory_model(trials: list[Trial]) -> MemoryModel:
    """Fit activation(n) and step(n) to the trials that fit (see ``MemoryModel``)."""
    points = _fitting_points(trials)
    if not points:
        return MemoryModel(points=0)
    base = _baseline(trials)
    act = [(t.micro_batch, _activation(t)) for t in points]
    step = [(t.micro_batch, t.step_peak_bytes or 0) for t in points]
    step_line = _line(step[-2], step[-1]) if len(step) >= 2 else (float(step[0][1]), 0.0)
    step_line = (step_line[0], max(step_line[1], 0.0))
    if len(points) == 1:
        # One point: the ray from the baseline, an over-estimate of the slope for convex memory.
        n, peak = act[0]
        slope = max(peak - base, 1) / n
        return MemoryModel(activation=(float(base), float(slope), 0.0), step=step_line, kind="linear",
                           points=1)
    top = act[-3:]
    if len(top) == 3 and _curves_up(top):
        quad = _quadratic(*top)
        if quad[2] > 0:
            return MemoryModel(activation=quad, step=step_line, kind="quadratic", points=len(points))
    line = _line(top[-2], top[-1])
    return MemoryModel(activation=(line[0], max(line[1], 0.0), 0.0), step=step_line, kind="linear",
                       points=len(points))


def _fitting_points(trials: list[Trial]) -> list[Trial]:
    """The fitting trials, one per n, sorted; those above a smaller failing n (a glitch) dropped."""
    failed = [t.micro_batch for t in trials if not t.fits]
    ceiling = min(failed) if failed else math.inf
    by_n = {t.micro_batch: t for t in trials if t.fits and t.micro_batch < ceiling}
    return [by_n[n] for n in sorted(by_n)]


def _baseline(trials: list[Trial]) -> float:
    for t in reversed(trials):
        if t.baseline_bytes is not None:
            return float(t.baseline_bytes)
    return 0.0


def _gradient_bytes(trials: list[Trial]) -> float | None:
    for t in reversed(trials):
        if t.gradient_bytes is not None:
            return float(t.gradient_bytes)
    return None


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


def _slopes_agree(p, q, r) -> bool:
    s1, s2 = _line(p, q)[1], _line(q, r)[1]
    return abs(s2 - s1) <= SLOPE_AGREEMENT * max(abs(s1), abs(s2), 1e-9)


def _curves_up(top) -> bool:
    s1, s2 = _line(top[0], top[1])[1], _line(top[1], top[2])[1]
    return s2 > s1 * (1 + SLOPE_AGREEMENT) and s2 > 0


def _root_linear(intercept: float, slope: float, budget: float) -> float:
    """Largest real n with intercept + slope·n ≤ budget (inf where it never passes the budget)."""
    if slope <= 0:
        return math.inf if intercept <= budget else -math.inf
    return (budget - intercept) / slope


def _root_quadratic(a: float, b: float, c: float, budget: float) -> float:
    if c <= 0:
        return _root_linear(a, b, budget)
    disc = b * b - 4 * c * (a - budget)
    if disc < 0:
        return -math.inf
    return (-b + math.sqrt(disc)) / (2 * c)


def _floor(x: float) -> float:
    return math.floor(x + 1e-9) if math.isfinite(x) else x


def search_largest_fitting(
    run_trial: Callable[[int], Trial], *, budget: int, upper: int | None, hint: int | None = None,
    estimate: Callable[[int], float] | None = None, share: int | None = None,
    known: Callable[[int], bool] | None = None, even: bool = False,
) -> tuple[int, list[Trial], MemoryModel]:
    """Exact largest n in [1, upper] for which ``run_trial(n).fits``; 0 when n = 1 does not fit.

    Assumes fitting is monotone in n (if n fits, every smaller n fits). Where a trial contradicts
    that, the bracket still shrinks with every trial, so the search ends.

    ``hint`` is where an estimate puts the answer (0: nothing fits): the search first tries the
    hint and the hint + 1, which prove the answer in two trials when the estimate is right, and
    otherwise continues from the bracket those two trials left.

    ``estimate`` (with ``hint``): the estimate's peak at n, the curve the hint came from. The
    first real step that fits then rescales that curve to the real peak, so an estimate that
    misses by a hair (``HAIR``) is corrected in at most three real steps with one failure: the
    hint (or, where the hint is within a hair of the budget, the largest n a hair below it), the
    corrected answer and the one above it (see ``_estimate_trials``).

    ``share`` (samples per optimizer step): only the micro-batches that take fewer accumulation
    steps than every smaller one are tried (``ceil(share / k)`` for k steps), and the answer is
    the largest of them that fits, proven by a failure at the next one: a micro-batch between
    takes as many steps as the one below it, so the plan's split is the same. With ``even``
    (a pipeline's split: equal micro-batches), only the divisors of ``share``: any other
    micro-batch plans the even split of the largest divisor below it.

    ``known(n)``: whether the trial at n costs nothing (a memo answers it: a layout screen ran
    it). Before any of those micro-batches is known to fit, the largest known one is tried first
    instead of halving: its answer narrows the bracket for free (8B at sequence 131072 under CP 8
    screened micro-batch 1, then halved to 3 and 2, 37 CPU s, where 1 and a failure at 2 prove
    it).
    """
    trials: list[Trial] = []
    lo, hi = 0, (upper + 1 if upper is not None else None)

    def snapped(n: int) -> int:
        """``n``, or the largest useful micro-batch below it, or the next one above ``lo``."""
        if share is None:
            return n
        n = _useful_at_most(n, share, even=even)
        return n if n > lo else _next_useful(lo, share, even=even)

    def open_bracket() -> bool:
        if share is None:
            return hi is None or hi - lo > 1
        above = _next_useful(lo, share, even=even)
        return above is not None and (hi is None or above < hi)

    def record(n: int) -> Trial:
        nonlocal lo, hi
        trial = run_trial(n)
        trials.append(trial)
        if trial.fits:
            lo = max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        return trial

    if hint is not None and estimate is not None:
        for n in _estimate_trials(hint, estimate, budget, upper, trials):
            n = snapped(n) if n > lo else n
            if n is None or n <= lo or (hi is not None and n >= hi):
                break  # known already: the ordinary search takes over from the bracket
            record(n)
    elif hint is not None:
        for n in _hint_trials(hint, upper):
            n = snapped(n) if n > lo else n
            if n is None or n <= lo or (hi is not None and n >= hi):
                break  # the hint itself failed: hint + 1 would fail too
            record(n)
    while lo == 0 and share is not None:
        # Only a few micro-batches change the steps: halve them (the upper middle one first, a
        # fit proves the answer where it is the largest below a failure) until one fits.
        values = [n for n in useful_micro_batches(share, share, even=even) if hi is None or n < hi]
        if not values:
            return 0, trials, fit_memory_model(trials)
        free = [n for n in values if known is not None and known(n)]
        record(free[-1] if free else values[len(values) // 2])
    if lo == 0:
        # Nothing known to fit yet (no hint, or it failed): micro-batch 1 either fits, giving the
        # baseline the estimates grow from, or proves that nothing does.
        if hi == 1 or not record(1).fits:
            return 0, trials, fit_memory_model(trials)
    while open_bracket():
        candidate = next_candidate(trials, budget, lo, hi)
        if candidate is None:
            break  # memory does not grow: doubling reached GROWTH_LIMIT without a failure
        candidate = snapped(candidate)
        assert lo < candidate and (hi is None or candidate < hi), (lo, candidate, hi)
        record(candidate)
    return lo, trials, fit_memory_model(trials)


def useful_micro_batches(top: int, share: int, *, even: bool = False) -> list[int]:
    """The micro-batches up to ``top`` that take fewer accumulation steps of ``share`` samples
    than every smaller one, ascending; with ``even`` (equal micro-batches only), the divisors
    of ``share``."""
    if even:
        return [n for n in range(1, min(top, share) + 1) if share % n == 0]
    return sorted(n for n in {-(-share // steps) for steps in range(1, share + 1)} if n <= top)


def _useful_at_most(n: int, share: int, *, even: bool = False) -> int:
    """The largest micro-batch of at most ``n`` (at least 1) that ``useful_micro_batches`` lists."""
    if even:
        return useful_micro_batches(n, share, even=True)[-1]
    return -(-share // -(-share // n))


def _next_useful(n: int, share: int, *, even: bool = False) -> int | None:
    """The smallest micro-batch above ``n`` that takes fewer accumulation steps of ``share``
    samples than ``n`` (None: ``n`` takes one); with ``even``, the next divisor of ``share``."""
    if even:
        return next((m for m in range(max(n, 0) + 1, share + 1) if share % m == 0), None)
    steps = -(-share // n) if n > 0 else share + 1
    return -(-share // (steps - 1)) if steps > 1 else None


def _hint_trials(hint: int, upper: int | None) -> list[int]:
    """The hint (clamped to [1, upper]) and the next micro-batch, where it is within the bound."""
    top = upper if upper is not None else GROWTH_LIMIT
    n = min(max(int(hint), 0), top)
    return [m for m in (n, n + 1) if 1 <= m <= top]


def _estimate_trials(hint: int, estimate: Callable[[int], float], budget: float, upper: int | None,
                     trials: list[Trial]):
    """The micro-batches to try first, from an estimate's answer and curve (a generator that reads
    each trial's result from ``trials`` before it proposes the next).

    1. The hint, unless a hair (``HAIR`` of the budget) below its estimated peak lie two or more
       micro-batches: a real step a hair above the estimate would not fit there, and a failure
       first costs a second one later (the answer's + 1). Then the largest n whose estimate is a
       hair below the budget. Where that fails too, the margin grows tenfold until a step fits.
    2. The real peak of the step that fit, over the estimate there, rescales the estimated curve;
       the largest n whose rescaled peak fits is the corrected answer: tried (unless it is the
       step that fit), then the one above it. An exact estimate takes two steps (hint, hint + 1)
       where a hair spans at most one micro-batch, three (safe, hint, hint + 1) where it spans
       more: the price of never failing twice on a hair.
    """
    top = upper if upper is not None else GROWTH_LIMIT
    h = min(max(int(hint), 0), top)
    if h < 1:
        return
    margin = HAIR * budget
    safe = max(_largest_below(estimate, budget - margin, h), 1)
    # A hair spanning one micro-batch at most: h first (if it fails, h - 1 = safe proves the
    # answer in one more step); spanning more, h would cost a second failure.
    n = h if h - safe <= 1 else safe
    while True:
        yield n
        trial = trials[-1]
        if trial.fits:
            break
        margin *= 10
        if n <= 1 or margin >= budget:
            return
        n = max(_largest_below(estimate, budget - margin, n - 1), 1)
    predicted = estimate(n)
    if predicted <= 0:
        return
    scale = trial.peak_bytes / predicted
    # No further than twice the estimate's answer: a curve that far off (a flat one sent a
    # real step of 16777216 samples, whose batch alone can exhaust the host) is no guide, and
    # the ordinary search takes over from the bracket.
    answer = _largest_below(lambda m: scale * estimate(m), budget, min(top, 2 * h), start=n)
    if answer > n:
        yield answer
        if not trials[-1].fits:
            return
        n = answer
    if n < top:
        yield n + 1


def _largest_below(curve: Callable[[int], float], limit: float, top: int, *, start: int = 1) -> int:
    """The largest n in [start, top] with ``curve(n) <= limit`` (``start`` - 1 where none is),
    for a curve that grows with n: doubling up from ``start``, then bisection."""
    if curve(start) > limit:
        return start - 1
    lo, step = start, 1
    while lo + step <= top and curve(lo + step) <= limit:
        lo, step = lo + step, step * 2
    hi = min(lo + step, top + 1)  # curve(hi) > limit, or hi is past the top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if curve(mid) <= limit else (lo, mid)
    return lo


def estimates(trials: list[Trial], budget: float) -> tuple[float, float, bool]:
    """(L, U, trusted) from the fitting trials: L a cautious and U an optimistic estimate of the
    largest n that fits; trusted when U is believed exact (memory affine up to the answer)."""
    points = _fitting_points(trials)
    base = _baseline(trials)
    grads = _gradient_bytes(trials)
    act = [(t.micro_batch, float(_activation(t))) for t in points]
    step = [(t.micro_batch, float(t.step_peak_bytes)) for t in points if t.step_peak_bytes is not None]

    # The optimizer step: nearly flat; a line through its two largest points (flat from one).
    if len(step) >= 2:
        step_root = _root_linear(*_line(step[-2], step[-1]), budget)
    elif step:
        # One point: the ray from the baseline (cautious) until a second point gives the slope.
        n, y = step[0]
        step_root = n * (budget - base) / (y - base) if y > base else math.inf
    else:
        step_root = math.inf

    # Ray from the baseline through each fitting point (cautious for convex piecewise memory).
    lower = max((n * (budget - base) / (y - base) if y > base else math.inf) for n, y in act)
    trusted = False
    if len(act) >= 2:
        intercept, slope = _line(act[-2], act[-1])
        upper_est = _root_linear(intercept, slope, budget)
        if intercept < base - SUPERLINEAR * max(budget - base, 1):
            # The secant passes below the baseline: no max of lines with non-negative intercepts
            # does that, memory grows faster than linearly (in-batch negatives). A quadratic through
            # the baseline and the two largest points; trusted once a third point agrees with it.
            quad = _quadratic((0, base), act[-2], act[-1])
            q_root = _root_quadratic(*quad, budget) if quad[2] > 0 else upper_est
            lower = upper_est = min(q_root, upper_est)
            if len(act) >= 3:
                n, y = act[-3]
                trusted = abs(quad[0] + quad[1] * n + quad[2] * n * n - y) <= SLOPE_AGREEMENT * max(y - base, 1)
        elif len(act) >= 3 and _slopes_agree(*act[-3:]):
            gradient_like = grads is not None and intercept - base >= GRADIENT_LIKE * grads
            trusted = not gradient_like and slope > 0
    else:
        upper_est = math.inf
    lower = min(lower, upper_est)
    return (_floor(min(lower, step_root)), _floor(min(upper_est, step_root)), trusted)


def next_candidate(trials: list[Trial], budget: float, lo: int, hi: int | None) -> int | None:
    """The next micro-batch to try, strictly inside (lo, hi); None to stop an unbounded search."""
    lower, upper_est, trusted = estimates(trials, budget)
    top = hi - 1 if hi is not None else GROWTH_LIMIT
    if lo >= top:
        return None
    if upper_est == math.inf and hi is None:
        # No sign of growth yet: the cautious estimate where there is one, else double.
        if lo < lower < math.inf:
            return int(min(lower, top))
        return min(lo * 2, GROWTH_LIMIT)
    # The last trial failed where the model expected a fit: it over-predicts.
    missed = bool(trials) and not trials[-1].fits and trials[-1].micro_batch > lo + 1
    # An estimate at or past a failure is refuted: the lower one when memory grows faster than a
    # ray (quadratic), the upper one when a steeper piece took over.
    failed = min((t.micro_batch for t in trials if not t.fits), default=math.inf)
    u_ok = upper_est < failed
    u = int(min(max(upper_est, lo), top))
    l = int(min(max(lower, lo), u)) if lower < failed else lo
    if u <= lo:
        return lo + 1  # the model says lo is the answer: prove it
    close = u - l <= max(1, CLOSE * u)
    if u_ok and not missed and (trusted or close):
        return u
    if l > lo and (close or ((missed or not u_ok or u <= 2 * l) and 2 * (l - lo) >= u - lo)):
        return l  # cautious, and at least half-way through the bracket
    # Between: geometric while far apart, arithmetic when close.
    base = max(l, lo, 1)
    candidate = int(math.sqrt(base * u)) if u >= 2 * base else (base + u) // 2
    return min(max(candidate, lo + 1), top)
