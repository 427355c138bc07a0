"""Plan -> a job for the engines clusters run: SLURM (sbatch), Kubernetes (Kubeflow's PyTorchJob
and Trainer v2's TrainJob), Ray Train, and multi-node torchrun.

Every export launches autotune's own loop (``-m autotune train``) with the engine's own launcher
(srun, torchrun's c10d rendezvous, the Kubeflow operator, Ray Train's TorchTrainer); autotune
starts no process of its own. The world is nodes × processes per node and equals the plan's.
What only the user knows (partition, account, time limit, image, storage class, storage path)
is a ``FILL_IN_...`` word in the text, and the export's notes name each one, and nothing else.

Pure functions of the plan: ``export.py`` registers them in ``TARGETS``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..errors import ConfigError, given
from .types import Plan

PLACEHOLDER = "FILL_IN_"
CHECKPOINT_FILES = ("checkpoint.pt", "checkpoint.json")
"""What a --checkpoint-dir holds once a checkpoint is complete (a DDP run's file, a sharded run's
pointer): where one exists, the launch resumes (tests check these are the training loop's names)."""
CHECKPOINT_EVERY = 100
"""Optimizer steps between checkpoints in the cluster exports (SIGTERM checkpoints too)."""
RDZV_PORT = 29500
GPUS_PER_NODE = 8
"""The most GPUs one node is assumed to hold when --nproc-per-node is not given."""


def fill_in(what: str) -> str:
    return PLACEHOLDER + what


def placeholders(text: str) -> set[str]:
    """The FILL_IN_... words in an export's text."""
    return set(re.findall(rf"{PLACEHOLDER}\w+", text))


@dataclass(frozen=True)
class Layout:
    """The plan's world as nodes × processes per node."""

    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def _on_gpu(plan: Plan) -> bool:
    return plan.device is not None and plan.device.kind == "cuda"


def layout(plan: Plan, nproc_per_node: int | None = None) -> Layout:
    """``nproc_per_node`` processes on each of world / it nodes. Default: one process per GPU on
    nodes of up to 8 GPUs for a CUDA plan (the largest divisor of the world size up to 8), the
    whole world on one node for a CPU plan."""
    world = plan.world_size
    if nproc_per_node is None:
        limit = GPUS_PER_NODE if _on_gpu(plan) else world
        nproc_per_node = max(n for n in range(1, min(world, limit) + 1) if world % n == 0)
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ConfigError(f"{given('nproc_per_node', nproc_per_node)} must be a positive integer "
                          f"(processes, one per GPU, on each node)")
    if world % nproc_per_node:
        divisors = [n for n in range(1, world + 1) if world % n == 0]
        raise ConfigError(
            f"{given('nproc_per_node', nproc_per_node)} does not divide the plan's world size "
            f"{world} into whole nodes (nodes × processes per node = {world}); use one of "
            f"{', '.join(map(str, divisors))}, or re-plan with a world size that is a multiple of "
            f"{nproc_per_node} (--world-size)")
    # Tensor/context-parallel groups are runs of neighbouring ranks: each must fit on one node.
    inside = plan.parallel.tp * plan.parallel.cp
    if nproc_per_node % inside:
        raise ConfigError(f"the plan's {plan.parallel.describe_degrees()} puts {inside} ranks in each "
                          f"tensor/context-parallel group, which must stay on one node, and "
                          f"{given('nproc_per_node', nproc_per_node)} does not hold whole groups; "
                          f"use a multiple of {inside} processes per node")
    return Layout(nodes=world // nproc_per_node, per_node=nproc_per_node)


def train_arguments(plan: Plan, plan_path: str, checkpoint_dir: str | None,
                    model_file: str | None = None) -> tuple[list[str], list[str]]:
    """``autotune train``'s arguments for the plan (after ``-m autotune``), and the notes on what
    the user fills in there."""
    model = model_file or plan.workload.source
    args = ["train", model, "--plan", plan_path]
    notes = []
    if plan.workload.has_dataset is False:
        args += ["--steps", fill_in("steps")]
        notes.append(f"{fill_in('steps')}: the optimizer steps to train ({model} has no "
                     f"build_dataset(), so there are no epochs)")
    elif plan.workload.has_dataset is None:
        notes.append("add --steps N to the train command if the model file has no build_dataset() "
                     "(this plan does not say whether it has one)")
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(CHECKPOINT_EVERY)]
    return args, notes


def _resume_test(checkpoint_dir: str) -> str:
    """A POSIX shell test that is true when ``checkpoint_dir`` holds a complete checkpoint."""
    return " || ".join(f"[ -e {shlex.quote(str(PurePosixPath(checkpoint_dir) / name))} ]"
                       for name in CHECKPOINT_FILES)


def _describe(plan: Plan, shape: Layout) -> str:
    return (f"{plan.world_size} processes = {shape.nodes} node{'s' if shape.nodes > 1 else ''} × "
            f"{shape.per_node} per node; micro-batch {plan.split_text}, {plan.precision}, "
            f"effective batch {plan.effective_batch}")


# -- torchrun across nodes ------------------------------------------------------------------------
def torchrun_multinode(plan: Plan, shape: Layout, *, plan_path: str, model_file: str | None = None,
                       max_restarts: int = 3) -> tuple[list[str], list[str]]:
    """The command every node runs: torchrun's c10d rendezvous at the first node's address
    (``$HEAD_NODE``, which the user sets on each node) and the same ``$JOB_ID`` on every node."""
    args, notes = train_arguments(plan, plan_path, "autotune-checkpoints", model_file)
    command = ["torchrun", f"--nnodes={shape.nodes}", f"--nproc-per-node={shape.per_node}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=${HEAD_NODE:?set HEAD_NODE to the address of the first "
               "node}:" + str(RDZV_PORT), "--rdzv-id=${JOB_ID:-autotune}",
               f"--max-restarts={max_restarts}", "-m", "autotune", *args]
    return command, notes


# -- SLURM ----------------------------------------------------------------------------------------
SLURM_CHECKPOINT_DIR = "autotune-checkpoints"


def slurm_script(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
                 model_file: str | None = None) -> tuple[str, list[str]]:
    """An sbatch script: one ``srun`` task per node runs torchrun, whose c10d rendezvous is at the
    allocation's first node; the job resumes from its checkpoint folder when resubmitted."""
    shape = layout(plan, nproc_per_node)
    args, notes = train_arguments(plan, plan_path, SLURM_CHECKPOINT_DIR, model_file)
    directives = [
        "--job-name=autotune",
        f"--nodes={shape.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={shape.per_node}"] if _on_gpu(plan) else [f"--cpus-per-task={shape.per_node}"]),
        f"--time={fill_in('time')}",
        f"--partition={fill_in('partition')}",
        f"--account={fill_in('account')}",
        "--output=autotune-%j.out",
        "--signal=TERM@120",
    ]
    launch = ["srun", "--kill-on-bad-exit=1", "torchrun", f"--nnodes={shape.nodes}",
              f"--nproc-per-node={shape.per_node}", '--rdzv-id="$SLURM_JOB_ID"',
              "--rdzv-backend=c10d", '--rdzv-endpoint="$head_node:$port"', "--max-restarts=3",
              "-m", "autotune", *map(shlex.quote, args), "$resume"]
    lines = [
        "#!/bin/bash",
        f"# autotune plan {plan_path}: {_describe(plan, shape)}",
        *(f"#SBATCH {d}" for d in directives),
        "#",
        "# Submit with: sbatch THIS_FILE. One task per node runs torchrun, which starts "
        f"{shape.per_node} processes there;",
        "# the rendezvous is at the allocation's first node. Resubmitting resumes from the last "
        "checkpoint",
        f"# in {SLURM_CHECKPOINT_DIR}/ (written every {CHECKPOINT_EVERY} steps, and on the SIGTERM "
        "sent 120 s before the time limit).",
        "set -eu  # not pipefail: head closing the pipe early is no error",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        ': "${head_node:?scontrol show hostnames found no node in SLURM_JOB_NODELIST}"',
        "port=$((20000 + SLURM_JOB_ID % 20000))  # one rendezvous port per job, even on a shared node",
        "resume=",
        f"if {_resume_test(SLURM_CHECKPOINT_DIR)}; then resume=--resume; fi",
        " \\\n    ".join(_wrap(launch)),
    ]
    notes = [
        f"{fill_in('time')}: the job's time limit (sbatch --time, e.g. 24:00:00)",
        f"{fill_in('partition')}: the partition to run in (sinfo lists them)",
        f"{fill_in('account')}: the account to charge (sacctmgr show associations user=$USER), or "
        f"delete that line where the cluster needs none",
        *notes,
    ]
    return "\n".join(lines) + "\n", notes


