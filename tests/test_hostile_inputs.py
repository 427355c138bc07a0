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
    import time
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            if os.environ.get("FAIL") == "hang" and x.shape[0] >= 3 \
                    and not isinstance(x, torch._subclasses.FakeTensor):
                time.sleep(3600)  # waits on something that never comes
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


@pytest.mark.parametrize("where, named", [
    ("build_model", "build_model()"), ("build_optimizer", "build_optimizer(params)")])
def test_plan_names_a_raising_model_file_function_even_where_it_runs_on_fake_tensors(
        tmp_path, raising_model, monkeypatch, where, named):
    # plan fingerprints the model (and estimates) on fake tensors before any real trial: an
    # error the user's own line raised there is still the user's, not a traceback.
    monkeypatch.setenv("FAIL", where)
    result = _cli("plan", raising_model, "--target-batch", "8", "--memory-limit", "64MiB", "-q")
    assert result.exit_code == 1, result.output
    assert f"{named} in {raising_model} raised RuntimeError" in result.output.splitlines()[0]
    assert f'File "{raising_model}"' in result.output


def test_an_error_raised_inside_torch_distributed_is_not_blamed_on_the_users_function():
    # gloo reports a peer that died as a plain RuntimeError from inside a collective that the
    # user's loss_fn reached through FSDP2/DDP: the peer failed, not the user's code, and the
    # torchrun restart logic must see the original error.
    import torch

    from autotune.workload.contract import user_code

    def loss_fn():
        torch.distributed.all_reduce(torch.zeros(1))  # no process group: raised in torch.distributed

    with pytest.raises(Exception) as info:
        with user_code("loss_fn(model, batch)", "model.py"):
            loss_fn()
    assert not isinstance(info.value, UserCodeError)
    with pytest.raises(UserCodeError):  # the user's own error still is the user's
        with user_code("loss_fn(model, batch)", "model.py"):
            raise RuntimeError("my bug")


# -- 3. one check of all of a command's outputs, against its inputs and each other --------------
@pytest.fixture
def model_file(tmp_path):
    from test_train_errors import MODEL_FILE

    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE)
    return path


def _plan_naming(tmp_path, model_file, source):
    """A plan file whose workload names ``source`` (as autotune plan records the path given)."""
    import dataclasses
    import hashlib

    from autotune.planning.planfile import save_plan
    from train_helpers import make_plan

    plan = make_plan([4, 4], sha=hashlib.sha256(model_file.read_bytes()).hexdigest(), lr=0.1)
    plan = dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, source=str(source)))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    return path


