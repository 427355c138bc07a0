"""Run under torchrun by test_pipeline.py: pipelined training of a model file on gloo ranks.

    pp_train_script.py OUT MODEL.py PP SCHEDULE SHARDING STEPS [CHECKPOINT_DIR [resume]]

Trains ``plan(PP, SCHEDULE, SHARDING)`` for STEPS steps and writes each rank's own parameters
(the stage prefix stripped, DTensors gathered) and its losses to OUT/rank-R.pt. With
CHECKPOINT_DIR it checkpoints every step (DCP); ``resume`` resumes from it. PP_SLOW=1 sleeps a
second per step and touches OUT/started once training is under way (for SIGTERM tests). PP_TP=T
adds tensor parallel over groups of T inside each stage; PP_CP=C shards each sequence over C
context-parallel ranks; PP_CLIP=C clips the gradient norm to C.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.distributed.collectives import settle
from autotune.training import train
from autotune.workload.contract import load_workload
from pp_plans import own_parameters, pipeline_plan, with_sgd

out, model_file, pp, schedule, sharding, steps, *rest = sys.argv[1:]
out = Path(out)
dist.init_process_group("gloo")
workload = with_sgd(load_workload(model_file))
if os.environ.get("PP_SLOW"):
    loss = workload.loss_fn  # the model file's own function

    def slow_loss(model, batch):
        time.sleep(0.3)
        (out / "started").touch()
        (out / f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
        return loss(model, batch)

    import dataclasses
    workload = dataclasses.replace(workload, loss_fn=lambda model, batch: slow_loss(model, batch))
plan = pipeline_plan(int(pp), schedule, sharding, world_size=dist.get_world_size(),
                     tp=int(os.environ.get("PP_TP", "1")), cp=int(os.environ.get("PP_CP", "1")),
                     clip=float(os.environ["PP_CLIP"]) if os.environ.get("PP_CLIP") else None)
result = train(plan, workload, steps=int(steps), seed=0, checkpoint_dir=rest[0] if rest else None,
               checkpoint_every=1 if rest else None, resume=len(rest) > 1, progress=False)
torch.save({"params": own_parameters(result.model), "losses": [r["loss"] for r in result.metrics],
            "steps": result.steps, "interrupted": result.interrupted},
           out / f"rank-{dist.get_rank()}.pt")
settle()
dist.destroy_process_group()
