"""SIGINT/SIGTERM become a request to stop at the next optimizer-step boundary.

The handler only sets a flag (no work inside a signal handler); the loop checkpoints and returns.
A second signal gets the previous handler back, so pressing Ctrl-C twice still stops at once.
"""

from __future__ import annotations

import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        # Handlers can only be installed from the main thread; elsewhere a run is stopped by the
        # caller, not by signals.
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info):
        self._restore()

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        self._restore()

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
