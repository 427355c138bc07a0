"""Everything that can be wrong before training starts, reported before any step is taken."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..distributed.environment import Launch, launch_environment
from ..errors import ConfigError, OutputError, PlanFileError, WorkloadError, given, option, flag
from ..files.outputs import check_outputs as check_all_outputs
from ..planning.types import Plan
from ..planning.planfile import load_plan as read_plan_file
from ..precision import Precision, supports_bf16
from .checkpoint import CHECKPOINT_NAME, checkpoint_path
from .checkpoint_lock import LOCK_NAME
from .restart import RECORD_NAME
from .sharded_checkpoint import POINTER_NAME, pointer_path
from .errors import TrainError


def kept_in_checkpoint_dir(name: str) -> bool:
    """Whether autotune writes ``name`` in a --checkpoint-dir: its checkpoint, a sharded
    checkpoint's pointer and step folders, the out-of-memory record, the run's lock, and their
    temporaries (".checkpoint.pt.<host>-<pid>.….tmp", ".step-00000007.tmp")."""
    names = (CHECKPOINT_NAME, POINTER_NAME, RECORD_NAME, LOCK_NAME)
    own = "|".join([*(re.escape(n) for n in names), r"step-\d{8}"])
    return re.fullmatch(rf"(?:{own})|\.(?:{own})\..*tmp", name) is not None


def load_plan(plan) -> Plan:
    """A ``Plan`` object, or one read (and validated) from a plan file."""
    if isinstance(plan, Plan):
        return check_plan(plan, source="plan")
    if isinstance(plan, (str, Path)):
        return check_plan(read_plan_file(plan), source=f"--plan {plan}")
    raise PlanFileError(f"plan must be an autotune Plan or a path to a plan file, got {type(plan).__name__}")


def check_plan(plan, *, source: str) -> Plan:
    if not isinstance(plan, Plan):
        raise PlanFileError(f"{source}: expected an autotune Plan, got {type(plan).__name__}")
    sizes = plan.micro_batches
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise PlanFileError(f"{source}: micro_batches must be a non-empty list of positive integers, got {sizes!r}")
    if not isinstance(plan.world_size, int) or plan.world_size < 1:
        raise PlanFileError(f"{source}: world_size must be a positive integer, got {plan.world_size!r}")
    Precision.parse(plan.precision, option=f"{source}: precision")
    return plan


def check_world_size(plan: Plan, world_size: int, launch: Launch | None = None) -> None:
    """The plan's world size is the launched one (nodes × processes per node), or an error naming
    both and how to launch the plan's (before the first step)."""
    if plan.world_size == world_size:
        return
    launch = launch if launch is not None else launch_environment()
    started = (launch.describe() if launch.world_size == world_size
               else f"{world_size} process{'es' if world_size != 1 else ''}")
    per_node = launch.per_node if launch.world_size == world_size else world_size
    example = f"torchrun --nproc-per-node {plan.world_size} on one node"
    if 1 < per_node < plan.world_size and plan.world_size % per_node == 0:
        example += f", or --nnodes {plan.world_size // per_node} --nproc-per-node {per_node} on each of {plan.world_size // per_node}"
    raise TrainError(
        f"the plan is for world size {plan.world_size} but this run has {started}: launch "
        f"{plan.world_size} processes in all (nodes × processes per node), e.g. {example} "
        f"(autotune export --to torchrun, slurm, kubernetes or ray writes the launch), or re-plan "
        f"for this world with {given('world_size', world_size)}"
    )


def check_precision(precision: Precision, device) -> None:
    if precision is Precision.BF16 and not supports_bf16(device):
        raise TrainError(
            f"the plan asks for bf16 but {device} does not support it; re-plan with --precision fp16 "
            f"or --precision fp32"
        )


