"""One run per checkpoint folder: a lock file held for the run.

Two runs writing one ``--checkpoint-dir`` would replace each other's checkpoints and both exit 0.
The run's main process (rank 0 under torchrun) creates ``LOCK_NAME`` there with ``O_EXCL`` and
removes it when the run ends; a second run meets it and is refused with the first one's pid, host,
start time and command. A lock is stale, and taken over, when its process is gone: on this host
when that pid runs no longer (or runs another program: the process's start time is recorded), and
for torchrun's restart of the same run (``TORCHELASTIC_RUN_ID``, a higher restart count), whose
previous attempt torchrun has stopped. A lock left on another host by a crashed machine cannot be
checked from here; the message says to delete it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..files.outputs import host_name, process_alive
from ..errors import OutputError, option
from .errors import TrainError
from .restart import Restarts

LOCK_NAME = "autotune.lock"
_UNWRITTEN_GRACE_S = 10.0
"""A lock file still empty (or half-written) this long after its creation was left by a crash."""


@dataclass
class CheckpointLock:
    path: Path
    record: dict

    def release(self) -> None:
        """Remove the lock if it is still this run's (a later run may have taken a stale one)."""
        if _read(self.path) == self.record:
            self.path.unlink(missing_ok=True)


def lock_path(directory) -> Path:
    return Path(directory) / LOCK_NAME


def check_free(directory, restarts: Restarts | None = None) -> None:
    """Raise the refusal ``acquire`` would raise, without creating anything."""
    path = lock_path(directory)
    held = _read(path)
    if path.exists() and not _stale(path, held, restarts or Restarts.from_environment()):
        raise _in_use(directory, path, held)


def acquire(directory, restarts: Restarts | None = None) -> CheckpointLock:
    """Take the lock of ``directory`` for this process (created if missing), or raise
    ``TrainError`` naming the run that holds it."""
    restarts = restarts or Restarts.from_environment()
    directory, path = Path(directory), lock_path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{option('checkpoint_dir')} {directory} cannot be made ({exc.strerror or exc})") from None
    record = _own_record(restarts)
    data = json.dumps(record, indent=2).encode()
    for _ in range(3):  # another run may take a stale lock at the same moment: one of us wins
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = _read(path)
            if not _stale(path, held, restarts):
                raise _in_use(directory, path, held) from None
            if _read(path) == held:
                path.unlink(missing_ok=True)
            continue
        except OSError as exc:
            raise OutputError(f"{option('checkpoint_dir')}: {path} cannot be written ({exc.strerror or exc})") from None
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return CheckpointLock(path, record)
    raise _in_use(directory, path, _read(path))


def _own_record(restarts: Restarts) -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": host_name(), "process_start": _process_start(pid),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": _command(), **(restarts.tag() or {})}


def _command() -> str:
    """The command line, as the user typed it where that can be told (``python -m autotune``)."""
    words = list(sys.argv)
    if words and Path(words[0]).name == "__main__.py":
        words[0] = Path(words[0]).parent.name
    return " ".join(words)[:500]


def _stale(path: Path, held: dict | None, restarts: Restarts) -> bool:
    if held is None:  # being written right now, or left empty by a crash
        try:
            return time.time() - path.stat().st_mtime > _UNWRITTEN_GRACE_S
        except FileNotFoundError:
            return True
    if restarts.later_attempt_of(held):  # torchrun stops every worker of an attempt first
        return True
    if held.get("host") != host_name():
        return False
    pid = held.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid == os.getpid():
        return True  # not a lock a process holds, or one this process left (it is not running it)
    if not process_alive(pid):
        return True
    started = held.get("process_start")
    return started is not None and _process_start(pid) not in (None, started)  # pid reused


def _read(path: Path) -> dict | None:
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) else None


def _in_use(directory, path: Path, held: dict | None) -> TrainError:
    if held is None:
        who = "a run that is starting (the lock is not written yet)"
    else:
        who = (f"pid {held.get('pid')} on {held.get('host')}, started {held.get('started')}"
               + (f" ({held['command']})" if held.get("command") else ""))
    return TrainError(
        f"{option('checkpoint_dir')} {directory} is in use by another run: {who}. Two runs in one folder would "
        f"replace each other's checkpoints; wait for it to end or choose another {option('checkpoint_dir')} "
        f"(if that run is gone, e.g. its machine crashed, delete {path})")


def _process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, Linux); None elsewhere or when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of stat(5); the name before ")" may hold spaces
    except (OSError, IndexError, ValueError):
        return None