def _wrap(words: list[str], width: int = 88) -> list[str]:
    """Words in lines of about ``width`` characters (continued with backslashes by the caller)."""
    lines, line = [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def submitit_script(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
                    model_file: str | None = None) -> tuple[str, list[str]]:
    """A Python launcher with submitit: one task per GPU under srun, each running autotune's loop,
    which reads its rank from SLURM's environment (no torchrun)."""
    shape = layout(plan, nproc_per_node)
    args, notes = train_arguments(plan, plan_path, SLURM_CHECKPOINT_DIR, model_file)
    gpus = f"gpus_per_node={shape.per_node}, " if _on_gpu(plan) else ""
    text = f'''"""Submit autotune plan {plan_path} to SLURM with submitit: {_describe(plan, shape)}.

Run: python THIS_FILE (pip install submitit). One SLURM task per process; autotune takes its rank
from SLURM's environment. Resubmitting resumes from the checkpoint in {SLURM_CHECKPOINT_DIR}/.
"""
import os

import submitit

ARGS = {args!r}
CHECKPOINT_FILES = {[str(PurePosixPath(SLURM_CHECKPOINT_DIR) / n) for n in CHECKPOINT_FILES]!r}


def train():
    from autotune.cli import main

    resume = ["--resume"] if any(os.path.exists(p) for p in CHECKPOINT_FILES) else []
    try:
        main(ARGS + resume)
    except SystemExit as done:  # the command line's exit: 0 is success here, not an error
        if done.code not in (0, None):
            raise


executor = submitit.AutoExecutor(folder="autotune-submitit")
executor.update_parameters(nodes={shape.nodes}, tasks_per_node={shape.per_node}, {gpus}cpus_per_task=1,
                           timeout_min={fill_in("timeout_min")},
                           slurm_partition="{fill_in("partition")}",
                           slurm_account="{fill_in("account")}", slurm_signal_delay_s=120)
job = executor.submit(train)
print(f"submitted job {{job.job_id}}; its output: autotune-submitit/")
'''
    notes = [
        f"{fill_in('timeout_min')}: the job's time limit in minutes",
        f"{fill_in('partition')}: the partition to run in (sinfo lists them)",
        f"{fill_in('account')}: the account to charge, or delete slurm_account where the cluster "
        f"needs none",
        *notes,
    ]
    return text, notes


# -- Kubernetes: Kubeflow PyTorchJob and TrainJob -----------------------------------------------
K8S_CHECKPOINT_DIR = "/checkpoints"
_VOLUME = "checkpoints"


def _k8s_name(plan: Plan) -> str:
    """An RFC 1035 label from the model file's name: "autotune-tiny-lm"."""
    stem = PurePosixPath(plan.workload.source.replace("\\", "/")).stem.lower()
    stem = re.sub(r"[^a-z0-9-]+", "-", stem).strip("-")
    return ("autotune-" + stem)[:52].rstrip("-") if stem else "autotune"


def _checkpoint_size(plan: Plan) -> str:
    """The checkpoint volume's size: two checkpoints (a sharded run keeps the last while writing
    the next) of the parameters and up to twice as much optimizer state, at least 1 GiB."""
    need = 2 * 4 * plan.workload.param_bytes
    return f"{max(1, -(-need // 2**30))}Gi"


def _container_command(plan: Plan, shape: Layout, plan_path: str, model_file: str | None) -> tuple[list[str], list[str]]:
    """The container's command: torchrun with the operator's node rank and master address (its
    PET_* environment), resuming where the checkpoint volume holds a checkpoint."""
    args, notes = train_arguments(plan, plan_path, K8S_CHECKPOINT_DIR, model_file)
    torchrun = ["torchrun", f"--nnodes={shape.nodes}", f"--nproc-per-node={shape.per_node}",
                "-m", "autotune", *args]
    script = (f"resume=; if {_resume_test(K8S_CHECKPOINT_DIR)}; then resume=--resume; fi; "
              f"exec {shlex.join(torchrun)} $resume")
    return ["/bin/sh", "-c", script], notes


def _resources(plan: Plan, shape: Layout) -> dict:
    if _on_gpu(plan):
        return {"limits": {"nvidia.com/gpu": shape.per_node}}
    return {"requests": {"cpu": str(shape.per_node)}}


def _volume_claim(plan: Plan, name: str, shape: Layout) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            # Every node mounts it (rank 0 writes, every rank reads on --resume).
            "accessModes": ["ReadWriteMany" if shape.nodes > 1 else "ReadWriteOnce"],
            "storageClassName": fill_in("storage_class"),
            "resources": {"requests": {"storage": _checkpoint_size(plan)}},
        },
    }


