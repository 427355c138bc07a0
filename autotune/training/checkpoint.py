"""Checkpoints written atomically, and the random-number state they carry.

A checkpoint is written with ``autotune.files.outputs.write_atomic`` (temporary file in the same
folder, fsync, ``os.replace``, folder fsync): a crash at any point leaves either the old
checkpoint or the new one, never half a file.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import torch

from ..files.outputs import write_atomic
from ..errors import OutputError, option, flag
from ..planning.planfile import plan_to_json
from .errors import TrainError

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 2
"""2: tensors and plain types only (loaded with ``weights_only=True``); 1 held pickled RNG
objects and is refused."""


def checkpoint_path(directory) -> Path:
    return Path(directory) / CHECKPOINT_NAME


def save_atomic(state: dict, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{path} cannot be written: its folder cannot be made ({exc.strerror or exc})") from None
    write_atomic(path, lambda handle: torch.save(state, handle))


def load(path: Path) -> dict:
    if not path.is_file():
        raise TrainError(
            f"{flag('resume')}: no checkpoint at {path}; train once with {option('checkpoint_dir')} {path.parent} "
            f"(or drop {flag('resume')} to start from scratch)"
        )
    try:
        # weights_only=True: a checkpoint is data. Unpickling arbitrary objects would run whatever
        # code a crafted file names; everything saved here is tensors and plain types.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise TrainError(
            f"{flag('resume')}: checkpoint {path} holds objects other than tensors and plain Python types "
            f"(an older autotune's format 1, another program's file, or a tampered one); it was not loaded, so "
            f"none of its code ran. Start a new {option('checkpoint_dir')}") from None
    except Exception as exc:
        raise TrainError(f"{flag('resume')}: checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise TrainError(
            f"{flag('resume')}: {path} is not an autotune training checkpoint of format {FORMAT_VERSION}"
        )
    return state


def written_by(path: Path) -> dict | None:
    """The torchrun attempt that wrote the checkpoint at ``path`` (``Restarts.tag``; None: none
    recorded, or no readable checkpoint, which ``load`` reports when it is resumed)."""
    try:  # mmap: the tensors are mapped, not read, to look at one small field
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
        return None
    run = state.get("run") if isinstance(state, dict) else None
    return run if isinstance(run, dict) else None


def check_train_state(saved: dict, *, path, rank: int) -> None:
    """Refuse a checkpoint whose counters or random state are not what autotune writes (a
    tampered or damaged file) before any of it is used, naming the field."""
    step, skipped = saved["step"], saved["skipped_steps"]
    for name, value in (("step", step), ("skipped_steps", skipped)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _damaged(path, name, f"{value!r}, not a non-negative integer")
    if skipped > step:
        raise _damaged(path, "skipped_steps", f"{skipped}, more than its step {step}")
    ranks = saved["rng"]
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise _damaged(path, "rng", "not one random state per rank")
    if rank < len(ranks):
        _check_rng(ranks[rank], path=path, rank=rank)


def _check_rng(state: dict, *, path, rank: int) -> None:
    """Apply ``state`` once (then put back the current one): what torch, random and numpy accept
    is the only complete check of their states."""
    current = rng_state()
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError, OverflowError) as exc:
        raise _damaged(path, "rng", f"rank {rank}'s random state, which is rejected ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        set_rng_state(current)


def _damaged(path, field: str, what: str) -> TrainError:
    return TrainError(f"{flag('resume')}: in checkpoint {path}, the field {field!r} is {what}; the checkpoint is "
                      f"damaged or was edited. Start a new {option('checkpoint_dir')} (or {flag('overwrite')})")


TRAIN_STATE_KEYS = ("scaler", "scheduler", "rng", "step", "skipped_steps", "split", "data", "plan")
"""What every checkpoint holds besides the weights (a sharded one keeps the weights in its shards)."""
REQUIRED_KEYS = ("model", "optimizer", *TRAIN_STATE_KEYS)

# What a resumed run must share with the run that wrote the checkpoint: (label, path in the plan).
_RESUME_FIELDS = (("the model file's sha256", ("workload", "file_sha256")),
                  ("the target batch", ("target_batch",)), ("the world size", ("world_size",)),
                  ("the micro-batches", ("micro_batches",)), ("the precision", ("precision",)),
                  ("activation checkpointing", ("checkpointing",)), ("the LR", ("lr", "lr")),
                  ("the LR rule", ("lr", "rule")), ("the warmup", ("lr", "warmup_steps")),
                  ("the gradient clipping", ("clip_grad_norm",)), ("the sharding", ("sharding",)))


def plan_record(plan, workload) -> dict:
    """The plan as a checkpoint records it: plain types, with the sha256 of the model file that
    was trained (a plan made from a module instance has none of its own)."""
    record = json.loads(plan_to_json(plan))
    if workload.file_sha256 is not None:
        record["workload"]["file_sha256"] = workload.file_sha256
    return record


def check_resumable(saved: dict, plan, workload, *, path: Path, required=REQUIRED_KEYS) -> None:
    """Refuse a checkpoint written under another plan or for another model file, naming what
    differs (resuming would silently train on with the old schedule, or fail on a shape)."""
    missing = [key for key in required if key not in saved]
    if missing:
        raise TrainError(f"{flag('resume')}: checkpoint {path} lacks {', '.join(missing)}; it is damaged or "
                         f"not an autotune training checkpoint. Start a new {option('checkpoint_dir')}")
    now = plan_record(plan, workload)
    for label, keys in _RESUME_FIELDS:
        was, is_now = _get(saved["plan"], keys), _get(now, keys)
        if was != is_now and not (keys == ("sharding",) and was is None):
            if keys[-1] == "file_sha256":
                was, is_now = str(was)[:12] + "…", str(is_now)[:12] + "…"
            raise TrainError(
                f"{flag('resume')}: {label} was {was} when checkpoint {path} was written and is {is_now} "
                f"now; resume with the plan and model file it was trained with, or start a new "
                f"{option('checkpoint_dir')} (or {flag('overwrite')}) to train under the new ones")


def _get(data, keys):
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def rng_state() -> dict:
    """The random-number states as tensors and plain types (what ``weights_only`` loads)."""
    version, words, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "words": list(words), "gauss": gauss}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = numpy.random.get_state()
    state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["words"]), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        numpy.random.set_state((saved["name"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))
