"""`autotune plan`, `show` and `export`: output, plan files and exit codes."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import autotune
from autotune import load_plan
from autotune.cli.main import cli
from autotune.planning.planfile import save_plan
from plan_helpers import linear_probe, make_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    result = run("plan", EXAMPLES / "mlp.py", "--target-batch", 64, "--memory-limit", "64MiB",
                 "--precision", "fp32", "-o", out)
    return result, out


def test_plan_end_to_end(mlp_plan):
    result, out = mlp_plan
    assert result.exit_code == 0, result.output
    for text in ("budget:", "settings tried:", "probe max", "planned max", "= 64", "lr:"):
        assert text in result.output
    plan = load_plan(out)
    assert plan.effective_batch == 64
    assert plan.precision == "fp32"
    assert plan.lr.base_lr == pytest.approx(1e-3)  # BASE_LR / BASE_BATCH from the model file
    assert plan.lr.lr == pytest.approx(1e-3 * (64 / 32) ** 0.5)
    assert plan.lr.warmup_steps == 5 * 2048 // 64


def test_show(mlp_plan):
    result = run("show", mlp_plan[1])
    assert result.exit_code == 0
    assert "= 64" in result.output and "settings tried" in result.output


@pytest.mark.parametrize("target,needle", [("hf", "per_device_train_batch_size"),
                                           ("deepspeed", "train_micro_batch_size_per_gpu"),
                                           ("lightning", "accumulate_grad_batches"),
                                           ("accelerate", "mixed_precision"),
                                           ("torchrun", "--nproc_per_node=1")])
def test_export_each_target(mlp_plan, target, needle, tmp_path):
    result = run("export", mlp_plan[1], "--to", target)
    assert result.exit_code == 0
    assert needle in result.stdout
    out = tmp_path / "exported"
    assert run("export", mlp_plan[1], "--to", target, "-o", out).exit_code == 0
    assert needle in out.read_text()


@pytest.mark.slow  # about 15 s
def test_api_plan_of_a_small_lm_with_world_size():
    plan = autotune.plan(EXAMPLES / "tiny_lm.py", target_batch=16, world_size=2,
                         precision="fp32", checkpointing="off", memory_limit="256MiB")
    assert plan.micro_batches == [8]
    assert plan.effective_batch == 16
    assert plan.ddp_bucket_bytes == plan.workload.param_bytes > 0
    assert any("one process" in w for w in plan.warnings)
    assert plan.settings[0].probe.upper_bound == 8  # probed only up to the per-device share


def test_json_output(monkeypatch, tmp_path):
    _fake_probe(monkeypatch, 40)
    out = tmp_path / "p.json"
    result = run("plan", _model_file(tmp_path), "--target-batch", 100, "--json", "-o", out)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["micro_batches"] == [34, 33, 33]
    assert json.loads(out.read_text())["micro_batches"] == [34, 33, 33]


def _model_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("import torch\n"
                    "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))\n"
                    "def make_batch(n):\n    return torch.randn(n, 4)\n"
                    "def loss_fn(model, batch):\n    return model(batch).sum()\n")
    return path


def _fake_probe(monkeypatch, max_micro):
    def fake(workload, *, precision, checkpointing, max_micro_batch, backend, **_):
        return linear_probe(min(max_micro, max_micro_batch), precision=precision,
                            checkpointing=checkpointing, upper=max_micro_batch)

    monkeypatch.setattr("autotune.orchestration.planner.probe", fake)


def test_plan_summary_shows_warnings(monkeypatch, tmp_path):
    _fake_probe(monkeypatch, 80)  # 72 within the 10% headroom
    result = run("plan", _model_file(tmp_path), "--target-batch", 40, "--world-size", 4,
                 "--precision", "fp32", "-o", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert "10 × 1 accumulation step × 4 ranks = 40" in result.output
    assert "warning: the model has BatchNorm and its micro-batch is 10" in result.output
    assert "warning: --world-size 4 was planned from one process" in result.output
    # A model-parallel layout's ranks are not all data-parallel: the split says which are.
    import dataclasses

    from autotune import Layout
    from autotune.cli.format import format_plan

    split = dataclasses.replace(load_plan(tmp_path / "p.json"), world_size=16, parallel=Layout(cp=4))
    assert "split:        10 × 1 accumulation step × 4 data-parallel rank(s) of 16 = 40" in \
        format_plan(split).splitlines()


def test_even_flag_plans_equal_micro_batches(monkeypatch, tmp_path):
    _fake_probe(monkeypatch, 13)
    out = tmp_path / "p.json"
    result = run("plan", _model_file(tmp_path), "--target-batch", 64, "--precision", "fp32",
                 "--checkpointing", "off", "--headroom", 0, "--even", "-o", out)
    assert result.exit_code == 0, result.output
    assert load_plan(out).micro_batches == [8] * 8


@pytest.mark.parametrize("args,option", [
    (["--target-batch", "0"], "--target-batch"),
    (["--target-batch", "-4"], "--target-batch"),
    (["--target-batch", "8", "--world-size", "0"], "--world-size"),
    (["--target-batch", "8", "--memory-limit", "lots"], "--memory-limit"),
    (["--target-batch", "8", "--headroom", "1.5"], "--headroom"),
    (["--target-batch", "8", "--micro-batch", "-1"], "--micro-batch"),
    (["--target-batch", "8", "--base-lr", "-1"], "--base-lr"),
    (["--target-batch", "8", "--precision", "fp8"], "--precision"),
])
def test_usage_errors_exit_2_naming_the_option(tmp_path, args, option):
    result = run("plan", _model_file(tmp_path), *args)
    assert result.exit_code == 2
    assert option in result.output


def test_missing_model_file_is_a_usage_error(tmp_path):
    result = run("plan", tmp_path / "missing.py", "--target-batch", 8)
    assert result.exit_code == 2
    assert "MODEL_FILE" in result.output and "does not exist" in result.output


def test_base_lr_without_base_batch_is_a_usage_error(monkeypatch, tmp_path):
    _fake_probe(monkeypatch, 80)
    result = run("plan", _model_file(tmp_path), "--target-batch", 8, "--base-lr", "0.1",
                 "-o", tmp_path / "p.json")
    assert result.exit_code == 2
    assert "--base-batch" in result.output


def test_indivisible_target_exits_1_without_traceback(monkeypatch, tmp_path):
    _fake_probe(monkeypatch, 80)
    result = run("plan", _model_file(tmp_path), "--target-batch", 130, "--world-size", 4)
    assert result.exit_code == 1
    assert "use 128 or 132" in result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "plan.json").exists()


def test_pinned_micro_batch_too_large_exits_1(monkeypatch, tmp_path):
    _fake_probe(monkeypatch, 20)
    result = run("plan", _model_file(tmp_path), "--target-batch", 64, "--micro-batch", 32,
                 "--precision", "fp32", "--checkpointing", "off", "-o", tmp_path / "p.json")
    assert result.exit_code == 1
    assert "--micro-batch 32 does not fit" in result.stderr


def test_show_corrupt_plan_exits_1(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    result = run("show", path)
    assert result.exit_code == 1
    assert "not valid JSON" in result.stderr


def test_export_uneven_plan_notes_on_stderr(tmp_path):
    path = save_plan(make_plan(127, 50), tmp_path / "plan.json")
    result = run("export", path, "--to", "hf")
    assert result.exit_code == 0
    assert "note: the plan is uneven" in result.stderr
    assert json.loads(result.stdout)["gradient_accumulation_steps"] == 127


def test_plan_says_what_it_replaced_and_leaves_a_file_that_is_no_plan(mlp_plan, tmp_path):
    # -o defaults to plan.json: a second plan replaced the first without a word, and any
    # plan.json there (another tool's) would have been overwritten.
    _, first = mlp_plan
    out = tmp_path / "plan.json"
    out.write_bytes(first.read_bytes())
    result = run("plan", EXAMPLES / "mlp.py", "--target-batch", 32, "--memory-limit", "64MiB",
                 "--precision", "fp32", "-o", out)
    assert result.exit_code == 0, result.output
    assert (f"plan written to {out} (it replaced the plan for {load_plan(first).workload.source}, "
            f"target batch 64, ") in result.output
    assert load_plan(out).effective_batch == 32
    theirs = tmp_path / "theirs.json"
    theirs.write_text('{"not": "an autotune plan"}')
    result = run("plan", EXAMPLES / "mlp.py", "--target-batch", 32, "--memory-limit", "64MiB", "-o", theirs)
    assert result.exit_code == 1
    assert f"-o {theirs}: the file there is not an autotune plan" in result.output
    assert "settings tried:" not in result.output  # refused before any trial
    assert theirs.read_text() == '{"not": "an autotune plan"}'
