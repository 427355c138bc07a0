"""``--trial-timeout``: a trial that runs past it stops with a ``ProbeError`` naming it.

A model whose forward waits on something that never comes (a lock, a queue, a sleeping loop)
would hang a probe, a plan or a verify for ever. Inside ``trial_timeout(seconds)`` every trial
(``TrialSession.run``, real or on fake tensors) arms a timer; when it fires, SIGALRM on the main
thread interrupts the step wherever Python code runs (a blocking ``time.sleep`` or ``select``
included) and the trial ends with a ``ProbeError`` naming the micro-batch, the setting and the
limit. What the step holds is released as the error unwinds, like any failed trial's.

The interrupt is a ``BaseException``: the model's own ``except Exception`` cannot swallow it, and
the trial does not take it for out-of-memory. A step stuck inside one C call (a deadlocked
collective) is only interrupted when that call returns to Python.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import signal
import threading

from ..errors import ConfigError, ProbeError
from .result import setting_label

_LIMIT = contextvars.ContextVar("autotune_trial_timeout", default=None)


@contextlib.contextmanager
def trial_timeout(seconds: float | None):
    """Trials run inside this block stop after ``seconds`` each (None: no limit); the CLI's
    ``--trial-timeout``. Needs the main thread (the timer is SIGALRM)."""
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds) or seconds <= 0:
            raise ConfigError(f"--trial-timeout {seconds!r} must be a finite number of seconds "
                              f"more than 0, e.g. --trial-timeout 600")
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("--trial-timeout needs autotune on the main thread (its timer is "
                              "SIGALRM); call it from there, or without a timeout")
    token = _LIMIT.set(seconds)
    try:
        yield
    finally:
        _LIMIT.reset(token)


class _Expired(BaseException):
    """Raised into the step by the timer; never leaves ``deadline``."""


@contextlib.contextmanager
def deadline(session, micro_batch: int):
    """Around one trial of ``session`` (a TrialSession) at ``micro_batch``: a no-op unless inside
    ``trial_timeout``; past the limit, a ``ProbeError`` naming the trial."""
    seconds = _LIMIT.get()
    if seconds is None:
        yield
        return
    armed = True

    def expire(signum, frame):
        if armed:
            raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    expired = False
    try:
        yield
    except _Expired:
        expired = True
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if expired:  # outside the except block: the interrupted step's frames are let go
        raise ProbeError(
            f"{session.workload.source}: the trial at micro-batch {micro_batch} ({_setting(session)}) "
            f"ran past --trial-timeout {seconds:g} s and was stopped. The model's step may hang "
            f"(a forward waiting on something that never comes) or need longer: fix the model "
            f"file, or give a larger --trial-timeout")


def _setting(session) -> str:
    setting = setting_label(session.precision.value, session.checkpointing_label)
    return setting + (", sharded" if session.sharded else "")


__all__ = ["deadline", "trial_timeout"]
