"""Trials of a CUDA estimate, each on a build and modelled allocator of its own.

A modelled caching allocator's reserved peak depends on every trial its session ran before
(where the segments that outlive a trial were cut): 8B at sequence 131072 under CP 8 read
47.48 GiB as its probe's third trial and 49.26 GiB as a run's first step, which has nothing
before it. So each trial of a CUDA estimate builds its session afresh, on a fresh backend
(``EstimateMemoryBackend.fresh``): its set-up costs 3-4 CPU s at 70B, where a reused session
left the plan's own trial to run again (29 CPU s at 70B, ``planner._measure_planned``).
"""

from __future__ import annotations

import contextlib
import dataclasses

from ..distributed.layout import Layout
from ..distributed.sharding.ranks import sharded_step
from ..distributed.sharding.settings import resolve_shard_group


class FreshTrialsSession:
    """A ``TrialSession`` stand-in whose every trial runs in a new ``session_type`` session of
    ``workload`` under ``layout`` (``sharded_step``'s arguments), on ``backend.fresh()``; its
    trials say so (``Trial.first_in_session``). Attributes are the latest session's, closed or
    not (as a plain session's are read after it ends, where a probe says why nothing fit); one is
    built where none was yet, and a session read before its first trial runs that trial."""

    compiled = False
    """Fake-tensor steps run eager (a compiled model's estimate runs apart, probing.isolated)."""
    graphs_compiled = 0

    def __init__(self, workload, backend, *, session_type, layout: dict, precision, checkpointing,
                 sharded: bool, offload: bool, reduce_every_micro_step: bool):
        self.workload, self.backend, self.layout = workload, backend, layout
        self.session_type = session_type
        self._session_args = dict(precision=precision, sharded=sharded, offload=offload,
                                  reduce_every_micro_step=reduce_every_micro_step)
        self._asked = checkpointing
        self._full = None
        self._last = None
        """The latest session made, open or closed (its set-up may have run out of memory)."""
        self._full_ran = False
        self._full_stack: contextlib.ExitStack | None = None

    def __enter__(self):
        self._close_full()
        return self

    def __exit__(self, *exc_info):
        self._close_full()

    def _close_full(self) -> None:
        stack, self._full_stack, self._full, self._full_ran = self._full_stack, None, None, False
        if stack is not None:
            stack.close()

    def _full_session(self):
        if self._full is None:
            self._full_stack = contextlib.ExitStack()
            try:
                step_workload = self._full_stack.enter_context(sharded_step(self.workload, **self.layout))
                session = self._last = self.session_type(
                    step_workload, self.backend.fresh(), checkpointing=self._asked,
                    parallel=self.layout.get("parallel"), **self._session_args)
                self._full_stack.enter_context(session)
            except BaseException:
                self._close_full()
                raise
            self._full = session
        return self._full

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._full is None and self._last is not None:
            return getattr(self._last, name)
        return getattr(self._full_session(), name)

    def set_checkpointing(self, checkpointing) -> int:
        self._asked = checkpointing
        if self._full is not None and not self._full_ran:
            return self._full.set_checkpointing(checkpointing)
        self._close_full()  # the next trial builds afresh, with this setting
        return self._full_session().checkpointed_blocks

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None):
        memo = self.backend.trials_memo
        key = self._memo_key(n, window, micro_batches) if memo is not None else None
        if memo is not None and self._answers(memo.get(key)):
            # The same step on a fresh build: the same answer, to the byte.
            return dataclasses.replace(memo[key])
        trial = self._fresh_trial(n, window, micro_batches)
        trial.first_in_session = True
        if memo is not None:
            memo[key] = dataclasses.replace(trial)
        return trial

    def knows(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> bool:
        """Whether ``run`` answers this trial from the memo, without running it."""
        memo = self.backend.trials_memo
        return memo is not None and self._answers(memo.get(self._memo_key(n, window, micro_batches)))

    def _answers(self, trial) -> bool:
        """Whether a remembered trial answers now: one ruled out past a limit (``Trial.past_limit``)
        only while the backend plans within that limit or less."""
        if trial is None:
            return False
        limit = getattr(self.backend, "limit_bytes", None)
        return trial.past_limit is None or (limit is not None and limit <= trial.past_limit)

    def _fresh_trial(self, n: int, window: int, micro_batches):
        """One trial on a session of its own: the full build's."""
        if self._full_ran:
            self._close_full()
        session = self._full_session()
        self._full_ran = True
        # The fresh build's backend plans within what this one does (a trial may stop past it).
        limited = getattr(session.backend, "limited", None)
        with limited(getattr(self.backend, "limit_bytes", None)) if limited else contextlib.nullcontext():
            return session.run(n, window=window, micro_batches=micro_batches)

    def _memo_key(self, n: int, window: int, micro_batches) -> tuple:
        """What a fresh trial's answer depends on besides the workload (the memo is one
        planner's, of one workload): the session type, the layout (its shard group resolved, as
        the planner's probe names it and a layout screen leaves it to default), the session's
        settings, the checkpointing asked for and the micro-steps."""
        layout = dict(self.layout)
        sharding, parallel = layout.get("sharding"), layout.get("parallel")
        if parallel is not None and parallel.trivial:
            layout["parallel"] = parallel = None
        if getattr(sharding, "sharded", False):
            ranks = (parallel or Layout()).data_parallel(layout["world_size"])
            layout["shard_group"] = resolve_shard_group(layout.get("shard_group"), ranks)
        # A session type that records this trial as it runs (timing.recorded) keeps its own
        # answers: another's recorded nothing into its store. One that would not record it
        # shares the estimate's (a layout screen's trial of a window answers the probe's).
        kind = self.session_type
        records = getattr(kind, "records_trial", None)
        if records is not None and not records(window, micro_batches):
            kind = kind.plain_type
        return (kind, tuple(sorted((k, str(v)) for k, v in layout.items())),
                tuple(sorted((k, str(v)) for k, v in self._session_args.items())),
                str(self._asked), n, window, tuple(micro_batches) if micro_batches else None)


def remembered_trials(memo: dict, *, checkpointing: str) -> list:
    """The trials ``memo`` (a planner's ``trials_memo``: ``FreshTrialsSession._memo_key``'s keys, a
    tensor floor's under ``("tensor floor", key)``) holds of a step without model parallelism,
    ``checkpointing`` ("off", "on") asked."""
    found = []
    for key, trial in memo.items():
        if key[0] == "tensor floor":
            key = key[1]
        if key[3] == checkpointing and dict(key[1]).get("parallel") in (None, "None"):
            found.append(trial)
    return found


__all__ = ["FreshTrialsSession", "remembered_trials"]