def _k8s_notes(shape: Layout, image_note: str, extra: list[str]) -> list[str]:
    access = "ReadWriteMany (every node mounts it)" if shape.nodes > 1 else "ReadWriteOnce"
    return [image_note,
            f"{fill_in('storage_class')}: a storage class for the checkpoint volume with access "
            f"mode {access} (kubectl get storageclass)", *extra]


def _image_note(plan: Plan, plan_path: str, model_file: str | None) -> str:
    model = model_file or plan.workload.source
    return (f"{fill_in('image')}: a container image with autotune installed and {model} and "
            f"{plan_path} at those paths (relative to its working directory)")


def pytorchjob(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
               model_file: str | None = None) -> tuple[list[dict], list[str]]:
    """A PersistentVolumeClaim and a Kubeflow PyTorchJob (kubeflow.org/v1): one Master and
    nodes - 1 Worker pods, each running torchrun with nprocPerNode processes."""
    shape = layout(plan, nproc_per_node)
    name = _k8s_name(plan)
    command, notes = _container_command(plan, shape, plan_path, model_file)
    pod = {"spec": {
        "containers": [{
            "name": "pytorch",  # the name the operator looks for
            "image": fill_in("image"),
            "command": command,
            "resources": _resources(plan, shape),
            "volumeMounts": [{"name": _VOLUME, "mountPath": K8S_CHECKPOINT_DIR}],
        }],
        "volumes": [{"name": _VOLUME, "persistentVolumeClaim": {"claimName": f"{name}-checkpoints"}}],
    }}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if shape.nodes > 1:
        replicas["Worker"] = {"replicas": shape.nodes - 1, "restartPolicy": "OnFailure", "template": pod}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "nprocPerNode": str(shape.per_node),
            "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": replicas,
        },
    }
    docs = [_volume_claim(plan, f"{name}-checkpoints", shape), job]
    return docs, _k8s_notes(shape, _image_note(plan, plan_path, model_file), notes)


