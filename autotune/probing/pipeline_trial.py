"""The probe's step for a pipelined plan, and its estimate per pipeline rank.

A pipelined window is one run of the schedule over the plan's accumulation steps (its
micro-batches), then the optimizer phase. A rank's memory depends on which stages it holds: under
1F1B stage s of p holds up to p − s micro-batches' activations at once, the first stage the most
(and the embedding); the last holds the head, the loss and its logits. The estimate
(``estimate_peaks(..., parallel=Layout(pp=...))``) runs the schedule of every pipeline rank in
turn, each in this one process with a fake process group in which it is that rank, and takes the
worst rank's peak, which the plan must fit; the probe's and planner's trials are the worst rank's
too (``WorstPipelineRankSession``).
"""

from __future__ import annotations

import contextlib
import dataclasses

from ..accumulation import WindowTotals, summed_loss
from ..errors import ConfigError, given, option
from ..workload.contract import move_batch


class PipelineSessionMixin:
    """``TrialSession`` for a model factory that builds a ``PipelinedModel``: a window runs the
    pipeline schedule over all of its micro-batches (every one at ``n``), then the optimizer.

    Set up as a sharded session (``sharded=True``): the full model the factory cuts is built
    outside the budget, and a warm-up window runs before measuring (the schedule builds its
    stages' buffers in its first step and keeps them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharded = True  # the full model the factory cuts is no rank's memory: see above
        # Each rank measures its own stages (their peaks differ by design): no agreement.
        self.ranks_agree = False

    def window_micro_batches(self, n: int, window: int) -> list[int]:
        # torch's schedules run at least as many micro-batches as pipeline ranks: a trial of a
        # single step is a window of that many.
        return [n] * max(window, self.parallel.pp if self.parallel is not None else 1)

    def _window_fields(self, sizes: list[int]) -> dict:
        # Every trial is a window (the schedule's micro-batches, gradients accumulating): the
        # plan's peak at a micro-batch below the share is this trial's, not the memory model's.
        # What the window holds between micro-batches is the schedule's, measured in its peak.
        return {"micro_steps": self.window_micro_batches(max(sizes), len(sizes)), "held_gradient_bytes": None}

    def _warm_up(self):
        pass  # a new schedule's first window is run before measuring (see _window)

    def _gradient_sync(self, enabled: bool) -> None:
        pass  # the schedule reduces a sharded stage's gradients on its last backward

    def _window(self, sizes: list[int]) -> tuple[int, int]:
        # A plan's window as another check names it ([first, second, last]) runs as the
        # pipeline runs it: every micro-batch of one shape, at least pp of them.
        sizes = self.window_micro_batches(max(sizes), len(sizes))
        self._window_base = self.backend.current_bytes()  # before the window: the search's rays start here
        batches = [move_batch(self.workload.batch(n), self.device) for n in sizes]
        totals = WindowTotals(self.device)  # the loop's, alive through its window

        def weigh(loss, count, index):
            # As the loop weighs each micro-batch (its summed loss into the window's totals, then
            # scaled): the values do not matter here, the tensors it keeps do.
            loss_sum, items = summed_loss(loss, count, 1)
            totals.add(loss_sum, items, counted=count is not None)
            return self.scaler.scale(loss_sum * 1.0)

        first_peak = 0
        if self.model.prepare(batches):
            # A new schedule's first window builds what every later one reuses (receive buffers,
            # FSDP2's lazy set-up), and peaks higher while it does: a run's first step is that
            # window, so the trial's peak is the larger of it and a steady-state window.
            self.model.run(batches, weigh, self.workload.loss)
            first_peak = self.backend.peak_bytes()
            self.optimizer.zero_grad(set_to_none=True)
            limit = getattr(self.backend, "limit_bytes", None)
            if limit is not None and first_peak > limit:
                # Its peak (a CUDA target's modelled reserved memory, else its tensors) passed
                # what the caller plans within (``limited``) already: the trial peaks at least
                # there and cannot fit, whatever the steady-state window adds; that window is not
                # run (8B's pp 2 screened without checkpointing at micro-batch 1: 72.08 GiB past
                # 70.84, a third of its CPU s).
                del batches, totals
                return first_peak, first_peak
            self.backend.reset_peak()
        # The steady-state window, the one a step count reads (``steady_state``): the schedule
        # built, the batches made as a run makes them before its first window.
        with self.steady_state(pipelined=True):
            self.model.run(batches, weigh, self.workload.loss)
            activation_peak = max(first_peak, self.backend.peak_bytes())
            self.backend.reset_peak()
            step_peak = self._optimizer_phase()  # the window's batches are still alive, as in training
        del batches, totals
        return activation_peak, step_peak


def check_pipeline_window(window: int, parallel) -> None:
    """torch's schedules run at least as many micro-batches per window as pipeline ranks."""
    if window < parallel.pp:
        raise ConfigError(f"a pipeline of {parallel.describe_degrees()} runs at least {parallel.pp} "
                          f"micro-batches per window, and {given('accumulation_steps', window)} asks "
                          f"for {window}; use {option('accumulation_steps')} {parallel.pp} or more")


_PIPELINED: dict[type, type] = {}


def pipelined_session_type(session_type: type) -> type:
    """``session_type`` (``TrialSession`` or a subclass) running pipelined windows."""
    if issubclass(session_type, PipelineSessionMixin):
        return session_type
    if session_type not in _PIPELINED:
        _PIPELINED[session_type] = type(f"Pipelined{session_type.__name__}",
                                        (PipelineSessionMixin, session_type), {})
    return _PIPELINED[session_type]


