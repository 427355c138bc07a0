"""Run under torchrun by test_tensor_parallel.py: tensor-parallel (and FSDP2 x TP) training of
bundled models on gloo.

    tp_train_script.py OUT STAGE TP MODEL_FILE [MODEL_FILE ...]

Stages:
- ``equal``: each model trains ``STEPS`` windows of ``EFFECTIVE`` samples in two micro-batches per
  data-parallel rank (exact accumulation), AdamW at lr 1e-3 clipped at 1.0; rank 0 writes
  OUT/STEM.pt (``save_path``) and OUT/STEM.json (the losses and gradient norms per step).
- ``reference``: the first model, checkpointed every step, ``RESUME_STEPS`` steps, saved to
  OUT/reference.pt.
- ``sigterm``: the same run, slowed down; rank 1 writes its pid to OUT/pid and touches
  OUT/started once training is under way, so the test can send it SIGTERM. OUT/plan.json is the
  plan, for ``autotune train --resume``.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from autotune.distributed.collectives import settle
from autotune.distributed.layout import Layout
from autotune.planning.planfile import save_plan
from autotune.training import train
from autotune.workload.contract import load_workload
from train_helpers import make_plan

EFFECTIVE = 8
STEPS = 3
RESUME_STEPS = 6


def tp_plan(world_size: int, tp: int, sha=None):
    """The plan: FSDP2 over world_size / tp data-parallel ranks, TP over tp (tp 1: one process)."""
    layout = Layout(tp=tp)
    share = EFFECTIVE // layout.data_parallel(world_size)
    plan = make_plan([share // 2, share - share // 2], world_size=world_size, lr=1e-3, clip=1.0, sha=sha)
    if tp == 1:
        return dataclasses.replace(plan, target_batch=EFFECTIVE)
    return dataclasses.replace(plan, target_batch=EFFECTIVE, sharding="fsdp", parallel=layout)


def run_equal(out, world, tp, files):
    for path in files:
        stem = Path(path).stem
        result = train(tp_plan(world, tp), load_workload(path), steps=STEPS, progress=False,
                       save_path=out / f"{stem}.pt")
        if result.rank == 0:
            (out / f"{stem}.json").write_text(json.dumps(
                {"loss": [m["loss"] for m in result.metrics],
                 "grad_norm": [m["grad_norm"] for m in result.metrics]}))


def run_reference(out, world, tp, files):
    workload = load_workload(files[0])
    train(tp_plan(world, tp, workload.file_sha256), workload, steps=RESUME_STEPS, progress=False,
          checkpoint_dir=out / "reference-ckpt", checkpoint_every=1, save_path=out / "reference.pt")


def run_sigterm(out, world, tp, files):
    workload = load_workload(files[0])
    plan = tp_plan(world, tp, workload.file_sha256)
    rank, loss_fn, calls = dist.get_rank(), workload.loss_fn, []

    def slow_loss(model, batch):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            (out / "pid").write_text(str(os.getpid()))
            (out / "started").touch()
        time.sleep(0.2)
        return loss_fn(model, batch)

    workload.loss_fn = slow_loss
    if rank == 0:
        save_plan(plan, out / "plan.json")
    result = train(plan, workload, steps=RESUME_STEPS * 20, progress=False, checkpoint_dir=out / "ckpt",
                   checkpoint_every=1)
    if rank == 0:
        (out / "report-sigterm.json").write_text(json.dumps(
            {"steps": result.steps, "interrupted": result.interrupted}))


if __name__ == "__main__":
    out, stage, tp, files = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    dist.init_process_group("gloo")
    {"equal": run_equal, "reference": run_reference, "sigterm": run_sigterm}[stage](
        out, dist.get_world_size(), tp, files)
    settle()  # gloo's workers let go of every tensor before this rank exits
    dist.destroy_process_group()
