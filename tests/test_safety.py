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
