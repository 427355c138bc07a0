"""Clear errors before training starts, and the `autotune train` command."""

import hashlib
import json
import textwrap

import pytest
import torch
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.errors import ConfigError, PlanFileError, WorkloadError
from autotune.planning.planfile import save_plan
from autotune.training import TrainError, train
from train_helpers import make_plan, mlp_workload

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        return nn.Linear(4, 2)

    def make_batch(n):
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def build_dataset():
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g),
                                              torch.randint(0, 2, (48,), generator=g))
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE)
    return path


def _plan_file(tmp_path, model_file, micro_batches=(4, 4), **kw):
    sha = hashlib.sha256(model_file.read_bytes()).hexdigest()
    path = tmp_path / "plan.json"
    save_plan(make_plan(list(micro_batches), sha=sha, lr=0.1, **kw), path)
    return path


def test_cli_trains_saves_and_writes_metrics(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    out = CliRunner().invoke(cli, ["train", str(model_file), "--plan", str(plan), "--steps", "3",
                                   "--save", str(tmp_path / "final.pt"),
                                   "--metrics", str(tmp_path / "m.jsonl"), "--clip-grad-norm", "0.5"])
    assert out.exit_code == 0, out.output
    assert "trained 3 optimizer steps" in out.output
    saved = torch.load(tmp_path / "final.pt")
    assert set(saved["model"]) == {"weight", "bias"} and saved["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"loss", "lr", "grad_norm", "samples_per_s", "peak_memory_bytes", "skipped_steps",
            "oom_recoveries"} <= set(records[0])


def test_cli_plan_for_another_model_file_is_exit_1(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    model_file.write_text(MODEL_FILE + "\n# edited since planning\n")
    out = CliRunner().invoke(cli, ["train", str(model_file), "--plan", str(plan), "--steps", "1"])
    assert out.exit_code == 1
    assert "another version of the model" in out.output and "re-plan" in out.output


def test_cli_corrupt_plan_file_is_exit_1(tmp_path, model_file):
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    out = CliRunner().invoke(cli, ["train", str(model_file), "--plan", str(bad), "--steps", "1"])
    assert out.exit_code == 1 and "not valid JSON" in out.output


def test_cli_steps_and_epochs_together_is_a_usage_error(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    out = CliRunner().invoke(cli, ["train", str(model_file), "--plan", str(plan), "--steps", "1",
                                   "--epochs", "1"])
    assert out.exit_code == 2 and "--steps and --epochs" in out.output


def test_dataset_smaller_than_one_window():
    with pytest.raises(WorkloadError, match="fewer than one window of the plan's effective batch 16"):
        train(make_plan([8, 8]), mlp_workload(10), steps=1, progress=False)


def test_plan_for_another_world_size():
    with pytest.raises(TrainError, match="world size 2 but this run has 1 process.*torchrun --nproc-per-node 2"):
        train(make_plan([4], world_size=2), mlp_workload(16), steps=1, progress=False)


def test_plan_sha_differs_from_workload():
    workload = mlp_workload(16)
    workload.file_sha256 = "a" * 64
    with pytest.raises(PlanFileError, match="re-plan"):
        train(make_plan([4], sha="b" * 64), workload, steps=1, progress=False)


def test_no_dataset_needs_steps():
    workload = mlp_workload(16)
    workload.build_dataset = None
    with pytest.raises(ConfigError, match="give steps N"):  # train()'s keyword, from Python
        train(make_plan([4]), workload, progress=False)
    result = train(make_plan([4]), workload, steps=2, progress=False)  # make_batch windows
    assert result.steps == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be a positive integer"),
    ({"steps": 1, "checkpoint_every": 2}, "checkpoint_every needs checkpoint_dir"),
    ({"steps": 1, "resume": True}, "resume=True needs checkpoint_dir"),
    ({"steps": 1, "clip_grad_norm": -1.0}, "clip_grad_norm must be positive"),
])
def test_bad_options(kwargs, message):
    # From Python the message names train()'s keywords; the CLI's own tests see its --flags.
    with pytest.raises(ConfigError, match=f"^{message}"):
        train(make_plan([4]), mlp_workload(16), progress=False, **kwargs)


def test_train_errors_name_flags_from_the_cli(tmp_path, examples_dir):
    from click.testing import CliRunner

    from autotune.cli.main import cli
    from autotune.planning.planfile import save_plan

    plan_file = save_plan(make_plan([4]), tmp_path / "plan.json")
    result = CliRunner().invoke(cli, ["train", str(examples_dir / "mlp.py"), "--plan", str(plan_file),
                                      "--steps", "1", "--checkpoint-every", "2"])
    assert result.exit_code == 2
    assert "--checkpoint-every needs --checkpoint-dir" in result.output


def test_malformed_plan_object():
    plan = make_plan([4])
    plan.micro_batches = [4, 0]
    with pytest.raises(PlanFileError, match="micro_batches must be a non-empty list"):
        train(plan, mlp_workload(16), steps=1, progress=False)


def test_a_world_size_variable_that_is_no_count_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='two' is not a count; unset it, or launch with torchrun"):
        train(make_plan([4]), mlp_workload(16), steps=1, progress=False)
