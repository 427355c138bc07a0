"""Out of memory where the ranks cannot agree in-process: recorded, then recovered by a restart.

An OOM inside FSDP2's collectives (any forward or backward of a sharded model) or inside DDP's
gradient all-reduce (a window's last backward) leaves the other ranks waiting in a collective the
failed rank cannot join. That rank records the finer split (``recovery.SplitPolicy`` level) in
the checkpoint folder and exits; torchrun (``--max-restarts``) relaunches every rank, and they
resume from the last checkpoint with that split (see docs/sharded-training.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..files.outputs import host_name, write_atomic
from ..errors import option, flag
from .errors import OOMRestart, TrainError
from .recovery import SplitPolicy

RECORD_NAME = "oom-restart.json"
"""In the checkpoint folder: the split a run must use after an out-of-memory exit (see below)."""

_MAX_LEVEL = 30
_DEFAULT_RUN_ID = "none"
"""torchrun's run id when it is given no --rdzv-id: shared by unrelated runs."""


@dataclass(frozen=True)
class Restarts:
    """torchrun's restart budget, as its agent tells every worker in the environment."""

    count: int | None
    """This attempt's restart number (0: the first launch); None when not launched by torchrun."""
    maximum: int = 0
    run_id: str | None = None

    @classmethod
    def from_environment(cls) -> "Restarts":
        count, maximum = (_int_or_none(os.environ.get(name))
                          for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
        if count is None:
            return cls(count=None)
        return cls(count=count, maximum=maximum or 0, run_id=os.environ.get("TORCHELASTIC_RUN_ID"))

    @property
    def left(self) -> int:
        return 0 if self.count is None else max(0, self.maximum - self.count)

    def tag(self) -> dict | None:
        """What a file written by this attempt records (a checkpoint, the folder's lock), so a
        later attempt of the same torchrun run knows it (None: not launched by torchrun)."""
        if self.count is None:
            return None
        return {"run_id": self.run_id, "restart": self.count, "host": host_name(), "agent": os.getppid()}

    def later_attempt_of(self, tag) -> bool:
        """True when this process is torchrun's restart of the attempt that wrote ``tag``.

        torchrun without --rdzv-id gives every run the id "none": then the same agent process on
        the same host must have launched both attempts, or they are unrelated runs."""
        if not isinstance(tag, dict) or not self.count or self.run_id is None:
            return False
        count = tag.get("restart")
        if tag.get("run_id") != self.run_id or not isinstance(count, int) or not count < self.count:
            return False
        return self.run_id != _DEFAULT_RUN_ID or (tag.get("host"), tag.get("agent")) == (host_name(), os.getppid())


def _int_or_none(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def record_path(directory) -> Path:
    return Path(directory) / RECORD_NAME


def restart_after_oom(*, directory, rank: int, step: int, where: str, micro_batch: int, level: int,
                      finer: list[int], recoveries: int, from_step: int | None,
                      restarts: Restarts | None = None) -> TrainError:
    """Record the finer split (``level``) for the run in ``directory`` and return the error this
    rank exits with: ``OOMRestart`` when torchrun will restart the ranks, else a ``TrainError``
    naming what would make it recoverable."""
    restarts = Restarts.from_environment() if restarts is None else restarts
    what = (f"rank {rank} ran out of memory at step {step} with micro-batch {micro_batch} {where}; "
            f"the other ranks may already wait in a collective this rank cannot join, so the window "
            f"cannot be redone in-process")
    smaller = (f"micro-batch {max(finer)} ({len(finer)} accumulation steps; the effective batch and "
               f"the LR schedule are unchanged)")
    if directory is None:
        return TrainError(
            f"{what}. Recovering it needs a checkpoint folder: train with {option('checkpoint_dir')} D (and "
            f"{option('checkpoint_every')} K to redo at most K steps) under torchrun --max-restarts N, and the "
            f"ranks restart with {smaller}; or re-plan with autotune plan --micro-batch {max(finer)}")
    path = record_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"level": level, "recoveries": recoveries, "rank": rank, "step": step,
              "micro_batch": max(finer), "accumulation_steps": len(finer),
              "from_step": from_step, "run_id": restarts.run_id, "restart": restarts.count}
    write_atomic(path, lambda handle: handle.write(json.dumps(record, indent=2).encode()))
    start = (f"the checkpoint of step {from_step}" if from_step is not None
             else "step 0 (no checkpoint was written yet)")
    if restarts.left > 0:
        return OOMRestart(f"{what}. Recorded {smaller} in {path}; torchrun restarts every rank "
                          f"(restart {restarts.count + 1} of {restarts.maximum}) and they resume "
                          f"from {start} with it")
    if restarts.count is None:
        why = "this process was not launched by torchrun"
    elif restarts.maximum == 0:
        why = "torchrun was launched without --max-restarts"
    else:
        why = f"torchrun has no restart left (--max-restarts {restarts.maximum}, all used)"
    rerun = ("rerun the same command (it starts over with it)" if from_step is None
             else f"rerun with {flag('resume')} (it continues from {start} with it)")
    return TrainError(f"{what}. {smaller[0].upper()}{smaller[1:]} is recorded in {path}, but {why}: "
                      f"{rerun}, and launch with torchrun --max-restarts N (N >= 1) so the ranks "
                      f"restart by themselves next time")


def read_record(directory) -> dict | None:
    """The recorded split of the run in ``directory`` (None: there is none)."""
    if directory is None:
        return None
    path = record_path(directory)
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # a folder that cannot be is reported later
        return None
    except (OSError, ValueError) as exc:
        raise TrainError(f"{path} cannot be read ({exc}); delete it to train with the plan's "
                         f"micro-batches") from None
    level = record.get("level") if isinstance(record, dict) else None
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= _MAX_LEVEL:
        raise TrainError(f"{path} is not an autotune out-of-memory record (its level must be an "
                         f"integer from 0 to {_MAX_LEVEL}); delete it to train with the plan's "
                         f"micro-batches")
    return record


def new_record(directory, before: dict | None) -> dict | None:
    """A record written since ``before`` was read (by a rank that has just run out of memory)."""
    try:
        record = read_record(directory)
    except TrainError:
        return None
    return record if record is not None and record != before else None


def restarted_by_torchrun(record: dict | None, restarts: Restarts | None = None) -> bool:
    """True when this process is torchrun's restart after ``record`` was written in this run."""
    restarts = Restarts.from_environment() if restarts is None else restarts
    return (record is not None and bool(restarts.count) and restarts.run_id is not None
            and record.get("run_id") == restarts.run_id)


def apply_record(record: dict, split: SplitPolicy) -> bool:
    """Keep the recorded split from now on; False when ``split`` is already as fine."""
    if record["level"] <= split.level:
        return False
    split.level = record["level"]
    recoveries = record.get("recoveries")
    if isinstance(recoveries, int) and not isinstance(recoveries, bool):
        split.recoveries = max(split.recoveries, recoveries)
    split.since_kept = 0
    return True


def clear_record(directory, level: int) -> None:
    """Remove a record a checkpoint at split ``level`` now carries (never a finer, newer one)."""
    record = read_record(directory)
    if record is not None and record["level"] <= level:
        record_path(directory).unlink(missing_ok=True)


def remove_record(directory) -> None:
    """``--overwrite``: the run starts over with the plan's micro-batches."""
    if directory is not None:
        record_path(directory).unlink(missing_ok=True)
