"""Run under torchrun by test_context_parallel.py: context-parallel training on gloo.

    cp_train_script.py OUT STAGE [STAGE ...]

Stages:
- ``equal``: every model of ``MODELS`` trained 3 steps on a plan of cp = world size; each rank
  saves the full state dict to OUT/NAME-cp.pt (the one-process reference is the test's).
- ``reference``: the checkpointed causal_lm run, uninterrupted, saved to OUT/reference.pt.
- ``sigterm``: the same run, slowed down; rank 1 writes its pid to OUT/pid and OUT/started once
  training is under way, so the test can send it SIGTERM (the stop reaches every rank).
"""

import dataclasses
import sys
from pathlib import Path

import torch.distributed as dist

from autotune.distributed.collectives import settle
from autotune.distributed.layout import Layout
from autotune.training import train
from autotune.workload.contract import load_workload
from fsdp_train_script import sigterm_run
from train_helpers import make_plan

TESTS = Path(__file__).resolve().parent
MODELS = {"causal_lm": TESTS / "cp_causal_lm_model.py", "hf_llama": TESTS / "cp_hf_llama_model.py",
          "hf_gpt2": TESTS / "cp_hf_gpt2_model.py"}
MICRO_BATCHES = [1, 2]  # an uneven window: items weighed across micro-steps and cp ranks
STEPS = 8


CHECKPOINTED = {"causal_lm_checkpointing": "causal_lm"}
"""Runs with every block checkpointed: the recomputation in backward rings attention again."""


def plan(world_size: int, cp: int, *, lr=0.1, checkpointing=False):
    """Windows of 3 samples on each data-parallel rank, fp32, clipped; sharded over the world."""
    made = make_plan(MICRO_BATCHES, world_size=world_size // cp, lr=lr, clip=1.0)
    return dataclasses.replace(made, world_size=world_size, sharding="fsdp" if world_size > 1 else "ddp",
                               parallel=Layout(cp=cp), checkpointing=checkpointing)


def equal_cases(world_size: int, cp: int) -> dict:
    """name -> (model file, plan) of the equality runs."""
    cases = {name: (path, plan(world_size, cp)) for name, path in MODELS.items()}
    for name, model in CHECKPOINTED.items():
        cases[name] = (MODELS[model], plan(world_size, cp, checkpointing=True))
    return cases


def run_equal(world_size):
    for name, (path, planned) in equal_cases(world_size, world_size).items():
        train(planned, load_workload(path), steps=3, progress=False, save_path=OUT / f"{name}-cp.pt")


def run_reference(world_size):
    train(plan(world_size, world_size), load_workload(MODELS["causal_lm"]), steps=STEPS,
          progress=False, checkpoint_dir=OUT / "reference-ckpt", save_path=OUT / "reference.pt")


def run_sigterm(rank, world_size):
    sigterm_run(OUT, rank, plan(world_size, world_size), load_workload(MODELS["causal_lm"]),
                steps=STEPS * 20)


OUT = Path(sys.argv[1]) if __name__ == "__main__" else None


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    stages = {"equal": lambda: run_equal(world_size), "reference": lambda: run_reference(world_size),
              "sigterm": lambda: run_sigterm(rank, world_size)}
    for stage in sys.argv[2:]:
        stages[stage]()
    settle()  # gloo's workers let go of every tensor before this rank exits
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
