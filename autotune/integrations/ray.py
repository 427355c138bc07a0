"""A plan trained with Ray Train: a ``TorchTrainer`` whose ``ScalingConfig`` comes from the plan
and whose workers run autotune's own loop, Ray's checkpoints wired to autotune's.

    import ray
    from autotune.integrations.ray import trainer

    ray.init()
    result = trainer("plan.json", "model.py", storage_path="/shared/runs", checkpoint_every=100).fit()

Ray starts ``plan.world_size`` workers (one GPU each for a CUDA plan) and forms their process
group; each worker calls ``autotune.train`` with the plan, which joins it. Every checkpoint
autotune writes is reported to Ray (``ray.train.report``) from rank 0, so Ray keeps it in
``storage_path``; when a worker dies, Ray restarts the worker group (``max_failures`` times) and
each worker continues from the last reported checkpoint (``ray.train.get_checkpoint``) with
``resume``: the parameters are those of an uninterrupted run.

For a loop of your own under Ray, ``plan_settings(plan)`` gives the plan's micro-batches,
accumulation steps and learning rate, and ``scaling_config(plan)`` the workers.

Ray is imported only when these functions are called; ``import autotune`` never imports it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

from ..errors import ConfigError, given
from ..planning.planfile import plan_from_json, plan_to_json
from ..planning.types import Plan
from ..training.checks import kept_in_checkpoint_dir, load_plan
from ..training.checkpoint_lock import LOCK_NAME


def _ray():
    try:
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"autotune.integrations.ray needs Ray Train ({exc}); install it with "
                          f"pip install 'ray[train]'") from None
    import ray

    return ray


def _on_gpu(plan: Plan) -> bool:
    return plan.device is not None and plan.device.kind == "cuda"


def scaling_config(plan, **overrides):
    """``ray.train.ScalingConfig`` for the plan: ``plan.world_size`` workers, a GPU each for a
    CUDA plan; ``overrides`` (``resources_per_worker``, ``placement_strategy``, ...) on top. The
    number of workers is the plan's: another world is another plan."""
    plan = load_plan(plan)
    workers = overrides.pop("num_workers", plan.world_size)
    if workers != plan.world_size:
        raise ConfigError(f"{given('num_workers', workers)} differs from the plan's world size "
                          f"{plan.world_size}; drop num_workers, or re-plan with --world-size {workers}")
    ray = _ray()
    return ray.train.ScalingConfig(num_workers=workers, use_gpu=overrides.pop("use_gpu", _on_gpu(plan)),
                                   **overrides)


def plan_settings(plan) -> dict:
    """What a loop of your own takes from the plan: per-rank micro-batches, accumulation steps,
    world size, effective batch, learning rate and warmup."""
    plan = load_plan(plan)
    return {"micro_batches": list(plan.micro_batches), "accumulation_steps": plan.accumulation_steps,
            "world_size": plan.world_size, "effective_batch": plan.effective_batch,
            "lr": plan.lr.lr, "warmup_steps": plan.lr.warmup_steps, "precision": plan.precision}


def trainer(plan, model_file, *, storage_path=None, name: str | None = None, max_failures: int = 3,
            steps: int | None = None, epochs: int | None = None, checkpoint_every: int | None = None,
            seed: int = 0, save_path=None, metrics_path=None, local_dir=None, scaling=None,
            train_options: dict | None = None, **run_config):
    """A ``ray.train.torch.TorchTrainer`` that trains ``plan`` (a Plan or a plan-file path) on
    ``model_file`` with autotune's loop in every worker.

    ``storage_path`` (and ``name``) is where Ray keeps the checkpoints, a path every node reaches;
    ``max_failures`` how often Ray restarts the workers from the last one. ``steps``, ``epochs``,
    ``checkpoint_every``, ``seed``, ``save_path``, ``metrics_path`` and ``train_options`` go to
    ``autotune.train``. Each node keeps its working checkpoint folder under ``local_dir``
    (default: the temporary folder). ``scaling`` overrides ``scaling_config``'s fields;
    ``run_config`` ``ray.train.RunConfig``'s.
    """
    plan = load_plan(plan)
    ray = _ray()
    model = Path(model_file)
    options = dict(train_options or {})
    options.update(steps=steps, epochs=epochs, checkpoint_every=checkpoint_every, seed=seed,
                   save_path=None if save_path is None else str(save_path),
                   metrics_path=None if metrics_path is None else str(metrics_path))
    config = {"plan": plan_to_json(plan), "model_file": str(model),
              "model_file_here": str(model.resolve()) if model.exists() else None,
              "local_dir": str(local_dir) if local_dir is not None else None, "train": options}
    backend = "nccl" if _on_gpu(plan) else "gloo"
    failure = ray.train.FailureConfig(max_failures=max_failures)
    run = ray.train.RunConfig(storage_path=None if storage_path is None else str(storage_path),
                              name=name, failure_config=failure, **run_config)
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(train_worker, train_loop_config=config, run_config=run,
                        scaling_config=scaling_config(plan, **(scaling or {})),
                        torch_config=TorchConfig(backend=backend))


def train_worker(config: dict) -> None:
    """The loop every Ray worker runs (``TorchTrainer(train_loop_per_worker=...)``)."""
    ray = _ray()
    import torch.distributed as dist

    from ..training import train

    plan = plan_from_json(config["plan"], source="the plan given to autotune.integrations.ray.trainer")
    here = config.get("model_file_here")
    model_file = here if here and Path(here).exists() else config["model_file"]
    context = ray.train.get_context()
    rank, local_rank = context.get_world_rank(), context.get_local_rank()
    folder = _attempt_folder(config.get("local_dir"), context, dist)
    restored = ray.train.get_checkpoint()
    resumed_from = None
    if restored is not None:
        with restored.as_directory() as saved:
            resumed_from = json.loads((Path(saved) / _REPORT).read_text())["step"]
            if local_rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
                _copy_checkpoint(Path(saved), folder)
    elif local_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()  # every node's folder holds the checkpoint before any rank reads it

    def report(step: int, directory) -> None:
        # resumed_from: the step this attempt of the run started after (None: the first attempt)
        metrics = {"step": step, "resumed_from": resumed_from}
        if rank != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="autotune-ray-report-") as staging:
            _copy_checkpoint(Path(directory), Path(staging))
            (Path(staging) / _REPORT).write_text(json.dumps({"step": step}))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staging))

    try:
        train(plan, model_file, checkpoint_dir=folder, resume=restored is not None,
              on_checkpoint=report, progress=rank == 0, **config["train"])
    finally:
        if dist.is_initialized():
            dist.barrier()
        if local_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


_REPORT = "autotune-ray.json"
"""In each checkpoint given to Ray: its step."""


def _attempt_folder(local_dir, context, dist) -> Path:
    """A fresh folder for this attempt of the run, the same path on every worker of a node."""
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    root = Path(local_dir) if local_dir else Path(tempfile.gettempdir()) / "autotune-ray"
    return root / f"{context.get_experiment_name()}-{token[0]}"


def _copy_checkpoint(source: Path, target: Path) -> None:
    """autotune's checkpoint (a DDP file, or a sharded run's pointer and step folder) from one
    folder to another; not the run's lock, nor unfinished temporaries."""
    for item in source.iterdir():
        if item.name == LOCK_NAME or item.name.startswith(".") or not kept_in_checkpoint_dir(item.name):
            continue
        if item.is_dir():
            shutil.copytree(item, target / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target / item.name)
