"""The probe's step for a pipelined plan, and its estimate per pipeline rank.

A pipelined window is one run of the schedule over the plan's accumulation steps (its
micro-batches), then the optimizer phase. A rank's memory depends on which stages it holds: under
1F1B stage s of p holds up to p − s micro-batches' activations at once, the first stage the most
(and the embedding); the last holds the head, the loss and its logits. ``estimate_pipeline_peaks``
runs the schedule of every pipeline rank in turn, each in this one process with a fake process
group in which it is that rank, and gives every rank's peak; the plan holds the worst.
"""

from __future__ import annotations

from ..distributed.pipeline import pipelined_step
from ..distributed.sharding.settings import Sharding
from ..memory.fake import EstimateMemoryBackend, checked_micro_batch, fake_tensor_limits, on_fake_tensors
from ..precision import Precision
from ..workload.checkpoint_count import CheckpointingRequest
from ..workload.contract import load_workload, move_batch
from ..errors import option
from .estimate import EstimateSession
from .trial import TrialSession


class PipelineSessionMixin:
    """``TrialSession`` for a model factory that builds a ``PipelinedModel``: a window runs the
    pipeline schedule over all of its micro-batches (every one at ``n``), then the optimizer.

    Set up as a sharded session (``sharded=True``): the full model the factory cuts is built
    outside the budget, and a warm-up window runs before measuring (the schedule builds its
    stages' buffers in its first step and keeps them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each rank measures its own stages (their peaks differ by design): no agreement.
        self.ranks_agree = False

    def window_micro_batches(self, n: int, window: int) -> list[int]:
        return [n] * max(window, 1)

    def _window_fields(self, sizes: list[int]) -> dict:
        return {}

    def _warm_up(self):
        pass  # a new schedule's first window is run before measuring (see _window)

    def _gradient_sync(self, enabled: bool) -> None:
        pass  # the schedule reduces a sharded stage's gradients on its last backward

    def _window(self, sizes: list[int]) -> tuple[int, int]:
        batches = [move_batch(self.workload.batch(n), self.device) for n in sizes]

        def weigh(loss, count, index):
            if count is not None:
                loss = loss / count
            return self.scaler.scale(loss)

        if self.model.prepare(batches):
            # A new schedule's first window builds what every later one reuses (receive buffers,
            # FSDP2's lazy set-up): run it first, then measure a steady-state window.
            self.model.run(batches, weigh)
            self.optimizer.zero_grad(set_to_none=True)
            self.backend.reset_peak()
        self.model.run(batches, weigh)
        activation_peak = self.backend.peak_bytes()
        self.backend.reset_peak()
        step_peak = self._optimizer_phase()  # the window's batches are still alive, as in training
        del batches
        return activation_peak, step_peak


class PipelineTrialSession(PipelineSessionMixin, TrialSession):
    """The pipelined step measured for real (under torchrun, one stage set per rank)."""


class PipelineEstimateSession(PipelineSessionMixin, EstimateSession):
    """The pipelined step on fake tensors."""


def estimate_pipeline_peaks(workload, micro_batches, *, pp: int, accumulation_steps: int,
                            world_size: int | None = None, stages_per_rank: int = 1, schedule="1f1b",
                            precision="fp32", checkpointing=False, sharding="ddp") -> dict[int, list[int]]:
    """{micro_batch: [peak of pipeline rank 0, 1, ...]}: one steady-state window of
    ``accumulation_steps`` micro-batches through the pipeline schedule, per pipeline rank (the
    first data-parallel rank of each; with FSDP2 over ``world_size // pp`` data-parallel ranks
    they all hold the same). Nothing the size of the model is allocated."""
    workload = load_workload(workload)
    sizes = [checked_micro_batch(n) for n in micro_batches]
    precision = Precision.parse(precision)
    sharding = Sharding.parse(sharding)
    checkpointing = CheckpointingRequest.parse(checkpointing, option=option("checkpointing"),
                                               allow_auto=False)
    peaks = {n: [] for n in sizes}
    for rank in range(pp):
        backend = EstimateMemoryBackend()
        with pipelined_step(on_fake_tensors(workload), pp=pp, world_size=world_size or pp,
                            stages_per_rank=stages_per_rank, schedule=schedule, sharding=sharding,
                            precision=precision, pp_rank=rank) as step_workload:
            with fake_tensor_limits(workload), PipelineEstimateSession(
                    step_workload, backend, precision=precision, checkpointing=checkpointing,
                    sharded=True) as session:
                for n in sizes:
                    peaks[n].append(session.run(n, window=accumulation_steps).peak_bytes)
    return peaks


__all__ = ["PipelineEstimateSession", "PipelineTrialSession", "estimate_pipeline_peaks"]
