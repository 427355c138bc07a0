"""Runtime out-of-memory recovery: how finely a window is split, and when to keep a finer split.

A window that runs out of memory is redone with every micro-batch cut in two (twice the
accumulation steps, same samples, same effective batch and LR). One recovery may be bad luck (a
long sequence, another process); after ``keep_after`` of them the finer split becomes the rule
for the rest of the run, and the loop says so.

Where the ranks cannot agree in-process, ``restart`` carries the finer split across a restart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SplitPolicy:
    keep_after: int = 2
    level: int = 0
    """Every planned micro-batch is cut into 2**level pieces for every window."""
    recoveries: int = 0
    """Out-of-memory recoveries so far (each redo of a window counts once)."""
    since_kept: int = 0

    def record_recovery(self, redo_level: int) -> bool:
        """Count one recovery; True when the split at ``redo_level`` is now kept for good."""
        self.recoveries += 1
        self.since_kept += 1
        if self.since_kept >= self.keep_after and redo_level > self.level:
            self.level = redo_level
            self.since_kept = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"level": self.level, "recoveries": self.recoveries, "since_kept": self.since_kept}

    def load_state_dict(self, state: dict) -> None:
        self.level = state["level"]
        self.recoveries = state["recoveries"]
        self.since_kept = state["since_kept"]
