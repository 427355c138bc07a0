"""`autotune verify`: confirm a plan on the device at hand, or re-plan and say how far off it was."""

import pytest
from click.testing import CliRunner

import autotune
from autotune.cli.main import cli
from autotune.planning.planfile import load_plan, save_plan
from autotune.orchestration.verify import verify_plan

from conftest import EXAMPLES

MLP = EXAMPLES / "mlp.py"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    # fp32, checkpointing off: the MLP at 64MiB plans 683 + 683 + 682 (windows: the second
    # micro-step holds the first one's gradients).
    plan = autotune.plan(MLP, target_batch=2048, device="cpu", memory_limit="64MiB",
                         precision="fp32", checkpointing="off")
    path = tmp_path_factory.mktemp("verify") / "plan.json"
    save_plan(plan, path)
    return path


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_confirmed_on_the_device_it_was_planned_for(plan_file):
    result = verify_plan(plan_file, device="cpu", memory_limit="64MiB", steps=2)
    assert result.confirmed and result.new_plan is None
    # The CPU backend measures the very step the probe measured.
    assert abs(result.error_fraction) < 0.01
    assert result.measured_peak_bytes <= result.usable_bytes


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_a_smaller_device_re_plans_and_says_how_far_off(plan_file):
    plan = load_plan(plan_file)
    # A budget the plan's window fits, but not less the headroom (10%).
    result = verify_plan(plan_file, device="cpu", memory_limit=int(plan.predicted_peak_bytes / 0.95),
                         steps=1)
    assert not result.confirmed
    # It ran (the budget holds it) but passes the budget less the headroom; the prediction was right.
    assert result.usable_bytes < result.measured_peak_bytes <= result.budget_bytes
    assert abs(result.error_fraction) < 0.01
    new = result.new_plan
    assert new.effective_batch == plan.effective_batch and new.micro_batch < plan.micro_batch
    assert new.precision == plan.precision and not new.estimated


def test_a_re_plan_keeps_the_plans_layout(plan_file, monkeypatch):
    import dataclasses

    from autotune import Layout
    from autotune.orchestration import verify

    asked = {}
    monkeypatch.setattr(verify, "make_plan", lambda workload, **kwargs: asked.update(kwargs))
    layout = Layout(tp=2, pp=2, pp_schedule="interleaved-1f1b", stages_per_rank=2)
    plan = dataclasses.replace(load_plan(plan_file), world_size=8, parallel=layout)
    verify._replan(plan, None, device="cpu", budget=2**30)
    assert {k: asked[k] for k in ("tp", "cp", "pp", "stages_per_rank")} == dict(tp=2, cp=1, pp=2, stages_per_rank=2)
    assert Layout.from_dict(dict(tp=2, pp=2, pp_schedule=asked["pp_schedule"], stages_per_rank=2)) == layout


def test_an_estimated_plan_reports_the_estimate_error(tmp_path):
    estimated = autotune.plan(MLP, target_batch=64, gpu="a100-40gb", precision="fp32")
    path = save_plan(estimated, tmp_path / "a100.json")
    result = verify_plan(path, device="cpu", memory_limit="1GiB", steps=1)
    assert result.confirmed  # the CPU run has no foreach transient: a little below the estimate
    assert result.error_bytes < 0 and abs(result.error_fraction) < 0.1


def test_cli_exit_0_when_confirmed(plan_file):
    result = run("verify", plan_file, "--device", "cpu", "--memory-limit", "64MiB", "--steps", 1)
    assert result.exit_code == 0, result.output
    assert "confirmed" in result.output and "off by" in result.output
    # Without --memory-limit the device offers half the RAM, and the check runs within the
    # plan's 64 MiB: the device line said "budget 10.67 GiB" and nothing of the plan's.
    result = run("verify", plan_file, "--device", "cpu", "--steps", 1)
    assert result.exit_code == 0, result.output
    assert "(checked within the plan's budget of 64.00 MiB; this device's is " in result.output


@pytest.mark.slow  # 15-30 s: the fast suite is at its 10 minutes
def test_cli_exit_1_when_re_planned_and_writes_only_with_o(plan_file, tmp_path):
    result = run("verify", plan_file, "--device", "cpu", "--memory-limit", "56MiB", "--steps", 1)
    assert result.exit_code == 1
    assert "NOT confirmed" in result.output and "re-planned" in result.output
    # Both splits as plan prints them (uneven ones in parentheses: "43 × 3 = 128" before).
    line = next(line for line in result.output.splitlines() if line.startswith("re-planned:"))
    assert "(683 + 683 + 682) over 3 accumulation steps × 1 rank = 2048)" in line, line
    assert line.startswith("re-planned: (") and " × 1 rank = 2048 (was (" in line, line
    assert "pass -o FILE" in result.output
    out = tmp_path / "new.json"
    result = run("verify", plan_file, "--device", "cpu", "--memory-limit", "56MiB", "--steps", 1,
                 "-o", out)
    assert result.exit_code == 1 and load_plan(out).effective_batch == 2048


def test_cli_nothing_fits_here_still_reports(plan_file):
    result = run("verify", plan_file, "--device", "cpu", "--memory-limit", "20MiB", "--steps", 1)
    assert result.exit_code == 1
    assert "out of memory" in result.output and "re-plan failed" in result.output


def test_an_offloaded_plan_is_measured_on_the_cpu_as_it_was_planned():
    # fsdp-offload keeps the shards, their gradients and the optimizer state and step in host
    # memory, which on the CPU is the same memory as the "device": verify leaves it out of the
    # device's peak as the plan's estimate and the training loop's meter do. It measured all of
    # it before (27.0 MB against the plan's 21.4 on tiny_lm, world 2).
    lm = EXAMPLES / "tiny_lm.py"
    plan = autotune.plan(lm, target_batch=8, world_size=2, sharding="fsdp-offload", memory_limit="40MiB",
                         device="cpu", precision="fp32", checkpointing="off")
    result = verify_plan(plan, device="cpu", steps=1, replan=False)
    assert result.confirmed and result.error_bytes == 0
    # The same window without offload holds the shards on the device: more.
    fsdp = autotune.plan(lm, target_batch=8, world_size=2, sharding="fsdp", memory_limit="40MiB",
                         device="cpu", precision="fp32", checkpointing="off", micro_batch=plan.micro_batch)
    assert verify_plan(fsdp, device="cpu", steps=1, replan=False).measured_peak_bytes > result.measured_peak_bytes


def test_a_changed_model_file_is_refused_naming_the_plan_and_the_whole_re_plan(plan_file, tmp_path):
    # It said "plan file <plan>" and suggested re-planning without --memory-limit (half the RAM).
    import json
    import shutil

    model = tmp_path / "mlp.py"
    shutil.copy(MLP, model)
    data = json.loads(plan_file.read_text())
    data["workload"]["source"] = str(model)
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    model.write_text(model.read_text() + "\n# edited after planning\n")
    result = run("verify", changed)
    assert result.exit_code == 1, result.output
    assert f"plan file {changed} was made for another version of the model" in result.output
    assert (f"re-plan with autotune plan {model} --target-batch 2048 --memory-limit 64MiB"
            in " ".join(result.output.split()))


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_verify_plan_refuses_steps_that_measure_nothing(plan_file, steps):
    # steps=0 measured nothing, so a plan that fits read as not fitting and was re-planned.
    with pytest.raises(autotune.ConfigError, match="verify runs the plan's window for at least one real step"):
        verify_plan(plan_file, steps=steps)
