"""Plans and parameter read-out shared by test_pipeline.py and pp_train_script.py."""

import dataclasses

import torch

from autotune.distributed.layout import parse_layout
from train_helpers import make_plan

MICRO_BATCHES = [2, 2, 2, 2]  # one window: 4 micro-batches of 2 through the pipeline


def pipeline_plan(pp: int, schedule: str, sharding: str, *, world_size: int):
    """The plan trained under torchrun: windows of ``MICRO_BATCHES`` per data-parallel rank."""
    parallel = parse_layout(pp=pp, pp_schedule=schedule)
    data_parallel = world_size // pp
    plan = make_plan(MICRO_BATCHES, world_size=world_size, lr=1e-2)
    return dataclasses.replace(plan, target_batch=sum(MICRO_BATCHES) * data_parallel,
                               sharding=sharding, parallel=parallel)


def reference_plan(data_parallel: int):
    """The same windows in one process: every data-parallel rank's micro-batches in turn."""
    return make_plan(MICRO_BATCHES * data_parallel, lr=1e-2)


def with_sgd(workload):
    """The workload trained with SGD: Adam's nearly sign-like first steps turn the last-bit
    differences of a reduce-scatter's summation order, in gradients near zero, into whole
    learning-rate steps, which no comparison of parameters survives."""
    return dataclasses.replace(workload, build_optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))


def own_parameters(model) -> dict:
    """This rank's parameters by their name in the unsplit model (a stage's "stage_K.model."
    prefix stripped; FSDP2's DTensors gathered)."""
    found = {}
    for name, p in model.named_parameters():
        if name.startswith("stage_"):
            name = name.split(".", 2)[2]
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        found[name] = value.detach().clone()
    return found
