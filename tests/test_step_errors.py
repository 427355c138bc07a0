"""A trial's step that fails with an error that is not out-of-memory: one message naming the
setting, the micro-batch and the model file (a StepError chained to the original), never a
traceback."""

import textwrap

import pytest
from click.testing import CliRunner

from autotune import probe
from autotune.cli.main import cli
from autotune.errors import StepError, WorkloadError

pytestmark = pytest.mark.usefixtures("one_thread")

FAILS_FROM_4 = """
import torch
from torch import nn


class Picky(nn.Module):
    def forward(self, x):
        if x.shape[0] >= 4:
            raise ValueError("this model cannot take 4 samples")
        return x


def build_model():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Picky(), nn.Linear(8, 2))


def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randint(0, 2, (batch_size,))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
"""


@pytest.fixture
def failing_file(tmp_path):
    path = tmp_path / "picky.py"
    path.write_text(textwrap.dedent(FAILS_FROM_4))
    return str(path)


@pytest.mark.parametrize("use_estimate", [True, False])
def test_a_failing_step_is_a_step_error_naming_the_setting_with_the_cause_chained(failing_file,
                                                                                  use_estimate):
    # It was the model's ValueError itself, raised from deep inside the probe's step.
    with pytest.raises(StepError) as caught:
        probe(failing_file, memory_limit="64MiB", checkpointing=2, max_micro_batch=16,
              use_estimate=use_estimate)
    message = str(caught.value)
    assert isinstance(caught.value, WorkloadError)
    assert failing_file in message and "fp32, checkpointing 2 of 3 blocks" in message
    assert "micro-batch" in message and "this model cannot take 4 samples" in message
    assert "picky.py:9" in message  # where in the model file it failed
    assert isinstance(caught.value.__cause__, ValueError)


def test_the_cli_prints_one_message_and_no_traceback(failing_file):
    result = CliRunner().invoke(cli, ["probe", failing_file, "--memory-limit", "64MiB",
                                      "--precision", "bf16", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    # One message (the CLI may list the model file's own frames under it, never autotune's).
    assert "Traceback (most recent call last)" not in result.output
    assert "autotune/probing" not in result.output
    assert "the training step failed at micro-batch" in result.output
    assert "bf16, checkpointing off" in result.output and "picky.py" in result.output
