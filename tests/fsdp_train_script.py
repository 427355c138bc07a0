"""Run under torchrun by test_train_fsdp.py: FSDP2 training of tiny float64 workloads on gloo.

    fsdp_train_script.py OUT STAGE [STAGE ...]

Stages:
- ``equal``: the cases of ``cases(world_size)``; each writes its full state dict (``save_path``)
  to OUT/NAME.pt, and rank 0 writes OUT/report-equal.json (losses, grad norms, noise-scale
  averages and reduce-scatter counts of every rank).
- ``reference``: the checkpointed model-file run, uninterrupted, saved to OUT/reference.pt.
- ``sigterm``: the same run, slowed down; rank 1 writes its pid to OUT/pid and OUT/started once
  training is under way, so the test can send it SIGTERM (the stop reaches every rank).
- ``kill``: checkpoint every step; every rank writes its pid to OUT/kill-pid-RANK, and rank 1
  stalls in the middle of writing the third checkpoint (after touching OUT/writing) until the
  test kills every rank with SIGKILL.
"""

import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from autotune.distributed.collectives import settle
from autotune.training import train
from autotune.workload.contract import load_workload
from train_helpers import make_plan, mean_loss, mlp_workload, token_workload

OUT = Path(sys.argv[1]) if __name__ == "__main__" else None
STAGES = sys.argv[2:]
TESTS = Path(__file__).resolve().parent
EFFECTIVE = 24  # 60 samples: windows of 24, 24 and a partial 12
SAMPLES = 60
REAL_MODELS = {"gpt_varlen": TESTS.parent / "examples" / "gpt_varlen.py",
               "gpt_checkpointing": TESTS.parent / "examples" / "gpt_varlen.py"}
if importlib.util.find_spec("transformers") is not None:
    REAL_MODELS["hf_gpt2"] = TESTS / "hf_gpt2_model.py"
STEPS = 7  # the model-file run: 40 samples, windows of 8 (an epoch boundary at step 5)


def cases(world_size):
    """name -> (workload factory, plan); the same names for every world size."""
    per_rank = EFFECTIVE // world_size
    half = per_rank // 2
    even, uneven, tokens = [half, per_rank - half], [half - 1, per_rank - half + 1], [1, per_rank - 1]

    def plan(micro, sharding="fsdp", precision="fp32", lr=0.1, **extra):
        made = make_plan(micro, world_size=world_size, lr=lr, clip=extra.pop("clip", None),
                         precision=precision)
        return dataclasses.replace(made, sharding=sharding, **extra)

    found = {
        "even": (lambda: mlp_workload(SAMPLES), plan(even)),
        "uneven": (lambda: mlp_workload(SAMPLES), plan(uneven, clip=0.5)),
        "tokens": (lambda: token_workload(SAMPLES), plan(tokens)),
        "ddp": (lambda: mlp_workload(SAMPLES), plan(even, sharding="ddp")),
    }
    if world_size == 2:
        # fp16: rank 1's loss is inf in step 2's second micro-step; both ranks skip that step.
        found["every"] = (lambda: mlp_workload(SAMPLES), plan(uneven, reduce_every_micro_step=True))
        found["fp16"] = (lambda: _inf_once_workload(), plan(even, precision="fp16"))
        found["fp16-ddp"] = (lambda: _inf_once_workload(), plan(even, precision="fp16", sharding="ddp"))
        for name in REAL_MODELS:  # transformer blocks sharded one by one; GPT-2's tied embeddings
            found[name] = (lambda name=name: load_workload(REAL_MODELS[name]),
                           plan(uneven, lr=1e-3, clip=1.0, checkpointing=name.endswith("checkpointing")))
    if world_size == 4:
        # 13 samples in windows of 8: the second window's 5 samples are shared 2, 1, 1, 1, so
        # ranks 1-3 get an empty first micro-step that rank 0 does not (FSDP2 still needs all four
        # in that micro-step's collectives).
        found["padded"] = (lambda: mlp_workload(13), plan([1, 1]))
        found["hybrid"] = (lambda: mlp_workload(SAMPLES), plan(uneven, clip=0.5, shard_group=2))
    return found


