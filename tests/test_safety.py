"""Hostile and clumsy inputs (issue 14): no code runs from data, no file is harmed by an output,
no training on garbage passes quietly. docs/testing.md lists every case tried and its result."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from autotune.training import TrainError, train
from train_helpers import make_plan, mlp_workload


class _RunsCode:
    """A pickled object whose unpickling calls a function: here it only creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_never_unpickles_code_from_a_checkpoint(tmp_path):
    first = train(make_plan([4]), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    state = torch.load(first.checkpoint, weights_only=True)  # what autotune writes loads as data
    marker = tmp_path / "code-ran"
    state["evil"] = _RunsCode(marker)
    torch.save(state, first.checkpoint)
    with pytest.raises(TrainError, match="not loaded, so none of its code ran"):
        train(make_plan([4]), mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True,
              progress=False)
    assert not marker.exists()


def _cli(*args, **kwargs):
    from click.testing import CliRunner

    from autotune.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args], **kwargs)


def test_verify_checks_the_model_files_hash_before_importing_it(tmp_path, examples_dir):
    import dataclasses
    import hashlib

    from autotune.planning.planfile import save_plan

    model = tmp_path / "model.py"
    original = (examples_dir / "mlp.py").read_bytes()
    plan = make_plan([4], sha=hashlib.sha256(original).hexdigest())
    plan.workload = dataclasses.replace(plan.workload, source=str(model))
    save_plan(plan, tmp_path / "plan.json")
    marker = tmp_path / "code-ran"
    model.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                     + original.decode())  # the plan names this file; someone changed it
    result = _cli("verify", tmp_path / "plan.json", "--device", "cpu", "--memory-limit", "64MiB")
    assert result.exit_code == 1
    assert "was not imported" in result.output and "another version of the model" in result.output
    assert not marker.exists()
