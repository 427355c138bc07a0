"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

B_noise = tr(Σ) / |G|², with G the true gradient and Σ the per-sample gradient covariance, is
roughly the batch beyond which a larger batch buys little more progress per step. Neither is
observable directly, but the squared norm of a mean gradient over B samples has expectation
|G|² + tr(Σ)/B. Two batch sizes give two equations: the "two-batch estimator".

The training loop already has both batches for free: the gradient after a window's first
micro-step (B_small samples, local to the rank) and the window's accumulated gradient (B_big, the
effective batch). Each window's pair of estimates is unbiased but very noisy (|G|² may even come
out negative), so they are averaged with *separate* exponential moving averages and only their
ratio is taken: the ratio of two noisy averages is far less biased than an average of ratios.

Everything here is pure arithmetic on floats; ``autotune.training.loop`` feeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.99
"""Weight of the past in each moving average (about the last 100 windows count). The per-window
estimates are heavy-tailed: on a linear regression, averages over 20 windows still range from a
fifth to twice the true B_noise, over 200 windows within about ±35%."""
MIN_WINDOWS = 20
"""Windows averaged before an estimate is reported: a handful of windows is mostly noise."""
FAR_BEYOND = 10.0
"""An effective batch this many times B_noise is well into diminishing returns."""


@dataclass(frozen=True)
class WindowEstimate:
    """One window's unbiased estimates of |G|² and tr(Σ)."""

    grad_sq: float
    trace: float


def two_batch_estimate(small_sq_norm: float, big_sq_norm: float, *, small_batch: float,
                       big_batch: float) -> WindowEstimate:
    """|G|² and tr(Σ) from |G_small|² (batch ``small_batch``) and |G_big|² (batch ``big_batch``).

    ``small_batch`` may be fractional: with several ranks the caller averages their |G_small|²
    and passes the harmonic mean of their micro-batch sizes, which keeps the estimate unbiased
    (E[mean_r |G_r|²] = |G|² + tr(Σ)·mean_r(1/b_r)).
    """
    if not 0 < small_batch < big_batch:
        raise ValueError(f"the two-batch estimator needs 0 < small batch < big batch, got "
                         f"{small_batch} and {big_batch}")
    trace = (small_sq_norm - big_sq_norm) / (1.0 / small_batch - 1.0 / big_batch)
    # = (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small), written from the trace so the
    # two estimates are consistent by construction.
    grad_sq = big_sq_norm - trace / big_batch
    return WindowEstimate(grad_sq=grad_sq, trace=trace)


@dataclass(frozen=True)
class NoiseScaleEMA:
    """Separate moving averages of the per-window |G|² and tr(Σ) estimates.

    The sums start at zero; ``weight`` (1 − decay^n) removes that start-up bias, Adam-style, so
    the averages are meaningful from the first window.
    """

    grad_sq_sum: float = 0.0
    trace_sum: float = 0.0
    weight: float = 0.0
    windows: int = 0

    @property
    def grad_sq(self) -> float | None:
        return self.grad_sq_sum / self.weight if self.weight > 0 else None

    @property
    def trace(self) -> float | None:
        return self.trace_sum / self.weight if self.weight > 0 else None

    def to_dict(self) -> dict:
        return {"grad_sq_sum": self.grad_sq_sum, "trace_sum": self.trace_sum,
                "weight": self.weight, "windows": self.windows}

    @classmethod
    def from_dict(cls, data: dict) -> "NoiseScaleEMA":
        return cls(**{key: data[key] for key in ("grad_sq_sum", "trace_sum", "weight", "windows")})


def update(ema: NoiseScaleEMA, estimate: WindowEstimate, *, decay: float = DECAY) -> NoiseScaleEMA:
    """The averages with one more window; a non-finite estimate (an fp16 overflow) is left out."""
    if not (math.isfinite(estimate.grad_sq) and math.isfinite(estimate.trace)):
        return ema
    keep, add = decay, 1.0 - decay
    return NoiseScaleEMA(grad_sq_sum=keep * ema.grad_sq_sum + add * estimate.grad_sq,
                         trace_sum=keep * ema.trace_sum + add * estimate.trace,
                         weight=keep * ema.weight + add, windows=ema.windows + 1)


def noise_scale(ema: NoiseScaleEMA, *, min_windows: int = MIN_WINDOWS) -> float | None:
    """B_noise = EMA[tr Σ] / EMA[|G|²] in samples, or None while it is undefined.

    Undefined: too few windows yet, or an average that is not positive (|G|² ≤ 0 means the
    gradient is lost in the noise so far; a negative trace is estimation noise, and a noise
    scale of 0 would wrongly say that every batch is too large).
    """
    grad_sq, trace = ema.grad_sq, ema.trace
    if ema.windows < min_windows or grad_sq is None or grad_sq <= 0 or trace is None or trace < 0:
        return None
    return trace / grad_sq


def unavailable_reason(*, micro_steps: int, world_size: int, sharded: bool = False) -> str | None:
    """Why no window can be measured with this split, or None when it can (``sharded``: FSDP2,
    which reduce-scatters where DDP all-reduces)."""
    if micro_steps >= 2:
        return None
    if world_size >= 2:
        reduces = ("FSDP reduce-scatters the only gradient into each rank's shard" if sharded else
                   "DDP all-reduces the only gradient in place")
        return (f"the gradient noise scale needs at least 2 micro-batches per rank in a window: "
                f"with one, {reduces} and the smaller batch's gradient is never seen")
    return ("the gradient noise scale needs gradient accumulation (2 or more micro-batches per "
            "window) or several ranks: with one micro-batch both batches of the two-batch "
            "estimator are the same")


def batch_advice(noise: float | None, effective_batch: int, *, far: float = FAR_BEYOND) -> str | None:
    """A warning when the effective batch is far past the noise scale, else None."""
    if noise is None or effective_batch <= far * noise:
        return None
    return (f"the effective batch {effective_batch} is {effective_batch / max(noise, 1e-12):.0f}x the "
            f"measured gradient noise scale B_noise ≈ {noise:.3g} samples: past about B_noise, a "
            f"larger batch gives diminishing returns (more compute for about the same "
            f"progress per step); a smaller effective batch (with a re-tuned LR) would likely train as well "
            f"for less compute")
