"""Writing a command's outputs: where it may write (checked before any work) and how (atomically).

Probing, planning and training take minutes to hours; a mistyped folder, a folder that takes no
files (``/proc``), an output that would replace the command's own input (the plan's model file
included) or another of its outputs (``--save X --metrics X``, ``--metrics CKPT/checkpoint.pt``)
must fail at once, not after the work, and never destroy anything.

Atomic file writes: a crash leaves the old file or the new one, never half of one.

What is already at the path is respected: a character device or a FIFO (``/dev/null``, a pipe)
is written through, never replaced by a regular file; a symlink is refused (replacing it would
silently cut the link, following it would silently replace another file); a regular file keeps its
permissions. Temporary files carry the writer's host and pid, so the ones a killed writer left
behind are recognised and removed by the next write.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from ..errors import OutputError


def check_outputs(outputs: dict, *, inputs: dict | None = None, create_folders=(),
                  folders: dict | None = None) -> None:
    """Raise ``OutputError`` unless every output of a command can be written without harm.

    ``outputs``: ``{option: path or None}``, the files the command writes (None: not asked for).
    ``inputs``: ``{name: path or None}``, the files it reads, the plan's model file included.
    ``create_folders``: the options whose missing folders the command creates.
    ``folders``: ``{option: (folder, owns)}``, folders the command writes into, where
    ``owns(name)`` says which names in the folder are its own (checkpoints, records, temporaries).

    Each output must be writable for real (its folder exists or can be made, and takes a file: a
    temporary one is made and removed), no symlink, folder or block device, none of the inputs,
    not another output (a character device such as ``/dev/null`` may be several), and none of the
    names a folder output keeps; no input may be one of those names either.
    """
    given = {option: Path(path) for option, path in outputs.items() if path is not None}
    sources = {name: Path(path) for name, path in (inputs or {}).items() if path is not None}
    for option, path in given.items():
        _check_writable(path, option=option, create_folder=option in create_folders)
        for name, source in sources.items():
            if _same_file(path, source):
                raise OutputError(f"{option} {path} is this command's own {name}; writing it would "
                                  f"replace the input. Choose another path")
    for option, (folder, owns) in (folders or {}).items():
        if folder is None:
            continue
        others = [(f"{o} {p}", p) for o, p in given.items() if o != option]
        others += [(f"the {name} {p}", p) for name, p in sources.items()]
        for what, path in others:
            if _kept_in(path, Path(folder), owns):
                raise OutputError(f"{what} is where {option} {folder} keeps its own {path.name}; "
                                  f"one would replace the other. Choose a path outside it or "
                                  f"another name")
    options = list(given)
    for i, option in enumerate(options):
        for other in options[i + 1:]:
            if _same_target(given[option], given[other]):
                raise OutputError(f"{option} {given[option]} and {other} {given[other]} are the same "
                                  f"file; one would replace the other. Give them different paths")


def _check_writable(path: Path, *, option: str, create_folder: bool) -> None:
    try:
        refuse_unsafe_target(path)
    except OutputError as exc:
        raise OutputError(f"{option} {exc}") from None
    folder = _nearest_existing(path.parent) if create_folder else path.parent
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{option} {path}: {folder} is a file, not a folder; choose another path")
    if not folder.is_dir():
        raise OutputError(f"{option} {path}: the folder {path.parent} does not exist; create it "
                          f"first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: the folder {folder} is not writable; choose another path")
    if _written_through(path):
        return  # a character device or pipe is written as it is (opening a pipe would block)
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{option} {path} is not writable; choose another path")
    try:
        try_writing_beside(path, folder)
    except OSError as exc:
        raise OutputError(f"{option} {path}: the folder {folder} cannot take files "
                          f"({exc.strerror or exc}); choose another path") from None


def _written_through(path: Path) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _same_target(a: Path, b: Path) -> bool:
    """Two outputs that would land in one file: the same existing file (hard links too), or the
    same path once resolved. Character devices are written through, so sharing one is fine."""
    if a.exists() and b.exists():
        return _same_file(a, b) and not (stat.S_ISCHR(os.stat(a).st_mode))
    return os.path.realpath(a) == os.path.realpath(b)


def _kept_in(path: Path, folder: Path, owns: Callable[[str], bool]) -> bool:
    return os.path.realpath(path.parent) == os.path.realpath(folder) and owns(path.name)


def _nearest_existing(folder: Path) -> Path:
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


# -- atomic writes ------------------------------------------------------------------------------


def write_atomic(path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync it, then rename it over
    ``path`` (os.replace is atomic within one file system, hence the same directory)."""
    path = Path(path)
    existing = _existing(path)
    if existing is not None and (stat.S_ISCHR(existing.st_mode) or stat.S_ISFIFO(existing.st_mode)):
        try:
            with open(path, "wb") as handle:  # a device or pipe: what it does with the bytes is its job
                write(handle)
        except OSError as exc:
            raise OutputError(f"{path} could not be written ({exc.strerror or exc})") from None
        return path
    refuse_unsafe_target(path, existing)
    directory = path.parent
    _remove_stale_temporaries(path)
    try:
        fd, temporary = tempfile.mkstemp(prefix=f"{_temporary_prefix(path)}{_owner()}.", suffix=".tmp",
                                         dir=directory)
    except OSError as exc:
        raise OutputError(f"{path} cannot be written: {exc.strerror or exc} in {directory}") from None
    try:
        os.fchmod(fd, stat.S_IMODE(existing.st_mode) if existing is not None else _default_mode())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:  # a full disk, a quota, a vanished folder: one line, not a chain
        Path(temporary).unlink(missing_ok=True)
        raise OutputError(f"{path} could not be written ({exc.strerror or exc}); what was there "
                          f"before is unchanged") from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(directory)
    return path


