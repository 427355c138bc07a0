"""The training loop's own cost per micro-step and per window on this CPU, measured once and
cached with the CPU profile (``timing.cpu_profile``).

``autotune train``'s loop (``training.loop.StepRunner``) does work the fake step does not hold:
per micro-step it moves the batch, counts its items and scales the loss; per window it zeroes the
gradients, steps the scheduler and records metrics. Measured by the loop itself (``measure``'s
timed windows, on ``cpu_profile.clock``) on a trivial model (one 4×4 Linear), whose windows are
nearly all loop: a window of ``_MICRO_STEPS`` samples as one micro-step and as ``_MICRO_STEPS``
one-sample micro-steps, less the roofline's step (``roofline.window_time`` without loop costs);
the extra per extra micro-step is the micro-step's, what is left at one micro-step the window's.
The two windows take turns (``measure.compare_configurations``): the costs are a difference of
two small times, which a machine whose speed drifts would otherwise take at two moments.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import torch

from ..memory.cpu import CPUMemoryBackend
from ..timing.count import count_steps_costs
from ..timing.cpu_profile import cache_path, clock, cpu_speed, machine_key, save_cached
from ..timing.roofline import DeviceSpeed, window_time
from ..workload.contract import Workload
from .measure import Configuration, compare_configurations

SOURCE = "measured on this machine by autotune.tuning.loop_cost"
_MICRO_STEPS = 8
_SECONDS = 1.0
_WIDTH = 4


def cpu_speed_with_loop(*, refresh: bool = False, cache_dir: Path | None = None) -> DeviceSpeed:
    """``cpu_speed`` with the loop's costs: from the cache, or measured (and added to the cached
    profile) when the profile has none or ``refresh``."""
    speed = cpu_speed(refresh=refresh, cache_dir=cache_dir)
    if "loop" in speed.sources and not refresh:
        return speed
    speed = with_loop_costs(speed)
    save_cached(cache_path(cache_dir), machine_key(), speed)
    return speed


def with_loop_costs(speed: DeviceSpeed) -> DeviceSpeed:
    """``speed`` with ``loop_micro_step_s`` and ``loop_window_s`` measured (about a second)."""
    workload = _trivial_workload()
    costs = count_steps_costs(workload, [1, _MICRO_STEPS])
    bare = dataclasses.replace(speed, loop_micro_step_s=0.0, loop_window_s=0.0)
    whole, split = (Configuration(precision="fp32", checkpointing="off", micro_batches=batches)
                    for batches in ((_MICRO_STEPS,), (1,) * _MICRO_STEPS))
    measured = compare_configurations(workload, CPUMemoryBackend(), [whole, split], seconds=_SECONDS,
                                      clock=clock())
    extra = {steps: statistics.median(found.window_seconds) - window_time(costs[size], bare, steps)["total"]
             for steps, size, found in ((1, _MICRO_STEPS, measured[0]), (_MICRO_STEPS, 1, measured[1]))}
    per_micro_step = max((extra[_MICRO_STEPS] - extra[1]) / (_MICRO_STEPS - 1), 0.0)
    return dataclasses.replace(
        speed, loop_micro_step_s=per_micro_step, loop_window_s=max(extra[1] - per_micro_step, 0.0),
        sources={**speed.sources, "loop": SOURCE})


def _trivial_workload() -> Workload:
    return Workload(model=_linear, make_batch=_batch, loss_fn=_loss, build_optimizer=_adamw,
                    source="autotune.tuning.loop_cost")


def _linear():
    return torch.nn.Linear(_WIDTH, _WIDTH)


def _batch(n: int):
    return torch.randn(n, _WIDTH)


def _loss(model, batch):
    return model(batch).square().mean()


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


__all__ = ["cpu_speed_with_loop", "with_loop_costs"]
