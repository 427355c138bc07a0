"""A dataset whose examples default_collate cannot stack (variable lengths, no collate_fn) is
refused before planning and before training, with the fix, instead of crashing `autotune train`'s
first step ("stack expects each tensor to be equal size")."""

import textwrap

import pytest
from click.testing import CliRunner

from autotune import plan
from autotune.cli.main import cli
from autotune.errors import WorkloadError
from autotune.training.api import train
from autotune.workload.dataset_batch import check_default_collate

from train_helpers import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")

VARLEN = """
import torch
from torch import nn

BASE_LR, BASE_BATCH = 1e-3, 8


def build_model():
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16))


def make_batch(batch_size):
    return torch.randint(0, 16, (batch_size, 12))


def loss_fn(model, batch):
    return model(batch).logsumexp(-1).mean()


def build_dataset():
    return [torch.randint(0, 16, (4 + i % 9,)) for i in range(64)]
"""

PADDED = VARLEN + """

def collate_fn(examples):
    return nn.utils.rnn.pad_sequence(examples, batch_first=True)
"""


def _file(tmp_path, text, name="varlen.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_plan_refuses_a_dataset_default_collate_cannot_batch(tmp_path):
    # The plan came from make_batch and looked fine; training then died in default_collate.
    path = _file(tmp_path, VARLEN)
    with pytest.raises(WorkloadError, match=r"cannot be batched without a collate_fn.*stack expects "
                                            r"each tensor to be equal size.*Define collate_fn") as caught:
        plan(path, target_batch=8, memory_limit="64MiB", precision="fp32", checkpointing="off")
    assert path in str(caught.value) and "examples 0 and 1" in str(caught.value)


def test_train_refuses_it_before_the_first_step(tmp_path):
    path = _file(tmp_path, VARLEN)
    with pytest.raises(WorkloadError, match="Define collate_fn"):
        train(make_plan([4]), path, steps=1, progress=False, measure_noise_scale=False)


def test_the_cli_says_so_in_one_message(tmp_path):
    result = CliRunner().invoke(cli, ["plan", _file(tmp_path, VARLEN), "--target-batch", "8",
                                      "--memory-limit", "64MiB", "--output", str(tmp_path / "p.json")])
    assert result.exit_code == 1
    assert "Define collate_fn(examples)" in result.output and "Traceback" not in result.output


def test_a_collate_fn_or_equal_shapes_pass(tmp_path):
    padded = _file(tmp_path, PADDED, "padded.py")
    result = plan(padded, target_batch=8, memory_limit="64MiB", precision="fp32", checkpointing="off")
    assert result.effective_batch == 8
    check_default_collate([(i, float(i)) for i in range(10)], source="x")  # scalars stack
