"""``predict_step_time``: the compute time of one training step, on this CPU or a GPU profile."""

from __future__ import annotations

from dataclasses import dataclass

from .count import count_steps_costs
from .costs import StepCosts
from .roofline import DeviceSpeed, speed_for_profile, window_time


@dataclass(frozen=True)
class StepTimePrediction:
    """One micro-batch's predicted compute: ``seconds`` in all, split as ``breakdown`` (see
    ``roofline.BREAKDOWN``), from the counted ``costs`` on ``device``."""

    micro_batch: int
    seconds: float
    breakdown: dict[str, float]
    costs: StepCosts
    device: str


def predict_step_time(workload, micro_batches, *, precision="fp32", checkpointing=False,
                      sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                      gpu=None, speed: DeviceSpeed | None = None,
                      parallel=None) -> dict[int, StepTimePrediction]:
    """Predicted compute time of one steady-state training step at each micro-batch (an int or
    several), counted on fake tensors (as ``estimate_peak``, same arguments) and timed by a
    roofline: on ``gpu`` (a profile name, path or ``GPUProfile``), on ``speed``, or else on this
    CPU (its speed measured once, then cached). The step is a window of one micro-step
    (``roofline.window_time``): with ``speed``'s loop costs where it has them ("loop" in the
    breakdown; ``tuning.loop_cost.cpu_speed_with_loop()`` measures this CPU's, as ``autotune
    estimate --time`` does). On a GPU the step is counted as that device runs it (optimizers left
    to choose on their foreach path). Communication is not included. ``parallel``: one rank's
    step under that model-parallel ``Layout`` (its DTensor ops on the rank's local shards; under
    a pipeline, the stage with the most work, per micro-batch, its bubble not included)."""
    if isinstance(micro_batches, int):
        micro_batches = [micro_batches]
    if speed is None:
        if gpu is not None:
            speed = speed_for_profile(gpu)
        else:
            from .cpu_profile import cpu_speed

            speed = cpu_speed()
    costs = count_steps_costs(workload, micro_batches, precision=precision,
                              checkpointing=checkpointing, sharding=sharding,
                              world_size=world_size, shard_group=shard_group,
                              for_gpu=speed.name if speed.cuda else None, parallel=parallel)
    predictions = {}
    for n, cost in costs.items():
        parts = window_time(cost, speed, 1, precision)
        predictions[n] = StepTimePrediction(micro_batch=n, seconds=parts.pop("total"), breakdown=parts,
                                            costs=cost, device=speed.name)
    return predictions


__all__ = ["StepTimePrediction", "predict_step_time"]