def trainjob(plan: Plan, *, plan_path: str = "plan.json", nproc_per_node: int | None = None,
             model_file: str | None = None) -> tuple[list[dict], list[str]]:
    """A PersistentVolumeClaim and a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1)
    on the ``torch-distributed`` runtime, the volume added by a runtime patch."""
    shape = layout(plan, nproc_per_node)
    name = _k8s_name(plan)
    command, notes = _container_command(plan, shape, plan_path, model_file)
    pod_patch = {"spec": {
        "volumes": [{"name": _VOLUME, "persistentVolumeClaim": {"claimName": f"{name}-checkpoints"}}],
        "containers": [{"name": "node",  # the torch-distributed runtime's trainer container
                        "volumeMounts": [{"name": _VOLUME, "mountPath": K8S_CHECKPOINT_DIR}]}],
    }}
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {
                "image": fill_in("image"),
                "command": command,
                "numNodes": shape.nodes,
                "numProcPerNode": shape.per_node,
                "resourcesPerNode": _resources(plan, shape),
            },
            "runtimePatches": [{
                "manager": "autotune",
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                    {"name": "node", "template": {"spec": {"template": pod_patch}}}]}}},
            }],
        },
    }
    docs = [_volume_claim(plan, f"{name}-checkpoints", shape), job]
    return docs, _k8s_notes(shape, _image_note(plan, plan_path, model_file), notes)


