"""Issue 25, items 3, 6 and 7: what a hostile or clumsy user tried, as they would call it.

Outputs checked against the command's inputs and each other before any work, the model file's
errors as a message with the user's frames, oversized and over-deep JSON, plans that could not be
read back, and trials that hang. Each test is listed in docs/testing.md.
"""

from __future__ import annotations

import re
import textwrap

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.errors import UserCodeError
from autotune.training import train
from test_train_errors import _plan_file

RAISING_MODEL = textwrap.dedent("""
    import os
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            if os.environ.get("FAIL") == "forward":
                return self.layer(x.view(-1, 3)).sum()
            return self.layer(x).pow(2).mean()

    def _fail(where):
        if os.environ.get("FAIL") == where:
            raise RuntimeError(f"the user's {where} is broken")

    def build_model():
        _fail("build_model")
        return Net()

    def make_batch(n):
        _fail("make_batch")
        return torch.randn(n, 4)

    def build_optimizer(params):
        _fail("build_optimizer")
        return torch.optim.SGD(params, lr=0.1)
""")


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def raising_model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(RAISING_MODEL)
    return path


# -- 6. the model file's functions raising: one line naming them, then the user's frames only ---
@pytest.mark.parametrize("where, named", [
    ("build_model", "build_model()"), ("make_batch", "make_batch(batch_size)"),
    ("build_optimizer", "build_optimizer(params)"), ("forward", "the model's forward")])
def test_a_raising_model_file_function_is_named_with_only_the_users_frames(
        tmp_path, raising_model, monkeypatch, where, named):
    plan = _plan_file(tmp_path, raising_model)
    monkeypatch.setenv("FAIL", where)
    result = _cli("train", raising_model, "--plan", plan, "--steps", "1", "-q")
    assert result.exit_code == 1, result.output
    first, *rest = result.output.splitlines()
    assert first.startswith(f"Error: {named} in {raising_model} raised RuntimeError"), result.output
    assert rest[0].startswith("Traceback of your code")
    assert f'File "{raising_model}"' in result.output
    assert "autotune/" not in result.output and "torch/" not in result.output  # no library frames
    # From Python: the same error, the original chained for a debugger.
    with pytest.raises(UserCodeError, match=f"^{re.escape(named)} in ") as info:
        train(str(plan), str(raising_model), steps=1, progress=False)
    assert isinstance(info.value.__cause__, RuntimeError)
