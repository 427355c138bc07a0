"""Synthetic and recorded memory curves for simulating the probe's search without torch.

A ``Curve`` gives the activation peak (batch + forward + backward) and the optimizer-step peak of
one steady-state training step at micro-batch n, in bytes, plus the baseline (parameters, buffers,
optimizer state) and the gradient bytes. ``Curve.runner(budget)`` returns a ``run_trial`` function
for ``search_largest_fitting`` that counts its calls, and ``Curve.exact(budget, upper)`` the true
answer by brute force over the (monotone) curve.

Families:
- linear: activation = base + c + A·n (c small), step flat
- flat_then_linear: the optimizer step dominates small n (step = base + 2G + T + b·n)
- convex: like an MLP, gradients dominate small n (base + G + s·n), then one or two steeper
  activation pieces take over (max of affine functions)
- quadratic: in-batch negatives, an n×n logits matrix (activation has a q·n² term)
- recorded: measured on examples/ (tests/data/probe_curves.json), linearly interpolated
"""

from __future__ import annotations

import bisect
import json
import pathlib
from dataclasses import dataclass, field
from typing import Callable

from autotune.probing.result import Trial

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DATA = pathlib.Path(__file__).resolve().parent / "data" / "probe_curves.json"


@dataclass
class Curve:
    name: str
    family: str
    activation: Callable[[int], float]
    step: Callable[[int], float]
    baseline: int
    gradient_bytes: int | None
    breakdown: bool = True
    """False: trials report only peak_bytes (no activation/step split, no baseline)."""
    linear_near_answer: bool = True
    """Whether the peak is affine around every answer (the family where ≤ 6 trials, ≤ 1 OOM holds)."""
    tags: dict = field(default_factory=dict)

    def peak(self, n: int) -> int:
        return int(max(self.activation(n), self.step(n)))

    def exact(self, budget: int, upper: int | None, limit: int = 1 << 24) -> int:
        """The largest n ≤ upper whose peak fits (0 if none), by exponential + binary search."""
        top = upper if upper is not None else limit
        if self.peak(1) > budget:
            return 0
        lo, hi = 1, 2
        while hi <= top and self.peak(hi) <= budget:
            lo, hi = hi, hi * 2
        hi = min(hi, top + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(mid) <= budget else (lo, mid)
        return lo

    def runner(self, budget: int) -> "Runner":
        return Runner(self, budget)


class Runner:
    """run_trial(n) for the search, with a log of what it was asked."""

    def __init__(self, curve: Curve, budget: int):
        self.curve, self.budget = curve, budget
        self.calls: list[int] = []
        self.ooms = 0

    def __call__(self, n: int) -> Trial:
        assert isinstance(n, int) and n >= 1, n
        self.calls.append(n)
        c = self.curve
        act, step = int(c.activation(n)), int(c.step(n))
        peak = max(act, step)
        base = c.baseline if c.breakdown else None
        grads = c.gradient_bytes if c.breakdown else None
        if peak > self.budget:
            self.ooms += 1
            # Like a real OOM: the usage when the allocation failed, somewhere above the budget.
            return Trial(micro_batch=n, fits=False, peak_bytes=min(peak, self.budget + 4 * KiB),
                         seconds=0.0, baseline_bytes=base, gradient_bytes=grads)
        if not c.breakdown:
            return Trial(micro_batch=n, fits=True, peak_bytes=peak, seconds=0.0)
        return Trial(micro_batch=n, fits=True, peak_bytes=peak, seconds=0.0,
                     activation_peak_bytes=act, step_peak_bytes=step, baseline_bytes=base,
                     gradient_bytes=grads)


# --- synthetic families ---------------------------------------------------------------------

def linear(base=400 * MiB, grads=100 * MiB, c=2 * MiB, per_sample=3 * MiB, name="linear") -> Curve:
    """Activations dominate from n = 1: the textbook case."""
    return Curve(name, "linear", lambda n: base + c + per_sample * n,
                 lambda n: base + grads + 5 * MiB + 8 * KiB * n, base, grads)


def flat_then_linear(base=3 * GiB, grads=1 * GiB, per_sample=6 * MiB, c=0, breakdown=True,
                     name="flat_then_linear") -> Curve:
    """The optimizer step (gradients + a foreach transient of about one parameter size) dominates
    small n; activations, linear in n, take over past n ≈ 2G / per_sample."""
    return Curve(name, "flat_then_linear",
                 lambda n: base + c + per_sample * n + min(grads, 64 * KiB * n),
                 lambda n: base + 2 * grads + 16 * KiB * n, base, grads, breakdown=breakdown,
                 linear_near_answer=breakdown)


def convex(base=30 * MiB, grads=10 * MiB, small=6 * KiB, pieces=((8 * MiB, 14 * KiB), (40 * KiB, 22 * KiB)),
           name="convex") -> Curve:
    """An MLP's activation peak: all gradients live at the end of backward dominate small n
    (base + G + s·n); steeper activation pieces (intercept, slope) take over at larger n."""
    def act(n):
        return max(base + grads + small * n, *(base + c + a * n for c, a in pieces))
    return Curve(name, "convex", act, lambda n: base + 2 * grads + 2 * KiB * n, base, grads,
                 linear_near_answer=False)


def quadratic(base=2 * GiB, grads=500 * MiB, per_sample=2 * MiB, per_pair=4 * KiB, name="quadratic") -> Curve:
    """In-batch negatives: an n×n similarity matrix (logits, softmax, their gradients)."""
    return Curve(name, "quadratic",
                 lambda n: max(base + grads + 64 * KiB * n, base + per_sample * n + per_pair * n * n),
                 lambda n: base + 2 * grads + 16 * KiB * n, base, grads, linear_near_answer=False)


def synthetic_curves() -> list[Curve]:
    return [
        linear(),
        linear(c=0, per_sample=5 * MiB, name="linear_c0"),
        linear(base=11 * MiB, grads=4 * MiB, c=300 * KiB, per_sample=5 * MiB, name="linear_lm"),
        linear(base=8 * GiB, grads=2 * GiB, c=1 * GiB, per_sample=40 * MiB, name="linear_big_c"),
        linear(base=100 * MiB, grads=30 * MiB, c=0, per_sample=3 * KiB, name="linear_tiny_slope"),
        flat_then_linear(),
        flat_then_linear(base=300 * MiB, grads=100 * MiB, per_sample=200 * KiB, name="flat_then_linear_2"),
        flat_then_linear(breakdown=False, name="flat_then_linear_peak_only"),
        convex(),
        convex(pieces=((0, 22 * KiB),), name="convex_one_kink"),
        convex(base=60 * MiB, grads=20 * MiB, small=4 * KiB,
               pieces=((15 * MiB, 10 * KiB), (5 * MiB, 18 * KiB), (0, 30 * KiB)), name="convex_three_kinks"),
        quadratic(),
        quadratic(per_sample=256 * KiB, per_pair=32 * KiB, name="quadratic_steep"),
        quadratic(grads=50 * MiB, per_sample=8 * MiB, per_pair=1 * KiB, name="quadratic_mild"),
    ]


# --- recorded curves --------------------------------------------------------------------------

def _interpolate(xs, ys):
    def f(n):
        i = bisect.bisect_left(xs, n)
        if i < len(xs) and xs[i] == n:
            return ys[i]
        i = min(max(i, 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    return f


def recorded_curves() -> list[Curve]:
    data = json.loads(DATA.read_text())["curves"]
    curves = []
    for name, rec in data.items():
        xs = [p[0] for p in rec["points"]]
        act = _interpolate(xs, [p[1] for p in rec["points"]])
        step = _interpolate(xs, [p[2] for p in rec["points"]])
        curves.append(Curve(name, "recorded", act, step, rec["baseline"], rec["gradient_bytes"],
                            linear_near_answer=False, tags={"max_n": xs[-1]}))
    return curves


def budgets_for(curve: Curve, count: int = 12, top_n: int | None = None) -> list[int]:
    """Budgets spread (geometrically in the answer) from a few samples to ``top_n``."""
    top_n = top_n or curve.tags.get("max_n", 4096)
    lo, hi = curve.peak(2), curve.peak(top_n)
    out = []
    for i in range(count):
        t = i / max(count - 1, 1)
        out.append(int(lo * (hi / lo) ** t) + 12345 * i)  # the offset keeps budgets off sample points
    return out


def is_linear_near(curve: Curve, answer: int) -> bool:
    """Whether the peak is affine on [answer/2, answer+1] (checked at a few points)."""
    if answer < 4:
        return True
    xs = [answer // 2, (3 * answer) // 4, answer, answer + 1]
    ys = [curve.peak(x) for x in xs]
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    return all(abs(ys[0] + slope * (x - xs[0]) - y) <= 1e-6 * max(y, 1) + 2 for x, y in zip(xs, ys))