def render_yaml(docs: list[dict], comments: list[str] = ()) -> str:
    """YAML documents (block style; every string double-quoted, as JSON writes it, so no value
    is read as another type), after ``comments``."""
    head = "".join(f"# {line}\n" for line in comments)
    return head + "".join("---\n" + "\n".join(_yaml(doc, 0)) + "\n" for doc in docs)


def _yaml(value, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:")
                lines += _yaml(item, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return lines
    lines = []
    for item in value:
        if isinstance(item, (dict, list)) and item:
            inner = _yaml(item, indent + 2)
            lines.append(f"{pad}- {inner[0].lstrip()}")
            lines += inner[1:]
        else:
            lines.append(f"{pad}- {_scalar(item)}")
    return lines


def _scalar(value) -> str:
    if isinstance(value, (dict, list)):
        return "{}" if isinstance(value, dict) else "[]"
    return json.dumps(value)


# -- Ray Train ------------------------------------------------------------------------------------
def ray_script(plan: Plan, *, plan_path: str = "plan.json", model_file: str | None = None) -> tuple[str, list[str]]:
    """A Python driver: Ray Train's TorchTrainer (``autotune.integrations.ray.trainer``), its
    ScalingConfig from the plan, autotune's loop in every worker, Ray's checkpoints wired to it."""
    model = model_file or plan.workload.source
    steps = ""
    notes = []
    if plan.workload.has_dataset is False:
        steps = f", steps={fill_in('steps')}"
        notes.append(f"{fill_in('steps')}: the optimizer steps to train ({model} has no "
                     f"build_dataset(), so there are no epochs)")
    elif plan.workload.has_dataset is None:
        notes.append("add steps=N to trainer(...) if the model file has no build_dataset() (this "
                     "plan does not say whether it has one)")
    gpu = "one GPU" if _on_gpu(plan) else "one CPU"
    text = f'''"""Train autotune plan {plan_path} with Ray Train: {plan.world_size} workers ({gpu} each),
autotune's loop in each; Ray restarts failed workers from the last checkpoint.

Run on a Ray cluster: ray job submit --working-dir . -- python THIS_FILE
(or python THIS_FILE on one machine, which starts a local Ray).
"""
import ray

from autotune.integrations.ray import trainer

ray.init()
result = trainer({plan_path!r}, {model!r}, storage_path={fill_in("storage_path")!r},
                 checkpoint_every={CHECKPOINT_EVERY}{steps}).fit()
print(result.checkpoint)
'''
    notes = [f"{fill_in('storage_path')}: where Ray keeps the run's checkpoints, a path every node "
             f"reaches (a shared folder, or s3://bucket/prefix / gs://...)", *notes]
    return text, notes