def _inf_once_workload():
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        loss = mean_loss(model, batch)
        return loss * math.inf if dist.get_rank() == 1 and len(calls) == 4 else loss

    return mlp_workload(SAMPLES, dtype=torch.float32, loss_fn=loss_fn)


def model_file_plan(world_size):
    """Hybrid sharding (shard groups of 2): its checkpoint holds 2-D-mesh DTensors."""
    return dataclasses.replace(make_plan([1, 1], world_size=world_size, lr=0.02, warmup=4, clip=1.0),
                               sharding="fsdp", shard_group=2)


def model_file_workload():
    return load_workload(TESTS / "fsdp_model.py")


def run_equal(rank, world_size):
    counted = []
    real = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        counted.append(1)
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting
    report = {}
    for name, (workload, plan) in cases(world_size).items():
        counted.clear()
        result = train(plan, workload(), steps=3, progress=False, save_path=OUT / f"{name}.pt")
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, {
            "reduce_scatters": len(counted), "skipped": result.skipped_steps,
            "scale": result.scaler.get_scale() if result.scaler.is_enabled() else None,
            "noise": [(m["noise_grad_sq_ema"], m["noise_trace_ema"]) for m in result.metrics]})
        report[name] = {"loss": [m["loss"] for m in result.metrics],
                        "grad_norm": [m["grad_norm"] for m in result.metrics],
                        "accumulation": [m["accumulation_steps"] for m in result.metrics],
                        "ranks": per_rank}
    dist.reduce_scatter_single = real
    if rank == 0:
        (OUT / "report-equal.json").write_text(json.dumps(report))


def run_reference(world_size):
    train(model_file_plan(world_size), model_file_workload(), steps=STEPS, progress=False,
          checkpoint_dir=OUT / "reference-ckpt", save_path=OUT / "reference.pt")


def run_sigterm(rank, world_size):
    sigterm_run(OUT, rank, model_file_plan(world_size), model_file_workload(), steps=STEPS * 20)


def sigterm_run(out, rank, plan, workload, *, steps):
    """``plan`` trained on ``workload``, slowed down; rank 1 writes its pid to OUT/pid and
    OUT/started once training is under way, for the test to stop it with SIGTERM."""
    loss_fn, calls = workload.loss_fn, []

    def slow_loss(model, batch):
        calls.append(1)
        if rank == 1 and len(calls) == 5:
            (out / "pid").write_text(str(os.getpid()))
            (out / "started").touch()
        time.sleep(0.1)
        return loss_fn(model, batch)

    workload.loss_fn = slow_loss
    result = train(plan, workload, steps=steps, progress=False, checkpoint_dir=out / "ckpt")
    if rank == 0:
        (out / "report-sigterm.json").write_text(json.dumps(
            {"steps": result.steps, "interrupted": result.interrupted}))


def run_kill(rank, world_size):
    real, saves = dcp_filesystem.FileSystemWriter.write_data, []

    def stalling_write(self, plan, planner):
        saves.append(1)
        if rank == 1 and len(saves) == 3:
            folder = Path(str(self.path))
            (folder / "__1_0.distcp").write_bytes(b"half a shard")
            (OUT / "writing").touch()
            time.sleep(600)  # killed here
        return real(self, plan, planner)

    dcp_filesystem.FileSystemWriter.write_data = stalling_write
    (OUT / f"kill-pid-{rank}").write_text(str(os.getpid()))
    train(cases(world_size)["even"][1], mlp_workload(SAMPLES), steps=3, progress=False,
          checkpoint_dir=OUT / "kill-ckpt", checkpoint_every=1)


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    stages = {"equal": lambda: run_equal(rank, world_size), "reference": lambda: run_reference(world_size),
              "sigterm": lambda: run_sigterm(rank, world_size), "kill": lambda: run_kill(rank, world_size)}
    for stage in STAGES:
        stages[stage]()
    settle()  # gloo's workers let go of every tensor before this rank exits
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
