"""Run under torchrun by test_train_ddp.py: train three small workloads on 2 gloo ranks.

Writes, from rank 0, the parameters of each run and the number of gradient all-reduces each rank
made (counted with a DDP communication hook), to the folder given as argv[1].
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from autotune.distributed.collectives import settle
from autotune.distributed import process_group as distributed
from autotune.training import train
from train_helpers import OOMOnce, build_mlp, make_plan, mlp_workload, params_of, token_workload

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
allreduces = []
_wrap = distributed.wrap_model


def counting_wrap(model, ctx):
    ddp = _wrap(model, ctx)

    def hook(state, bucket):
        allreduces.append(1)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp


distributed.wrap_model = counting_wrap
runs = {
    "mean": (mlp_workload(25), [2, 3]),
    "tokens": (token_workload(25), [1, 4]),
    # rank 1 runs out of memory in a non-final micro-step (step 1) and in the final forward of
    # step 2: both ranks must agree and redo, without deadlock.
    "oom": (mlp_workload(25, model=lambda: OOMOnce(build_mlp(), fail_at={1, 7} if rank == 1 else ())),
            [2, 3]),
}
report = {}
for name, (workload, micro_batches) in runs.items():
    allreduces.clear()
    result = train(make_plan(micro_batches, world_size=2, lr=0.1), workload, steps=3, progress=False)
    counts, noise = [None, None], [None, None]
    dist.all_gather_object(counts, len(allreduces))
    dist.all_gather_object(noise, [(m["noise_grad_sq_ema"], m["noise_trace_ema"]) for m in result.metrics])
    report[name] = {"allreduces": counts, "steps": result.steps, "recoveries": result.oom_recoveries,
                    "accumulation": [m["accumulation_steps"] for m in result.metrics],
                    "loss": [m["loss"] for m in result.metrics], "noise": noise}
    if rank == 0:
        torch.save(params_of(result.model), out / f"{name}.pt")
if rank == 0:
    (out / "report.json").write_text(json.dumps(report))
settle()  # gloo's workers let go of every tensor before this rank exits
dist.destroy_process_group()
