"""The fp16 GradScaler's knobs: recorded in the plan, settable from plan and train, reaching the
scaler of the training loop and DeepSpeed's fp16 block."""

import json

import pytest
import torch
from click.testing import CliRunner

import autotune
from autotune.cli.main import cli
from autotune.errors import ConfigError, PlanFileError
from autotune.planning.export import export_plan
from autotune.planning.planfile import plan_from_dict, plan_from_json, plan_to_json, save_plan
from autotune.precision import GradScalerSettings
from autotune.training.checkpoint import load as load_checkpoint
from plan_helpers import make_plan
import train_helpers


def fp16_plan(**knobs):
    plan = train_helpers.make_plan([4, 4], precision="fp16")
    plan.grad_scaler = GradScalerSettings(**knobs)
    return plan


def test_plan_files_keep_the_knobs_and_older_files_get_torchs_defaults():
    plan = make_plan(64, 64)
    plan.grad_scaler = GradScalerSettings(init_scale=1024.0, growth_factor=1.5, backoff_factor=0.25,
                                          growth_interval=100)
    again = plan_from_json(plan_to_json(plan))
    assert again.grad_scaler == plan.grad_scaler
    older = plan.to_dict()
    del older["grad_scaler"]
    assert plan_from_dict(older).grad_scaler == GradScalerSettings()
    assert GradScalerSettings() == GradScalerSettings(**{
        k: v for k, v in torch.amp.GradScaler("cpu").state_dict().items()
        if k in ("growth_factor", "backoff_factor", "growth_interval")}, init_scale=2.0 ** 16)


@pytest.mark.parametrize("field, value, option", [("growth_factor", 0.9, "--growth-factor"),
                                                  ("backoff_factor", 1.0, "--backoff-factor"),
                                                  ("init_scale", float("inf"), "--init-scale"),
                                                  ("growth_interval", 0, "--growth-interval")])
def test_bad_knobs_name_the_option(field, value, option):
    with pytest.raises(ConfigError, match=option):
        GradScalerSettings(**{field: value})


def test_a_plan_file_with_a_bad_knob_is_refused():
    data = make_plan(64, 64).to_dict()
    data["grad_scaler"]["backoff_factor"] = 1.5
    with pytest.raises(PlanFileError, match="grad_scaler.backoff_factor"):
        plan_from_dict(data)


def test_the_plans_knobs_reach_the_training_scaler():
    # Every step is clean, so the scale grows by growth_factor after every growth_interval steps.
    result = autotune.train(fp16_plan(init_scale=8.0, growth_factor=3.0, growth_interval=1),
                            train_helpers.mlp_workload(dtype=torch.float32), steps=2, progress=False)
    assert result.scaler.is_enabled() and result.skipped_steps == 0
    assert result.scaler.get_scale() == 8.0 * 3.0 * 3.0
    assert result.scaler.get_backoff_factor() == 0.5


def test_train_overrides_the_plans_knobs():
    result = autotune.train(fp16_plan(init_scale=8.0, growth_factor=3.0, growth_interval=1),
                            train_helpers.mlp_workload(dtype=torch.float32), steps=2, progress=False,
                            grad_scaler={"init_scale": 4.0, "growth_interval": 2})
    assert result.scaler.get_scale() == 4.0 * 3.0  # grew once, after its second clean step


def test_cli_plan_records_and_train_overrides(tmp_path, examples_dir, one_thread):
    runner = CliRunner()
    planned = runner.invoke(cli, ["plan", str(examples_dir / "mlp.py"), "--target-batch", "8",
                                  "--device", "cpu", "--precision", "fp32", "--checkpointing", "off",
                                  "--memory-limit", "96MiB", "--init-scale", "256",
                                  "--growth-interval", "10", "-o", str(tmp_path / "plan.json")])
    assert planned.exit_code == 0, planned.output
    knobs = json.loads((tmp_path / "plan.json").read_text())["grad_scaler"]
    assert knobs == {"init_scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                     "growth_interval": 10}
    # fp16 on the CPU trains with an enabled scaler; the checkpoint records its state.
    data = json.loads((tmp_path / "plan.json").read_text())
    data["precision"] = "fp16"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    trained = runner.invoke(cli, ["train", str(examples_dir / "mlp.py"), "--plan", str(tmp_path / "plan.json"),
                                  "--steps", "1", "--device", "cpu", "--growth-factor", "4",
                                  "--growth-interval", "1", "--checkpoint-dir", str(tmp_path / "ck"), "-q"])
    assert trained.exit_code == 0, trained.output
    saved = load_checkpoint(tmp_path / "ck" / "checkpoint.pt")  # the loop's own reader of its own file
    assert saved["scaler"]["growth_factor"] == 4.0 and saved["scaler"]["growth_interval"] == 1
    assert saved["scaler"]["scale"] in (256.0 * 4.0, 256.0 * 0.5)  # grew, or backed off on inf
    bad = runner.invoke(cli, ["train", str(examples_dir / "mlp.py"), "--plan", str(tmp_path / "plan.json"),
                              "--steps", "1", "--backoff-factor", "2"])
    assert bad.exit_code == 2 and "--backoff-factor" in bad.output


def test_deepspeed_fp16_block_carries_the_knobs():
    plan = make_plan(64, 64)
    plan.precision = "fp16"
    plan.grad_scaler = GradScalerSettings(init_scale=1024.0, growth_interval=500)
    exported = export_plan(plan, "deepspeed")
    assert exported.config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10,
                                       "loss_scale_window": 500}
    assert not any("DeepSpeed" in n and "power of two" in n for n in exported.notes)
    plan.grad_scaler = GradScalerSettings(init_scale=1000.0, growth_factor=3.0)
    notes = " ".join(export_plan(plan, "deepspeed").notes)
    assert "2^10" in notes and "growth_factor 3" in notes
    plan.precision = "bf16"
    assert export_plan(plan, "deepspeed").config["fp16"] == {"enabled": False, "loss_scale": 0}


def test_other_exports_say_where_the_knobs_go():
    plan = make_plan(64, 64)
    plan.precision = "fp16"
    assert not any("GradScaler" in n for n in export_plan(plan, "hf").notes)  # torch's defaults
    plan.grad_scaler = GradScalerSettings(init_scale=1024.0)
    for target in ("hf", "lightning", "accelerate"):
        assert any("torch.amp.GradScaler(**{'init_scale': 1024.0" in n
                   for n in export_plan(plan, target).notes), target
