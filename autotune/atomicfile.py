"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def write_atomic(path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync it, then rename it over
    ``path`` (os.replace is atomic within one file system, hence the same directory)."""
    path = Path(path)
    directory = path.parent
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(directory)
    return path


def fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory for this.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
