"""Plans, parameter read-out and peak runs shared by test_pipeline.py, pp_train_script.py and
bench/pp_estimate_accuracy.py."""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import torch

from autotune.distributed.layout import parse_layout
from train_helpers import make_plan

MICRO_BATCHES = [2, 2, 2, 2]  # one window: 4 micro-batches of 2 through the pipeline


def pipeline_plan(pp: int, schedule: str, sharding: str, *, world_size: int, tp: int = 1, cp: int = 1,
                  clip=None):
    """The plan trained under torchrun: windows of ``MICRO_BATCHES`` per data-parallel rank."""
    parallel = parse_layout(pp=pp, pp_schedule=schedule, tp=tp, cp=cp)
    data_parallel = world_size // (pp * tp * cp)
    plan = make_plan(MICRO_BATCHES, world_size=world_size, lr=1e-2, clip=clip)
    return dataclasses.replace(plan, target_batch=sum(MICRO_BATCHES) * data_parallel,
                               sharding=sharding, parallel=parallel)


def reference_plan(data_parallel: int, clip=None):
    """The same windows in one process: every data-parallel rank's micro-batches in turn."""
    return make_plan(MICRO_BATCHES * data_parallel, lr=1e-2, clip=clip)


def with_sgd(workload):
    """The workload trained with SGD: Adam's nearly sign-like first steps turn the last-bit
    differences of a reduce-scatter's summation order, in gradients near zero, into whole
    learning-rate steps, which no comparison of parameters survives."""
    return dataclasses.replace(workload, build_optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))


def own_parameters(model) -> dict:
    """This rank's parameters by their name in the unsplit model (a stage's "stage_K.model."
    prefix stripped; FSDP2's and tensor parallel's DTensors gathered)."""
    found = {}
    for name, p in model.named_parameters():
        if name.startswith("stage_"):
            name = name.split(".", 2)[2]
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        found[name] = value.detach().clone()
    return found


TESTS = Path(__file__).resolve().parent


def estimated_rank_peaks(model_file, n, *, pp=2, schedule="1f1b", window=4, world_size=None,
                         sharding="ddp", tp=1, cp=1) -> list[int]:
    """The estimate's peak of each pipeline rank (first data-parallel rank of each)."""
    from autotune.probing.estimate import estimate_session
    from autotune.probing.pipeline_trial import pipeline_rank_trials

    parallel = parse_layout(pp=pp, pp_schedule=schedule, tp=tp, cp=cp)
    world_size = world_size or pp * tp * cp

    def make_session(fake_rank):
        return estimate_session(model_file, precision="fp32", checkpointing=False, sharding=sharding,
                                world_size=world_size, shard_group=None, parallel=parallel,
                                fake_rank=fake_rank)

    trials = pipeline_rank_trials(make_session, [n], window=window, parallel=parallel,
                                  world_size=world_size)[n]
    return [t.peak_bytes for t in trials]


def real_pipeline_peaks(model_file, out: Path, *, pp, schedule, sharding, world, window, sizes,
                        repeats=3, tp=1, cp=1) -> dict[int, list[list[int]]]:
    """{n: per-rank lists of peaks} of real pipelined windows on ``world`` gloo ranks (tensor
    parallel over groups of ``tp`` inside each stage, each sequence over ``cp`` ranks)."""
    path = Path(out) / f"peaks-{Path(model_file).stem}-{schedule}-{world}-tp{tp}-cp{cp}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PP_REPEATS=str(repeats), PP_TP=str(tp), PP_CP=str(cp),
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    from conftest import rank_command

    command = rank_command(world, TESTS / "pp_peak_script.py", model_file, path, pp, schedule, sharding,
                           window, *sizes)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return {int(n): ranks for n, ranks in json.loads(path.read_text())["peaks"].items()}
