"""Checkpoints of sharded (FSDP2) runs: every rank writes its own shard, none gathers the model.

Layout of a checkpoint folder::

    checkpoint.json          which step folder is the checkpoint (written atomically, last)
    step-00000007/           torch.distributed.checkpoint files: one per rank, plus .metadata
        train_state.pt       step, RNG of every rank, scheduler, scaler, ... (rank 0)

A save writes into ``.step-00000007.tmp/``; once every rank has written (DCP's save ends with
all ranks' results gathered by the coordinator), rank 0 renames it to ``step-00000007/`` and only
then points ``checkpoint.json`` at it. A crash at any point leaves ``checkpoint.json`` naming the
previous, complete folder; leftovers of an interrupted save are removed by the next save.

The folder is shared with whatever else the user keeps there: a step folder is autotune's only
when its name is exactly ``step-NNNNNNNN`` (or ``.step-NNNNNNNN.tmp``) and it holds the marker
file ``.autotune-checkpoint``, written into it before anything else. Nothing else is ever
removed or replaced; a folder of that exact name without the marker is refused before training.
Loading runs no code from the folder (``dcp_reader``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..files.outputs import fsync_directory, write_atomic
from ..errors import OutputError, option, flag
from .errors import TrainError

# torch.distributed.checkpoint (and with it DTensor and sympy) is imported by the functions that
# save and load: importing it costs every process about 1 CPU s (a plan on one device, each DDP
# rank, every CLI call), and only a sharded run's checkpoint uses it.

POINTER_NAME = "checkpoint.json"
STATE_NAME = "train_state.pt"
MARKER_NAME = ".autotune-checkpoint"
"""Inside every step folder autotune writes: what makes the folder autotune's to remove."""
FORMAT = "autotune-sharded-1"
_STEP_FOLDER = re.compile(r"\.?step-(\d{8})(\.tmp)?")


def pointer_path(directory) -> Path:
    return Path(directory) / POINTER_NAME


def _is_step_name(name: str) -> bool:
    match = _STEP_FOLDER.fullmatch(name)
    return match is not None and name.startswith(".") == (match.group(2) is not None)


def _is_ours(folder: Path) -> bool:
    """A step folder autotune wrote: its exact name and the marker inside (never a link)."""
    return (_is_step_name(folder.name) and not folder.is_symlink() and folder.is_dir()
            and (folder / MARKER_NAME).is_file())


def check_folder(directory) -> None:
    """Refuse, before any step, a folder named as autotune names its step folders but not
    written by it (no marker): a save of that step would have to replace it."""
    directory = Path(directory)
    current = _pointed_folder_name(directory)
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in sorted(entries):
        if _is_step_name(entry.name) and entry.name != current and not _is_ours(entry):
            raise OutputError(
                f"{option('checkpoint_dir')} {directory} holds {entry.name}, which is named as autotune names "
                f"its step folders but was not written by it (no {MARKER_NAME} inside); autotune "
                f"never replaces or removes what it did not write. Rename or move it, or choose "
                f"another {option('checkpoint_dir')}")


