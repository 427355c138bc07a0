"""Checkpoints: resume ends where an uninterrupted run ends (also after SIGTERM in a subprocess);
a crash while writing leaves the previous checkpoint loadable."""

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from autotune.training import TrainError, train
from autotune.training import checkpoint as checkpoint_module
from train_helpers import make_plan, mlp_workload, params_of

TESTS = Path(__file__).resolve().parent
STEPS = 7  # 40 samples, windows of 8: 5 steps per epoch, so resuming crosses an epoch


def _workload():
    return mlp_workload(40, dropout=0.2, optimizer="adamw")  # dropout: the RNG must be restored


def _plan():
    return make_plan([3, 5], lr=0.02, warmup=4, clip=1.0)


@pytest.fixture(scope="module")
def uninterrupted():
    return params_of(train(_plan(), _workload(), steps=STEPS, progress=False).model)


def test_resume_after_stopping_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    metrics = tmp_path / "metrics.jsonl"
    first = train(_plan(), _workload(), steps=3, checkpoint_dir=tmp_path, metrics_path=metrics,
                  progress=False)
    assert first.steps == 3 and (tmp_path / "checkpoint.pt").is_file()
    second = train(_plan(), _workload(), steps=STEPS, checkpoint_dir=tmp_path, resume=True,
                   metrics_path=metrics, progress=False)
    assert second.steps == STEPS and [m["step"] for m in second.metrics] == [4, 5, 6, 7]
    assert torch.equal(params_of(second.model), uninterrupted)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


_CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
from autotune.training import train
from train_helpers import make_plan, mean_loss, mlp_workload
import test_train_checkpoint as t

calls = {{"n": 0}}
def slow_loss(model, batch):
    calls["n"] += 1
    if calls["n"] == 5:
        open({marker!r}, "w").close()  # the parent sends SIGTERM from now on
    time.sleep(0.05)
    return mean_loss(model, batch)

workload = t._workload()
workload.loss_fn = slow_loss
result = train(t._plan(), workload, steps={steps}, checkpoint_dir={ckpt!r}, progress=False)
print("RESULT", result.steps, result.interrupted)
"""


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_and_resume_matches(tmp_path, uninterrupted):
    marker = tmp_path / "started"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD.format(tests=str(TESTS), marker=str(marker),
                                                    steps=STEPS * 20, ckpt=str(tmp_path))))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    steps, interrupted = out.split("RESULT")[1].split()
    assert interrupted == "True" and 2 <= int(steps) < STEPS, out
    assert "stopped by SIGTERM" in err
    resumed = train(_plan(), _workload(), steps=STEPS, checkpoint_dir=tmp_path, resume=True,
                    progress=False)
    assert torch.equal(params_of(resumed.model), uninterrupted)


def test_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch, uninterrupted):
    real_save = torch.save
    saves = {"n": 0}

    def crashing_save(obj, handle):
        saves["n"] += 1
        if saves["n"] == 2:
            handle.write(b"half a checkpoint")
            raise OSError("disk died mid-write")
        real_save(obj, handle)

    monkeypatch.setattr(checkpoint_module.torch, "save", crashing_save)
    with pytest.raises(OSError, match="disk died"):
        train(_plan(), _workload(), steps=STEPS, checkpoint_dir=tmp_path, checkpoint_every=2,
              progress=False)
    monkeypatch.setattr(checkpoint_module.torch, "save", real_save)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left
    assert checkpoint_module.load(tmp_path / "checkpoint.pt")["step"] == 2
    resumed = train(_plan(), _workload(), steps=STEPS, checkpoint_dir=tmp_path, resume=True,
                    progress=False)
    assert torch.equal(params_of(resumed.model), uninterrupted)


def test_resume_with_another_seed_is_refused(tmp_path):
    train(_plan(), _workload(), steps=1, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(TrainError, match="resume=True: seed is 3 but the checkpoint"):
        train(_plan(), _workload(), steps=2, checkpoint_dir=tmp_path, resume=True, seed=3,
              progress=False)


def test_resume_without_a_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(TrainError, match="no checkpoint at .*checkpoint_dir .*drop resume=True"):
        train(_plan(), _workload(), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)