def test_outputs_never_replace_each_other_or_what_the_checkpoint_dir_keeps(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    ckpt = tmp_path / "ckpt"
    train_args = ("train", model_file, "--plan", plan, "--steps", "1")
    for args, message in (
            (("--save", tmp_path / "x", "--metrics", tmp_path / "x"), "are the same file"),
            (("--checkpoint-dir", ckpt, "--save", ckpt / "checkpoint.pt"), "keeps its own checkpoint.pt"),
            (("--checkpoint-dir", ckpt, "--metrics", ckpt / "checkpoint.pt"), "keeps its own checkpoint.pt"),
            (("--checkpoint-dir", ckpt, "--metrics", ckpt / "checkpoint.json"), "keeps its own checkpoint.json"),
            (("--checkpoint-dir", ckpt, "--save", ckpt / "oom-restart.json"), "keeps its own oom-restart.json"),
            (("--checkpoint-dir", ckpt, "--metrics", ckpt / "autotune.lock"), "keeps its own autotune.lock"),
            (("--checkpoint-dir", ckpt, "--metrics", ckpt / "step-00000002"), "keeps its own step-00000002")):
        result = _cli(*train_args, *args)
        assert result.exit_code == 1 and message in result.output, (args, result.output)
    assert not (tmp_path / "x").exists() and not ckpt.exists()  # refused before any work
    # Beside the checkpoints, under names autotune never writes there, is fine.
    result = _cli(*train_args, "--checkpoint-dir", ckpt, "--metrics", ckpt / "metrics.jsonl",
                  "--save", ckpt / "model.pt")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint.pt", "metrics.jsonl", "model.pt"]


def test_no_command_replaces_the_model_file_its_plan_names(tmp_path, model_file):
    from autotune.errors import OutputError
    from autotune.planning.planfile import load_plan, save_plan
    from autotune.report.html import write_report

    plan = _plan_naming(tmp_path, model_file, model_file)
    code = model_file.read_text()
    for args in (("verify", plan, "--device", "cpu", "-o", model_file),
                 ("report", plan, "-o", model_file),
                 ("export", plan, "--to", "hf", "-o", model_file),
                 ("show", plan, "--plot", model_file)):
        result = _cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert "is this command's own model file (the plan's)" in result.output, result.output
    for write in (save_plan, write_report):  # the Python API too
        with pytest.raises(OutputError, match="model file"):
            write(load_plan(plan), model_file)
    assert model_file.read_text() == code


def test_an_output_where_no_file_can_be_made_fails_before_the_work(tmp_path, model_file, monkeypatch):
    import autotune.orchestration.planner as planning_api

    def no_planning(*args, **kwargs):
        raise AssertionError("planned although the output cannot be written")

    monkeypatch.setattr(planning_api, "plan", no_planning)
    plan = _plan_file(tmp_path, model_file)
    for args, option in ((("plan", model_file, "--target-batch", "8", "-o", "/proc/x.json"), "-o"),
                         (("report", plan, "-o", "/proc/x.html"), "-o"),
                         (("export", plan, "--to", "hf", "-o", "/sys/x.json"), "-o"),
                         (("train", model_file, "--plan", plan, "--steps", "1", "--save", "/proc/m.pt"),
                          "--save"),
                         (("train", model_file, "--plan", plan, "--steps", "1", "--metrics",
                           "/proc/new/m.jsonl"), "--metrics")):
        result = _cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert result.output.startswith(f"Error: {option} "), result.output
        assert "cannot take files" in result.output or "not writable" in result.output  # root or not
    # The check leaves nothing behind where it succeeds.
    before = sorted(tmp_path.iterdir())
    assert _cli("export", plan, "--to", "hf", "-o", tmp_path / "hf.json").exit_code == 0
    assert sorted(tmp_path.iterdir()) == sorted([*before, tmp_path / "hf.json"])


# -- 7. --resume with --overwrite ----------------------------------------------------------------
def test_resume_and_overwrite_together_are_a_usage_error(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    result = _cli("train", model_file, "--plan", plan, "--steps", "1", "--checkpoint-dir",
                  tmp_path / "ckpt", "--resume", "--overwrite")
    assert result.exit_code == 2 and "--resume and --overwrite" in result.output, result.output
    assert not (tmp_path / "ckpt").exists()


# -- 7. an LR that underflows to 0 is refused when planning, not when the plan is read -----------
def test_an_lr_that_underflows_to_zero_is_refused_when_planning(tmp_path, examples_dir):
    from autotune.errors import ConfigError
    from autotune.planning.lr import decide_lr

    out = tmp_path / "plan.json"
    result = _cli("plan", examples_dir / "mlp.py", "--target-batch", "8", "--base-lr", "1e-320",
                  "--base-batch", "1000000", "--lr-rule", "linear", "--device", "cpu", "-o", out)
    assert result.exit_code == 2, result.output
    assert "underflows to 0" in result.output and "--base-lr" in result.output
    assert not out.exists()
    with pytest.raises(ConfigError, match="--lr-rule none"):
        decide_lr(rule="linear", target_batch=8, base_lr=1e-320, base_batch=10**6, optimizer="SGD")
    assert decide_lr(rule="linear", target_batch=8, base_lr=1e-300, base_batch=10**6,
                     optimizer="SGD").lr > 0  # tiny but representable: planned as asked


# -- 7. verify finds the plan's model file beside the plan, from any folder ----------------------
def test_verify_finds_a_relative_model_file_beside_the_plan_from_another_folder(
        tmp_path, model_file, monkeypatch):
    from autotune.errors import PlanFileError
    from autotune.orchestration.verify import verify_plan

    plan = _plan_naming(tmp_path, model_file, "model.py")  # as `autotune plan model.py` records it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = verify_plan(str(plan), device="cpu", memory_limit="256MiB", steps=1, replan=False)
    assert result.confirmed and result.measured_peak_bytes > 0
    model_file.rename(tmp_path / "moved.py")
    with pytest.raises(PlanFileError, match="beside the plan.*from the current folder.*--model PATH"):
        verify_plan(str(plan), device="cpu", steps=1, replan=False)
    cli_result = _cli("verify", plan, "--device", "cpu", "--memory-limit", "256MiB", "--steps", "1",
                      "--model", tmp_path / "moved.py")
    assert cli_result.exit_code == 0, cli_result.output


# -- 6. plan and metrics files: a cap on what is read, and JSON nested too deep ------------------
def test_a_plan_read_from_dev_zero_stops_at_the_cap(tmp_path):
    result = _cli("show", "/dev/zero")
    assert result.exit_code == 1 and "larger than 4 MiB" in result.output, result.output
    endless = tmp_path / "endless.jsonl"
    endless.symlink_to("/dev/zero")
    result = _cli("show", endless)
    assert result.exit_code == 1 and "line 1 is longer than 1024 KiB" in result.output, result.output


def test_json_nested_too_deep_is_a_message(tmp_path, model_file):
    deep = "[" * 100_000 + "]" * 100_000
    plan = tmp_path / "deep.json"
    plan.write_text(deep)
    for args in (("show", plan), ("export", plan, "--to", "hf"),
                 ("train", model_file, "--plan", plan, "--steps", "1")):
        result = _cli(*args)
        assert result.exit_code == 1 and "nested deeper than Python reads" in result.output, result.output
    metrics = tmp_path / "deep.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\n{"step": ' + deep + "}\n")
    result = _cli("show", metrics)
    assert result.exit_code == 1 and "line 2: not JSON (or nested too deeply)" in result.output
    # Resuming a run whose metrics file gained such a line: the line is dropped like any other
    # damaged line after the checkpoint, not a RecursionError.
    good = _plan_file(tmp_path, model_file)
    run = ("train", model_file, "--plan", good, "--checkpoint-dir", tmp_path / "ckpt",
           "--metrics", tmp_path / "m.jsonl", "-q")
    assert _cli(*run, "--steps", "1").exit_code == 0
    with open(tmp_path / "m.jsonl", "a") as handle:
        handle.write('{"step": ' + deep + "}\n")
    result = _cli(*run, "--steps", "2", "--resume")
    assert result.exit_code == 0, result.output
    assert [line.count("[") for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [0, 0]


# -- 7. a trial that hangs: a line per trial where stderr is no terminal, and --trial-timeout ----
def test_a_hanging_trial_is_logged_and_stopped_by_trial_timeout(tmp_path, raising_model, monkeypatch):
    import signal
    import time

    model = raising_model
    monkeypatch.setenv("FAIL", "hang")
    handler = signal.getsignal(signal.SIGALRM)
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["probe", str(model), "--device", "cpu", "--memory-limit",
                                      "64MiB", "--max-micro-batch", "8", "--trial-timeout", "1"])
    assert result.exit_code == 1, result.output
    assert time.perf_counter() - started < 60
    # stderr is no terminal here: each trial is a line as it starts, the hanging one last.
    lines = result.stderr.splitlines()
    assert lines[-2] == "probe fp32, checkpointing off: trying micro-batch 8 (real)", lines
    assert lines[-1].startswith(f"Error: {model}: the trial at micro-batch 8 (fp32, checkpointing "
                                f"off) ran past --trial-timeout 1 s and was stopped")
    # verify runs the plan's micro-batch under the same limit.
    plan = _plan_naming(tmp_path, model, model)
    result = _cli("verify", plan, "--device", "cpu", "--steps", "1", "--trial-timeout", "0.5")
    assert result.exit_code == 1 and "at micro-batch 4" in result.output, result.output
    assert "ran past --trial-timeout 0.5 s" in result.output
    # The timer is disarmed and the handler restored, every time.
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    for bad in ("0", "-1", "nan", "inf"):
        assert _cli("probe", model, "--trial-timeout", bad).exit_code == 2


def test_the_python_api_trial_timeout_and_plots_check_their_outputs_too(tmp_path, raising_model,
                                                                        monkeypatch):
    import autotune
    from autotune.errors import ConfigError, OutputError, ProbeError
    from autotune.planning.planfile import load_plan

    monkeypatch.setenv("FAIL", "hang")
    with autotune.trial_timeout(0.5), pytest.raises(ProbeError, match="ran past --trial-timeout 0.5 s"):
        autotune.probe(str(raising_model), device="cpu", memory_limit="64MiB", max_micro_batch=8)
    with pytest.raises(ConfigError):
        with autotune.trial_timeout(float("inf")):
            pass
    pytest.importorskip("matplotlib")
    plan = load_plan(_plan_naming(tmp_path, raising_model, raising_model))
    code = raising_model.read_text()
    with pytest.raises(OutputError, match="model file"):
        autotune.plot_plan(plan, raising_model)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0}\n')
    with pytest.raises(OutputError, match="metrics file"):
        autotune.plot_metrics([metrics], metrics)
    assert raising_model.read_text() == code and metrics.read_text().count("step") == 1
