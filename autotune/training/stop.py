"""SIGINT/SIGTERM become a request to stop at the next optimizer-step boundary.

The handler only sets a flag (no work inside a signal handler); the loop checkpoints and returns.
A second signal gets the previous handler back, so pressing Ctrl-C twice still stops at once.

``hold_termination`` (the CLI, around a command and the printing of its error): once the loop has
stopped on an error, a SIGTERM waits until the error is printed. torchrun sends one to every rank
as soon as one rank fails, and a rank killed while it tears down would never say why it stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_hold: dict | None = None
"""Inside ``hold_termination``: {"previous": the SIGTERM handler to restore, "deferred": bool}."""


@contextlib.contextmanager
def hold_termination():
    """A SIGTERM that arrives after a training loop failed is delivered after this block, once
    the error is printed (the process ends by it then, as its sender expects)."""
    global _hold
    if threading.current_thread() is not threading.main_thread() or _hold is not None:
        yield
        return
    _hold = {"previous": signal.getsignal(signal.SIGTERM), "deferred": False}
    try:
        yield
    finally:
        hold, _hold = _hold, None
        signal.signal(signal.SIGTERM, hold["previous"])
        if hold["deferred"]:
            signal.raise_signal(signal.SIGTERM)


def _defer(signum, frame):
    if _hold is not None:
        _hold["deferred"] = True


class StopRequest:
    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        # Handlers can only be installed from the main thread; elsewhere a run is stopped by the
        # caller, not by signals.
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, exc, traceback):
        self._restore()
        if exc_type is not None and _hold is not None and self._installed:
            signal.signal(signal.SIGTERM, _defer)

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        self._restore()

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
