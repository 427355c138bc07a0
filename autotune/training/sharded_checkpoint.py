"""Checkpoints of sharded (FSDP2) runs: every rank writes its own shard, none gathers the model.

Layout of a checkpoint folder::

    checkpoint.json          which step folder is the checkpoint (written atomically, last)
    step-00000007/           torch.distributed.checkpoint files: one per rank, plus .metadata
        train_state.pt       step, RNG of every rank, scheduler, scaler, ... (rank 0)

A save writes into ``.step-00000007.tmp/``; once every rank has written (DCP's save ends with
all ranks' results gathered by the coordinator), rank 0 renames it to ``step-00000007/`` and only
then points ``checkpoint.json`` at it. A crash at any point leaves ``checkpoint.json`` naming the
previous, complete folder; leftovers of an interrupted save are removed by the next save.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..atomicfile import fsync_directory, write_atomic
from .errors import TrainError

POINTER_NAME = "checkpoint.json"
STATE_NAME = "train_state.pt"
FORMAT = "autotune-sharded-1"


def pointer_path(directory) -> Path:
    return Path(directory) / POINTER_NAME


def save(directory, *, step: int, world_size: int, model, optimizer, train_state: dict,
         is_main: bool) -> Path:
    """Write a checkpoint of ``model`` and ``optimizer`` (sharded) and ``train_state`` (rank 0's
    dict); every rank calls this. Returns the checkpoint's folder."""
    directory = Path(directory)
    name = f"step-{step:08d}"
    temporary, final = directory / f".{name}.tmp", directory / name
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)  # an earlier save of this step that died
    _barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary)
    if is_main:
        write_atomic(temporary / STATE_NAME, lambda handle: torch.save(train_state, handle))
        if final.exists():  # this step was saved before (same state); keep the newer copy
            shutil.rmtree(final)
        os.replace(temporary, final)
        fsync_directory(directory)
        pointer = {"format": FORMAT, "folder": name, "step": step, "world_size": world_size}
        write_atomic(pointer_path(directory),
                     lambda handle: handle.write(json.dumps(pointer, indent=2).encode()))
        for stale in directory.iterdir():
            if stale.is_dir() and stale.name != name and stale.name.lstrip(".").startswith("step-"):
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def exists(directory) -> bool:
    return pointer_path(directory).is_file()


def load(directory, *, world_size: int, model, optimizer) -> dict:
    """Load the checkpoint into ``model`` and ``optimizer`` (every rank); returns the train state."""
    folder = _checkpoint_folder(Path(directory), world_size)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=folder)
    except Exception as exc:
        raise TrainError(f"--resume: sharded checkpoint {folder} cannot be read "
                         f"({type(exc).__name__}: {exc})") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    # weights_only=True: the train state is tensors and plain types (RNG states included), so a
    # crafted file cannot run code when it is resumed.
    try:
        return torch.load(folder / STATE_NAME, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise TrainError(f"--resume: {folder / STATE_NAME} holds objects other than tensors and plain "
                         f"Python types; it was not loaded, so none of its code ran. Start a new "
                         f"--checkpoint-dir") from None


def _checkpoint_folder(directory: Path, world_size: int) -> Path:
    path = pointer_path(directory)
    if not path.is_file():
        raise TrainError(
            f"--resume: no sharded checkpoint at {directory} (no {POINTER_NAME}); train once with "
            f"--checkpoint-dir {directory} (or drop --resume to start from scratch)"
        )
    try:
        pointer = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainError(f"--resume: {path} cannot be read ({exc})") from exc
    if not isinstance(pointer, dict) or pointer.get("format") != FORMAT:
        raise TrainError(f"--resume: {path} is not an autotune sharded checkpoint ({FORMAT})")
    if pointer["world_size"] != world_size:
        raise TrainError(
            f"--resume: the checkpoint in {directory} was written by {pointer['world_size']} ranks "
            f"but this run has {world_size}; resume with torchrun --nproc_per_node "
            f"{pointer['world_size']}"
        )
    return directory / pointer["folder"]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

