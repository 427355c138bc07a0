"""The probe's own fake steps, counted as they run: ranking by throughput without a second pass.

A ``--gpu`` plan ranked by predicted throughput (``orchestration.predicted``) probes each setting
on fake tensors, as the memory rule does, and then needs the ops of one steady-state step at the
micro-batches of the setting's split. Where the probe already ran that very step (a trial of one
step: at the per-rank share of the target batch), the probe's session records it as it runs
(``RecordingSession``), and the ranking takes that record instead of building the fake model
again and counting the step a second time (``count.count_steps_costs``).

The recorder only watches (a dispatch mode that runs every op as it comes, and a module pre-hook
that counts calls): the trial's bytes, tensors and modelled reserved memory, are the estimate's
own. A record is the same as counting the step again with ``for_gpu`` (the same session class
on the same fake model, process group and optimizer state, the same single step; tested to be
equal, op by op, in tests/test_recorded_steps.py), and is kept only where that holds:

- the trial is one step (``window=1``): trials of accumulation windows start their measured
  micro-step with the gradients alive, not the single step counted; or a pipeline's window (its
  one step is a window of at least pp micro-steps, share / n of them at n): each pipeline rank's
  trial records its steady-state window (after the schedule's first, which builds its buffers;
  ``PipelineSessionMixin._window``), divided per micro-step (``count._per_micro_step``), and the
  step is the slowest rank's once every rank has fitted, as ``count.pipeline_rank_costs`` counts
  that window again (tests/test_recorded_steps.py), its once-a-window ops over the plan's own
  window where a count's window of pp spread them over pp. Recording costs the probe's windows
  about a fifth more: 8B's ``--pp 2 --optimize throughput`` (2026-12-05) no longer counts four
  windows (17 CPU s) and records its three trials (+14 CPU s): 99 against 104 CPU s in all;
- it ran to its end and fitted (an out-of-memory trial stops mid-step);
- its optimizer phase ran whole: the estimate steps only the distinct neighbour pairs of
  parameters on the per-parameter path (``EstimateSession._step_by_runs``), and, where no CUDA
  allocator is modelled, measures the phase once per session; a phase cut short is not kept.

A CUDA estimate of a model of identical blocks runs each trial on three small builds
(``probing.affine_blocks.SynthesizedTrialsSession``): each build's session records its step into a
store of its own (``for_small_build``), and a trial that fits keeps the three extended to the
whole model (``extend_small_builds``, ``timing.extend``: the whole model's step counted, op by op,
tests/test_recorded_steps.py). Where they do not extend, nothing is kept and the ranking counts
the step (``count.count_steps_costs``).
"""

from __future__ import annotations

import torch

from ..probing.estimate import EstimateSession, _distinct_neighbour_runs
from ..probing.pipeline_trial import PipelineSessionMixin
from .costs import StepCosts
from .count import _local_shards, _per_micro_step, _RecordsSteps, slowest_stage
from .extend import extend_step_costs


class RecordingSession(_RecordsSteps, EstimateSession):
    """The estimate's session; each one-step trial that runs whole is also counted into ``store``
    ({micro_batch: StepCosts})."""

    _into: dict[int, StepCosts] | None = None  # set by ``recording_session``'s subclass
    _ranks_into: dict[tuple, dict[int, StepCosts]] | None = None  # a pipeline's ranks', the same

    def __init__(self, *args, store: dict[int, StepCosts] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.store = store if store is not None else self._into

    @classmethod
    def records_trial(cls, window: int, micro_batches: list[int] | None) -> bool:
        """Whether a trial of ``window`` micro-steps (``micro_batches``: given exactly) is recorded
        when it fits: a one-step trial, or a pipeline's window; any other trial's answer is the
        estimate's own (``FreshTrialsSession``'s memo files it under ``plain_type``, where a
        layout screen's trial answers the probe's)."""
        return micro_batches is None and (window == 1 or issubclass(cls, PipelineSessionMixin))

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None):
        pipelined = isinstance(self, PipelineSessionMixin)
        if not self.records_trial(window, micro_batches):
            return super().run(n, window=window, micro_batches=micro_batches)
        trial, recorder = self._recorded(n, window=window)
        if trial.fits and recorder.optimizer_stepped and not recorder.optimizer_cut:
            if pipelined:
                self._pipeline_rank_recorded(n, len(self.window_micro_batches(n, window)), recorder)
            else:
                self.store[n] = self._costs(recorder, n)
        return trial

    def _pipeline_rank_recorded(self, n: int, steps: int, recorder) -> None:
        # A pipeline's trial runs on each pipeline rank in turn (each its own session, the rank of
        # its fake process group); its step is the slowest stage's once every rank has fitted.
        ranks = self._ranks_into.setdefault((n, steps), {})
        ranks[torch.distributed.get_rank()] = _per_micro_step(self._costs(recorder, n), steps)
        if len(ranks) == self.parallel.pp:
            self.store[n] = slowest_stage(list(ranks.values()))

    def _optimizer_phase(self) -> int:
        if self._recorder is None:
            return super()._optimizer_phase()
        self._recorder.optimizer = True
        try:
            return super()._optimizer_phase()  # the estimate's own: nothing it counts changes
        finally:
            self._recorder.optimizer = False

    def _optimizer_step(self):
        if self._recorder is not None and self.sharded:
            # As counting marks them: the real step runs these ops on the DTensors whose local
            # shards the estimate steps.
            self._recorder.mark_dtensors(_local_shards(self.optimizer))
        super()._optimizer_step()

    def _step_by_runs(self):
        if self._recorder is not None:
            self._recorder.optimizer_stepped = True
            if _distinct_neighbour_runs(self.optimizer) is not None:
                self._recorder.optimizer_cut = True  # stepped by runs: not every parameter
        super()._step_by_runs()

    @classmethod
    def for_small_build(cls) -> type:
        """A recording type like this one, recording into a store of its own: one small build's
        (``probing.affine_blocks.FewBlocksSession``); ``extend_small_builds`` extends theirs."""
        return recording_session({})

    @classmethod
    def extend_small_builds(cls, n: int, builds: list[type], *, units: int, repeats: int) -> None:
        """Into this type's store, the step at ``n`` of the whole model (``repeats`` units of
        blocks) from the steps the ``builds`` (``for_small_build`` types of ``units``, ``units +
        1`` and ``units + 2`` units) recorded: where each recorded it and the three extend
        (``timing.extend``); else nothing, and the ranking counts the step on the full build."""
        steps = [build._into.get(n) for build in builds]
        if all(step is not None for step in steps):
            extended = extend_step_costs(steps, units=units, repeats=repeats)
            if extended is not None:
                cls._into[n] = extended


def recording_session(store: dict[int, StepCosts]) -> type:
    """The session type for ``probe(session_type=...)`` that records into ``store``: a class (a
    pipeline's probe derives its pipelined session type from it)."""
    return type("RecordingSessionInto", (RecordingSession,), {"_into": store, "_ranks_into": {}})


__all__ = ["RecordingSession", "recording_session"]
