"""Where a command writes, checked before it does any work.

Probing, planning and training take minutes to hours; a mistyped folder or an output that would
replace the command's own input must fail at once, not after the work (and never destroy the
input).
"""

from __future__ import annotations

import os
from pathlib import Path

from .atomicfile import refuse_unsafe_target
from .errors import OutputError


def check_output(path, *, option: str, inputs: dict | None = None, create_folder: bool = False) -> None:
    """Raise ``OutputError`` unless ``path`` can be written: its folder exists (or, with
    ``create_folder``, can be made) and is writable, it is no symlink, folder or block device, and
    it is none of ``inputs`` (``{"--plan": path, ...}``, the command's own input files)."""
    if path is None:
        return
    path = Path(path)
    try:
        refuse_unsafe_target(path)
    except OutputError as exc:
        raise OutputError(f"{option} {exc}") from None
    for name, source in (inputs or {}).items():
        if source is not None and _same_file(path, Path(source)):
            raise OutputError(f"{option} {path} is this command's own {name}; writing it would "
                              f"replace the input. Choose another path")
    folder = _nearest_existing(path.parent) if create_folder else path.parent
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{option} {path}: {folder} is a file, not a folder; choose another path")
    if not folder.is_dir():
        raise OutputError(f"{option} {path}: the folder {path.parent} does not exist; create it "
                          f"first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: the folder {folder} is not writable; choose another path")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _nearest_existing(folder: Path) -> Path:
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder
