"""Where a command writes, checked before it does any work: one check for every command.

Probing, planning and training take minutes to hours; a mistyped folder, a folder that takes no
files (``/proc``), an output that would replace the command's own input (the plan's model file
included) or another of its outputs (``--save X --metrics X``, ``--metrics CKPT/checkpoint.pt``)
must fail at once, not after the work, and never destroy anything.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from .atomicfile import refuse_unsafe_target, try_writing_beside
from .errors import OutputError


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