def save(directory, *, step: int, world_size: int, model, optimizer, train_state: dict,
         is_main: bool, run: dict | None = None) -> Path:
    """Write a checkpoint of ``model`` and ``optimizer`` (sharded) and ``train_state`` (rank 0's
    dict); every rank calls this. Returns the checkpoint's folder. ``run`` (the torchrun run that
    writes it) goes into the pointer, so that run's restarts know the checkpoint is theirs."""
    directory = Path(directory)
    name = f"step-{step:08d}"
    temporary, final = directory / f".{name}.tmp", directory / name
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for path in (temporary, final):
            if path.exists() or path.is_symlink():
                _refuse_unless_ours(path)
        shutil.rmtree(temporary, ignore_errors=True)  # an earlier save of this step that died
        temporary.mkdir()
        (temporary / MARKER_NAME).write_text("written by autotune; removed with its folder\n")
    _barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary)
    except CheckpointException as exc:  # a BaseException: it would slip past `except Exception`
        raise OutputError(f"{option('checkpoint_dir')}: the checkpoint of step {step} could not be written to "
                          f"{temporary} ({_failure_summary(exc)}); the previous checkpoint is kept") from None
    if is_main:
        write_atomic(temporary / STATE_NAME, lambda handle: torch.save(train_state, handle))
        if final.exists():  # this step was saved before (same state); keep the newer copy
            shutil.rmtree(final)
        os.replace(temporary, final)
        fsync_directory(directory)
        pointer = {"format": FORMAT, "folder": name, "step": step, "world_size": world_size,
                   **({"run": run} if run else {})}
        write_atomic(pointer_path(directory),
                     lambda handle: handle.write(json.dumps(pointer, indent=2).encode()))
        for stale in directory.iterdir():
            if stale.name != name and _is_ours(stale):
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def _options(model):
    """A pipeline's ranks hold different parameters, so the optimizer's parameter groups (one
    object per rank, which DCP would save once, from rank 0) are flattened into a key per
    parameter, as torchtitan saves pipelines."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from ..distributed.pipeline import PipelinedModel

    return StateDictOptions(flatten_optimizer_state_dict=isinstance(model, PipelinedModel))


def _refuse_unless_ours(path: Path) -> None:
    if not _is_ours(path):
        raise OutputError(f"{option('checkpoint_dir')}: {path} is in the way of the checkpoint of this step and was "
                          f"not written by autotune (no {MARKER_NAME} inside); it is left as it is. "
                          f"Move it and resume with {flag('resume')}")


def load(directory, *, world_size: int, model, optimizer) -> dict:
    """Load the checkpoint into ``model`` and ``optimizer`` (every rank); returns the train state.

    Nothing in the folder can run code: DCP's metadata is unpickled against an allow-list, the
    non-tensor values and the train state with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .dcp_reader import METADATA_NAME, SafeLoadPlanner, SafeReader, UnsafeCheckpoint, read_metadata

    folder = _checkpoint_folder(Path(directory), world_size)
    metadata = folder / METADATA_NAME
    try:  # first, alone: a refusal is one clear error, not DCP's fallbacks and logged traces
        read_metadata(metadata)
    except UnsafeCheckpoint as exc:
        raise _unsafe(metadata, exc) from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as exc:
        raise TrainError(f"{flag('resume')}: sharded checkpoint {folder} cannot be read: {metadata} is damaged "
                         f"({type(exc).__name__}: {exc}); start a new {option('checkpoint_dir')}") from None
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        unsafe = next((e for e in _failures(exc) if isinstance(e, UnsafeCheckpoint)), None)
        if unsafe is not None:
            raise _unsafe(folder, unsafe) from None
        raise TrainError(f"{flag('resume')}: sharded checkpoint {folder} cannot be read "
                         f"({_failure_summary(exc)}); it is damaged or was written for another "
                         f"model: start a new {option('checkpoint_dir')}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_options(model))
    # weights_only=True: the train state is tensors and plain types (RNG states included), so a
    # crafted file cannot run code when it is resumed.
    try:
        return torch.load(folder / STATE_NAME, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise TrainError(f"{flag('resume')}: {folder / STATE_NAME} holds objects other than tensors and plain "
                         f"Python types; it was not loaded, so none of its code ran. Start a new "
                         f"{option('checkpoint_dir')}") from None
    except Exception as exc:
        raise TrainError(f"{flag('resume')}: {folder / STATE_NAME} cannot be read ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}); start a new "
                         f"{option('checkpoint_dir')}") from None


def _unsafe(path: Path, exc) -> TrainError:
    return TrainError(f"{flag('resume')}: {path} holds objects other than the ones torch.distributed.checkpoint "
                      f"writes ({exc}); it was not loaded, so none of its code ran. Start a new "
                      f"{option('checkpoint_dir')}")


def _failures(exc: BaseException) -> list[BaseException]:
    """The exceptions of every rank inside a ``CheckpointException`` (else ``exc`` itself)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return [exc]
    found = []
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        found.append(inner if isinstance(inner, BaseException) else exc)
    return found or [exc]


def _failure_summary(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        ranks = ", ".join(f"rank {rank}: {_one_line(e)}" for rank, e in zip(exc.failures, _failures(exc)))
        return ranks or "CheckpointException"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    first = text[0] if len(text[0]) <= 160 else text[0].split(". ")[0][:160]  # torch's advice trimmed
    return f"{type(exc).__name__}: {first}"


def written_by(directory) -> dict | None:
    """The ``run`` a checkpoint's pointer records (None: none, or no readable pointer)."""
    run = _pointer_field(Path(directory), "run")
    return run if isinstance(run, dict) else None


def _pointed_folder_name(directory: Path) -> str | None:
    folder = _pointer_field(directory, "folder")
    return folder if isinstance(folder, str) else None


def _pointer_field(directory: Path, key: str):
    try:
        pointer = json.loads(pointer_path(directory).read_text())
    except (OSError, ValueError):
        return None
    return pointer.get(key) if isinstance(pointer, dict) else None


def _checkpoint_folder(directory: Path, world_size: int) -> Path:
    path = pointer_path(directory)
    if not path.is_file():
        raise TrainError(
            f"{flag('resume')}: no sharded checkpoint at {directory} (no {POINTER_NAME}); train once with "
            f"{option('checkpoint_dir')} {directory} (or drop {flag('resume')} to start from scratch)"
        )
    try:
        pointer = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainError(f"{flag('resume')}: {path} cannot be read ({exc})") from exc
    if not isinstance(pointer, dict) or pointer.get("format") != FORMAT:
        raise TrainError(f"{flag('resume')}: {path} is not an autotune sharded checkpoint ({FORMAT})")
    folder, saved_world = pointer.get("folder"), pointer.get("world_size")
    if not isinstance(folder, str) or not _is_step_name(folder) or folder.startswith("."):
        raise TrainError(f"{flag('resume')}: {path} names the folder {folder!r}, not a step-NNNNNNNN folder "
                         f"beside it; it is damaged or not autotune's. Start a new {option('checkpoint_dir')}")
    if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
        raise TrainError(f"{flag('resume')}: {path} holds world_size {saved_world!r}, not a positive integer; "
                         f"it is damaged. Start a new {option('checkpoint_dir')}")
    if saved_world != world_size:
        raise TrainError(
            f"{flag('resume')}: the checkpoint in {directory} was written by {saved_world} ranks "
            f"but this run has {world_size}; resume with torchrun --nproc_per_node "
            f"{saved_world}"
        )
    return directory / folder


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