def try_writing_beside(path: Path, folder: Path | None = None) -> None:
    """Create and remove a temporary file where ``write_atomic(path)`` would make its own (in
    ``folder``, default ``path``'s), so a folder that cannot take files (read-only, a procfs or
    sysfs, a quota) fails now, before the work, as root too (``os.access`` is always true for
    root). Nothing is left behind. Raises ``OSError``."""
    folder = path.parent if folder is None else folder
    fd, temporary = tempfile.mkstemp(prefix=f"{_temporary_prefix(path)}{_owner()}.", suffix=".tmp",
                                     dir=folder)
    os.close(fd)
    os.unlink(temporary)


def refuse_unsafe_target(path: Path, existing: os.stat_result | None = None) -> None:
    """Raise ``OutputError`` for a path that must not be replaced: a symlink, a folder, a block
    device or a socket (character devices and FIFOs are written through instead)."""
    if path.is_symlink():
        raise OutputError(
            f"{path} is a symlink to {os.readlink(path)}; autotune does not replace links or write "
            f"through them. Give the target's own path, or remove the link first")
    existing = existing if existing is not None else _existing(path)
    if existing is None or stat.S_ISREG(existing.st_mode):
        return
    if stat.S_ISDIR(existing.st_mode):
        raise OutputError(f"{path} is a folder; give a file path inside it")
    if not (stat.S_ISCHR(existing.st_mode) or stat.S_ISFIFO(existing.st_mode)):
        raise OutputError(f"{path} is a block device or socket; autotune will not write to it. "
                          f"Give a regular file path")


def _existing(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _default_mode() -> int:
    # What open() would have given a new file: 0666 less the umask (mkstemp's own is 0600).
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _owner() -> str:
    return f"{host_name()}-{os.getpid()}"


def host_name() -> str:
    """This machine's name as writers record it (dots replaced: it is part of file names)."""
    return socket.gethostname().replace(".", "_")


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of ``path`` whose writer (on this host) is no longer running."""
    prefix = _temporary_prefix(path)
    host = host_name()
    try:
        candidates = [p for p in path.parent.iterdir()
                      if p.name.startswith(prefix) and p.name.endswith(".tmp")]
    except OSError:
        return
    for candidate in candidates:
        owner = candidate.name[len(prefix):].split(".", 1)[0]
        name, _, pid = owner.rpartition("-")
        if name != host or not pid.isdigit() or process_alive(int(pid)):
            continue
        try:
            candidate.unlink()
        except OSError:
            pass


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


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
