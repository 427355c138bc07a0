"""Two gloo ranks under torchrun give the parameters of one process with the same effective batch."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotune.training import train
from train_helpers import make_plan, mlp_workload, params_of, token_workload

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               str(TESTS / "ddp_train_script.py"), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name, workload, effective", [
    ("mean", lambda: mlp_workload(25), 10),     # 25 samples: windows 10, 10 and a partial 5
    ("tokens", lambda: token_workload(25), 10),
    ("oom", lambda: mlp_workload(25), 10),
])
def test_two_ranks_match_one_process(ddp_run, name, workload, effective):
    out, report = ddp_run
    single = train(make_plan([effective], lr=0.1), workload(), steps=3, progress=False)
    ranks = torch.load(out / f"{name}.pt")
    assert float((ranks - params_of(single.model)).abs().max()) <= 1e-6
    assert report[name]["loss"] == pytest.approx([m["loss"] for m in single.metrics], rel=1e-9)


@pytest.mark.slow
def test_no_sync_on_all_but_the_last_micro_step(ddp_run):
    _, report = ddp_run
    # micro-batches [2, 3]: two micro-steps per window but one gradient all-reduce (a tiny model
    # is a single DDP bucket) per optimizer step, on both ranks.
    assert report["mean"]["accumulation"] == [2, 2, 1]
    assert report["mean"]["allreduces"] == [3, 3]


@pytest.mark.slow
def test_ranks_agree_on_oom_recovery(ddp_run):
    _, report = ddp_run
    assert report["oom"]["recoveries"] == 2
    assert report["oom"]["accumulation"] == [4, 4, 2]  # two recoveries: the finer split is kept


@pytest.mark.slow
def test_ranks_share_one_noise_scale_estimate(ddp_run):
    _, report = ddp_run
    # The ranks' small-batch norms ride along in the window's one all-reduce of the totals, so
    # every rank holds the same moving averages (and gives the same advice).
    for name in ("mean", "tokens"):
        first, second = report[name]["noise"]
        assert first == second
        assert all(value is not None and math.isfinite(value) for pair in first for value in pair)
