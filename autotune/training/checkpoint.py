"""Checkpoints written atomically, and the random-number state they carry.

A checkpoint is written with ``autotune.atomicfile.write_atomic`` (temporary file in the same
folder, fsync, ``os.replace``, folder fsync): a crash at any point leaves either the old
checkpoint or the new one, never half a file.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..atomicfile import write_atomic
from .errors import TrainError

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def checkpoint_path(directory) -> Path:
    return Path(directory) / CHECKPOINT_NAME


def save_atomic(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda handle: torch.save(state, handle))


def load(path: Path) -> dict:
    if not path.is_file():
        raise TrainError(
            f"--resume: no checkpoint at {path}; train once with --checkpoint-dir {path.parent} "
            f"(or drop --resume to start from scratch)"
        )
    try:
        # weights_only=False: the file holds Python and NumPy RNG states. It is a file this loop
        # wrote itself; never resume from a checkpoint you did not make.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise TrainError(f"--resume: checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise TrainError(
            f"--resume: {path} is not an autotune training checkpoint of format {FORMAT_VERSION}"
        )
    return state


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return state
    state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