def total_steps(*, steps, epochs, windows_per_epoch, source: str) -> int:
    """Optimizer steps to train: ``steps``, or ``epochs`` × windows per epoch (one epoch by default)."""
    if steps is not None and epochs is not None:
        raise ConfigError(f"{option('steps')} and {option('epochs')} are exclusive; give one of them")
    for name, value in (("steps", steps), ("epochs", epochs)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{option(name)} must be a positive integer, got {value!r}")
    if windows_per_epoch is None:
        if epochs is not None:
            raise ConfigError(
                f"{given('epochs', epochs)}: {source} has no build_dataset(), so there are no epochs; "
                f"give {option('steps')} N (batches then come from make_batch)"
            )
        if steps is None:
            raise ConfigError(
                f"{source} has no build_dataset(): give {option('steps')} N (batches then come from "
                f"make_batch)"
            )
        return steps
    if steps is not None:
        return steps
    return (epochs or 1) * windows_per_epoch


def check_dataset_size(size: int, plan: Plan, *, source: str) -> None:
    if size < plan.effective_batch:
        raise WorkloadError(
            f"{source}: build_dataset() has {size} samples, fewer than one window of the plan's "
            f"effective batch {plan.effective_batch}; use a larger dataset or re-plan with "
            f"--target-batch {size} or less"
        )


def check_options(*, checkpoint_dir, checkpoint_every, resume, clip_grad_norm, num_workers,
                  seed: int = 0, overwrite: bool = False) -> None:
    if resume and overwrite:
        raise ConfigError(f"{flag('resume')} and {flag('overwrite')} contradict each other: "
                          f"{flag('resume')} continues the checkpoint in {option('checkpoint_dir')}, "
                          f"{flag('overwrite')} replaces it; give one of them")
    if checkpoint_every is not None:
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ConfigError(f"{option('checkpoint_every')} must be a positive integer, got "
                              f"{checkpoint_every!r}")
        if checkpoint_dir is None:
            raise ConfigError(f"{option('checkpoint_every')} needs {option('checkpoint_dir')} to write "
                              f"checkpoints into")
    if resume and checkpoint_dir is None:
        raise ConfigError(f"{flag('resume')} needs {option('checkpoint_dir')} (the folder holding "
                          f"checkpoint.pt)")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ConfigError(f"{option('clip_grad_norm')} must be positive, got {clip_grad_norm!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be a non-negative integer, got {num_workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"{given('seed', seed)} must be an integer from 0 to 2**63 - 1")


def check_outputs(*, checkpoint_dir, resume: bool, overwrite: bool, metrics_path, inputs: dict,
                  save_path=None) -> None:
    """Every place the run writes, checked before the first step (not after hours of training),
    against its inputs and each other: ``--metrics``, ``--save`` and what ``--checkpoint-dir``
    keeps."""
    path = None if checkpoint_dir is None else checkpoint_path(checkpoint_dir)
    check_all_outputs({"--metrics": metrics_path, "--save": save_path, "--checkpoint-dir": path},
                      inputs=inputs, create_folders={"--metrics", "--save", "--checkpoint-dir"},
                      folders={"--checkpoint-dir": (checkpoint_dir, kept_in_checkpoint_dir)})
    if checkpoint_dir is None:
        return
    # A sharded run's checkpoint is its pointer file (sharded_checkpoint.py), refused the same way.
    found = next((p for p in (path, pointer_path(checkpoint_dir)) if p.exists()), None)
    if found is not None and not resume and not overwrite:
        raise OutputError(
            f"{option('checkpoint_dir')} {checkpoint_dir} already holds a checkpoint ({found}); continue it "
            f"with {flag('resume')}, start over with {flag('overwrite')}, or choose another folder")
    if found == path and overwrite and not resume and not _is_autotune_checkpoint(path):
        # --overwrite starts autotune's checkpoint over; a file of that name that is not one is
        # the user's (a sharded run's files carry a marker and are refused alike).
        raise OutputError(
            f"{flag('overwrite')}: {path} is not an autotune checkpoint (no training state in it), "
            f"so it is left as it is; move it, or choose another {option('checkpoint_dir')}")


def _is_autotune_checkpoint(path) -> bool:
    """Whether ``path`` holds a checkpoint autotune wrote: a torch archive (read with
    ``weights_only``, memory-mapped: nothing executed, nothing copied) of a dict with a step."""
    import pickle
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError):
        return False
    return isinstance(state, dict) and "step" in state and "model" in state
