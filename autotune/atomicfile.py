"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import ConfigError


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
    _fsync_directory(directory)
    return path


def check_output_path(path, *, inputs=(), option: str = "-o") -> Path:
    """Refuse an output that would replace one of the command's own inputs, a symbolic link or
    something that is not a regular file (a device node, a pipe)."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(f"{option} {path} is a symbolic link; write to a regular file (autotune "
                          f"does not replace links or their targets)")
    if not path.exists():
        return path
    if not path.is_file():
        raise ConfigError(f"{option} {path} exists and is not a regular file; write to a file path")
    for source in inputs:
        if Path(source).exists() and os.path.samefile(source, path):
            raise ConfigError(f"{option} {path} is this command's input {source}; write the "
                              f"output to another file")
    return path


def _fsync_directory(directory: Path) -> None:
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
