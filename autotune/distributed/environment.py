"""Which launch this process is part of: the process group it runs in and the world size a plan is for."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError, given, option


def torchrun_group() -> bool:
    """Whether this process is one rank of a process group already set up (torchrun)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_world_size(world_size: int | None, distributed: bool) -> int:
    """The ranks a plan is for: torchrun's when launched by it (``world_size`` must agree), else
    ``world_size``, else the WORLD_SIZE environment variable, else 1."""
    if distributed:
        ranks = torch.distributed.get_world_size()
        if world_size is not None and world_size != ranks:
            raise ConfigError(f"{given('world_size', world_size)} differs from the {ranks} ranks "
                              f"torchrun started; omit {option('world_size')} or launch {world_size} processes")
        return ranks
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return 1
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={env!r} is not a positive int; "
                          f"unset it or pass {option('world_size')} N")
    return value


def real_ranks() -> int:
    """The ranks of a real process group (torchrun); 1 without one, or with the estimate's fake one."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        return 1
    return dist.get_world_size()


# -- the launch: torchrun's environment, or SLURM's where torchrun's is absent -------------------
@dataclass(frozen=True)
class Launch:
    """How this process was started: which launcher, the world and this process's place in it."""

    launcher: str
    """"torchrun" (its environment: WORLD_SIZE, RANK, ...; also Ray Train, Kubeflow and anything
    else that sets it), "slurm" (srun's task environment, where torchrun's is absent) or "none"."""
    world_size: int
    rank: int
    local_rank: int
    per_node: int
    """Processes on each node (torchrun's LOCAL_WORLD_SIZE, srun's tasks per node)."""
    nodes: int

    def describe(self) -> str:
        """ "4 processes (2 nodes × 2 per node, started by torchrun)"."""
        if self.launcher == "none":
            return f"{self.world_size} process (not started by torchrun or srun)"
        shape = (f"{self.nodes} nodes × {self.per_node} per node" if self.nodes > 1
                 else "1 node")
        return f"{self.world_size} process{'es' if self.world_size != 1 else ''} ({shape}, started by {self.launcher})"


_TORCHRUN = ("WORLD_SIZE", "RANK")
"""What torchrun (and every launcher that speaks its protocol) sets for each process."""


def launch_environment(environ=None) -> Launch:
    """The launch this process is part of, from the environment: torchrun's variables when set,
    else SLURM's task variables (an ``srun`` step: SLURM_STEP_NUM_TASKS, SLURM_PROCID; a batch
    script's own shell is not a task, so SLURM_NTASKS alone does not count), else one process."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        world = _positive(env, "WORLD_SIZE")
        per_node = _positive(env, "LOCAL_WORLD_SIZE", default=world)
        nodes = _positive(env, "GROUP_WORLD_SIZE", default=max(1, world // per_node))
        return Launch("torchrun", world, env_count(env, "RANK"), env_count(env, "LOCAL_RANK"), per_node, nodes)
    slurm = slurm_task(env)
    if slurm is not None:
        return slurm
    return Launch("none", 1, 0, 0, 1, 1)


def slurm_task(environ=None) -> Launch | None:
    """This ``srun`` task's place (None outside an srun step)."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return None
    world = _positive(env, "SLURM_STEP_NUM_TASKS")
    nodes = _positive(env, "SLURM_STEP_NUM_NODES", default=_positive(env, "SLURM_NNODES", default=1))
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")) or max(1, world // nodes)
    return Launch("slurm", world, env_count(env, "SLURM_PROCID"), env_count(env, "SLURM_LOCALID"), per_node, nodes)


def adopt_slurm(environ=None) -> Launch | None:
    """Under ``srun`` without torchrun: set torchrun's variables from SLURM's (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR: the step's first node,
    MASTER_PORT: 10000 + the job id mod 20000 unless set), so the process group forms from
    ``env://`` as under torchrun. Nothing changes where torchrun's are set or outside srun.
    Returns the SLURM launch it adopted."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN):
        return None
    task = slurm_task(env)
    if task is None or task.world_size < 2:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" not in env and not nodelist:
        raise ConfigError("srun started this task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, "
                          "so the first node (the rendezvous host) is unknown; set MASTER_ADDR to it, "
                          "or launch with srun torchrun (autotune export --to slurm)")
    job = env.get("SLURM_JOB_ID", "0")
    values = {"RANK": task.rank, "WORLD_SIZE": task.world_size, "LOCAL_RANK": task.local_rank,
              "LOCAL_WORLD_SIZE": task.per_node, "GROUP_WORLD_SIZE": task.nodes,
              "MASTER_ADDR": first_host(nodelist) if nodelist else None,
              "MASTER_PORT": 10000 + int(job) % 20000 if job.isdigit() else 29500}
    for name, value in values.items():
        if value is not None:
            env.setdefault(name, str(value))
    return task


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist ("gpu[07-09,12],cpu3" -> "gpu07"), as
    ``scontrol show hostnames LIST | head -n1`` prints it."""
    match = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None or not match.group(1):
        raise ConfigError(f"SLURM's node list {nodelist!r} names no host; set MASTER_ADDR to the "
                          f"first node's address")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _tasks_per_node(text: str | None) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE's first count ("2(x3),1" -> 2); None when absent or unreadable."""
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match and int(match.group(1)) > 0 else None


def env_count(env, name: str, default: int = 0) -> int:
    """The count in the environment variable ``name`` (``default`` when unset or empty)."""
    text = env.get(name)
    if text is None or text == "":
        return default
    if not text.strip().isdigit():
        raise ConfigError(f"the environment variable {name}={text!r} is not a count; unset it, or "
                          f"launch with torchrun or srun, which set it")
    return int(text)


def _positive(env, name: str, default: int | None = None) -> int:
    value = env_count(env, name, default=-1 if default is None else default)
    if value < 1:
        raise ConfigError(f"the environment variable {name}={env.get(name)!r} is not a positive "
                          f"count; unset it, or launch with torchrun or srun, which set it")
    return value
