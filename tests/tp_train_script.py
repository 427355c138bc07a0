"""Run under torchrun by test_tensor_parallel.py: tensor-parallel (and FSDP2 x TP) training of
bundled models on gloo, each saving its full state dict and its losses.

    tp_train_script.py OUT TP MODEL_FILE [MODEL_FILE ...]

Each model trains ``STEPS`` windows of ``EFFECTIVE`` samples in micro-batches of half a data-parallel
rank's share (exact accumulation over two micro-steps), AdamW at lr 1e-3 with clipping at 1.0; rank 0
writes OUT/STEM.pt (``save_path``) and OUT/STEM.json (the losses and gradient norms per step).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

from autotune.distributed.layout import Layout
from autotune.training import train
from autotune.workload.contract import load_workload
from train_helpers import make_plan

EFFECTIVE = 8
STEPS = 3


def tp_plan(world_size: int, tp: int):
    """The plan: FSDP2 over world_size / tp data-parallel ranks, TP over tp (tp 1: one process)."""
    layout = Layout(tp=tp)
    data_parallel = layout.data_parallel(world_size)
    share = EFFECTIVE // data_parallel
    plan = make_plan([share // 2, share - share // 2], world_size=world_size, lr=1e-3, clip=1.0)
    if tp == 1:
        return dataclasses.replace(plan, target_batch=EFFECTIVE)
    return dataclasses.replace(plan, target_batch=EFFECTIVE, sharding="fsdp", parallel=layout)


if __name__ == "__main__":
    out, tp, files = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for path in files:
        stem = Path(path).stem
        result = train(tp_plan(world, tp), load_workload(path), steps=STEPS, progress=False,
                       save_path=out / f"{stem}.pt")
        if result.rank == 0:
            (out / f"{stem}.json").write_text(json.dumps(
                {"loss": [m["loss"] for m in result.metrics],
                 "grad_norm": [m["grad_norm"] for m in result.metrics]}))