def pipeline_fake_ranks(parallel, world_size: int) -> list[int]:
    """The first rank of each pipeline rank's slice of the mesh (pp is its outermost dim): with
    FSDP2 over the data-parallel ranks, and tensor or context parallel within, the others of a
    slice hold as much."""
    return [pp_rank * (world_size // parallel.pp) for pp_rank in range(parallel.pp)]


def pipeline_rank_trials(make_session, sizes, *, window: int, parallel, world_size: int) -> dict[int, list]:
    """{n: [trial of pipeline rank 0, 1, ...]}: ``make_session(fake_rank)`` (a context manager
    giving an entered session) for each of ``pipeline_fake_ranks`` in turn."""
    trials = {n: [] for n in sizes}
    for fake_rank in pipeline_fake_ranks(parallel, world_size):
        with make_session(fake_rank) as session:
            for n in sizes:
                trials[n].append(session.run(n, window=window))
    return trials


def _passed_limit(trial, session) -> int | None:
    """The limit ``trial`` passed, of what its estimate plans within
    (``EstimateMemoryBackend.limit_bytes``: a budget less its headroom): the step cannot be
    planned, whatever the other ranks hold, and they need not run. None: within it, or no limit."""
    limit = getattr(getattr(session, "backend", None), "limit_bytes", None)
    return limit if limit is not None and trial.budgeted_peak_bytes > limit else None


def worst_trial(trials: list):
    """The trial a plan must fit among the pipeline ranks' trials of one step: one that does not
    fit, else the largest peak."""
    return max(trials, key=lambda trial: (not trial.fits, trial.peak_bytes))


class WorstPipelineRankSession:
    """A pipeline's probe session in one process: each trial runs on every pipeline rank (each
    its own session, on a fake process group in which it is that rank) and is the worst rank's
    (``worst_trial``): a plan's peak is its worst rank's, and it fits only where every rank fits.

    Only one rank's session is alive at a time (the fake process group is the process's one
    default group, and the backend counts one session's tensors). A trial that one rank does not
    fit stops there, as does one whose rank passes the limit its estimate plans within (not
    proved to fit then: ``Trial.past_limit``), so the ranks likeliest to run out go first
    (``_likeliest_first``): the one that did not fit or peaked highest in the session's last
    trial, then the last stage (the output head and loss: at sequence 131072 its logits pass the
    budget where the others fit), then the first (the most micro-batches in flight), then the
    middle ones. Otherwise the last rank a trial ran is kept set up and runs the next trial first,
    so that each trial sets up the other ranks only (pp − 1 set-ups).

    ``rank_session(fake_rank)``: a context manager giving that rank's session, not entered."""

    def __init__(self, rank_session, ranks: list[int]):
        self._rank_session = rank_session
        self._ranks = list(ranks)
        self._held = None  # (rank, ExitStack holding its entered session, session)
        self._last = None  # the last session set up: what the probe reads after its trials
        self._worst = None  # the rank of the last trial's worst_trial

    def __getattr__(self, name):
        # checkpointing, total_blocks, compiled, ...: every rank's session sets them up alike.
        if name.startswith("_") or self._last is None:
            raise AttributeError(name)
        return getattr(self._last, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._release()

    def _release(self):
        if self._held is not None:
            _, stack, _ = self._held
            self._held = None
            stack.close()

    def _session(self, rank: int):
        if self._held is not None and self._held[0] == rank:
            return self._held[2]
        self._release()
        with contextlib.ExitStack() as stack:
            session = stack.enter_context(self._rank_session(rank))
            self._last = session
            stack.enter_context(session)
            self._held = (rank, stack.pop_all(), session)
        return session

    def run(self, n: int, **kwargs):
        trials, limit = {}, None
        for rank in self._likeliest_first():
            session = self._session(rank)
            trials[rank] = session.run(n, **kwargs)
            if not trials[rank].fits:
                break
            limit = _passed_limit(trials[rank], session)
            if limit is not None:
                break
        worst = worst_trial(list(trials.values()))
        self._worst = next(rank for rank, trial in trials.items() if trial is worst)
        if limit is not None and len(trials) < len(self._ranks):
            # The ranks not run could hold more, even past the budget: not proved to fit.
            return dataclasses.replace(worst, fits=False, past_limit=limit)
        return worst

    def knows(self, n: int, **kwargs) -> bool:
        """Never (the ranks' sessions, one set up at a time, are not asked): see ``search_largest_fitting``'s
        ``known``."""
        return False

    def _likeliest_first(self) -> list[int]:
        # A rank's trial costs the same wherever it runs in the order; the held rank first only
        # saves its set-up, and that is worth less than a trial another rank would end.
        middle = self._ranks[1:-1]
        order = [self._ranks[-1], self._ranks[0], *middle]
        if self._held is not None:
            order.insert(0, self._held[0])
        if self._worst is not None:
            order.insert(0, self._worst)
        return list(dict.fromkeys(order))


def worst_pipeline_trials(make_session, sizes, *, window: int, parallel, world_size: int) -> dict:
    """{n: the trial of the pipeline rank with the largest peak}: what a plan must fit."""
    per_rank = pipeline_rank_trials(make_session, sizes, window=window, parallel=parallel,
                                    world_size=world_size)
    return {n: worst_trial(trials) for n, trials in per_rank.items()}


__all__ = ["PipelineSessionMixin", "WorstPipelineRankSession", "check_pipeline_window",
           "pipeline_fake_ranks", "pipeline_rank_trials", "pipelined_session_type", "worst_pipeline_trials",
           "worst_trial"]
