"""Planning for a GPU profile without the device (--gpu): budget, precision, estimate, errors."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import autotune
from autotune.cli.main import cli
from autotune.errors import ConfigError, EstimateUnavailable
from autotune.planning.planfile import load_plan, plan_from_dict, plan_to_json
from autotune.gpus.catalog import load_profile
from autotune.gpus.fixed_costs import nccl_buffer_bytes

from conftest import EXAMPLES

MLP = EXAMPLES / "mlp.py"

MASKED_MODEL = (
    "import torch\n"
    "def build_model():\n    return torch.nn.Linear(4, 1)\n"
    "def make_batch(n):\n    return torch.randn(n, 4)\n"
    "def loss_fn(model, x):\n    return model(x[x[:, 0] > 0]).sum()\n"
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def a100_plan():
    return autotune.plan(MLP, target_batch=512, world_size=8, gpu="a100-40gb")


def test_budget_comes_from_the_profile_and_the_plan_is_estimated(a100_plan):
    profile = load_profile("a100-40gb")
    assert a100_plan.estimated
    assert a100_plan.device.kind == "cuda" and a100_plan.device.name == profile.name
    # What lives outside torch's allocator (the CUDA context, NCCL's buffers for 8 ranks) is kept
    # out of the budget; fragmentation is modelled, so no allocator reserve is.
    assert a100_plan.budget_bytes == profile.memory_bytes - profile.cuda_context_bytes \
        - nccl_buffer_bytes(8)
    assert a100_plan.effective_batch == 512 and a100_plan.micro_batches == [64]
    assert a100_plan.precision == "bf16" and "profile supports bf16" in a100_plan.reasons["precision"]
    assert any("autotune verify" in w for w in a100_plan.warnings)


def test_estimated_plan_round_trips_and_old_files_load(a100_plan):
    data = json.loads(plan_to_json(a100_plan))
    assert data["estimated"] is True and plan_from_dict(data).estimated
    del data["estimated"]  # a file written before the field existed
    assert plan_from_dict(data).estimated is False


def test_t4_profile_gives_fp16_under_auto(tmp_path):
    out = tmp_path / "t4.json"
    result = CliRunner().invoke(cli, ["plan", str(MLP), "--target-batch", "64", "--gpu", "t4",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.precision == "fp16" and plan.estimated
    assert "lacks bf16" in plan.reasons["precision"]
    shown = CliRunner().invoke(cli, ["show", str(out)])
    assert shown.exit_code == 0 and "estimated on fake tensors" in shown.output


@pytest.mark.slow
def test_estimate_for_cuda_includes_the_foreach_optimizer_transient():
    # The same model on a CPU-like estimate (no foreach) needs less at the optimizer step.
    cuda = autotune.plan(MLP, target_batch=32, gpu="a100-40gb", precision="fp32")
    cpu = autotune.plan(MLP, target_batch=32, device="cpu", memory_limit="1GiB", precision="fp32")
    assert cuda.predicted_peak_bytes > cpu.predicted_peak_bytes


def test_a_precision_the_profile_lacks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--precision bf16: the NVIDIA T4 \(--gpu t4\) does not "
                                          r"support bf16; use auto or one of fp32, fp16"):
        autotune.plan(MLP, target_batch=64, gpu="t4", precision="bf16")


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"'z80'.*not bundled.*t4.*a100-40gb.*h100-80gb"):
        autotune.plan(MLP, target_batch=64, gpu="z80")
    result = CliRunner().invoke(cli, ["plan", str(MLP), "--target-batch", "64", "--gpu", "z80"])
    assert result.exit_code == 2 and "t4" in result.output


# --optimize throughput with --gpu ranks by prediction (tests/test_plan_predicted.py).
@pytest.mark.parametrize("option", [{"device": "cpu"}, {"memory_limit": "1GiB"}])
def test_gpu_with_a_device_option_is_a_config_error(option):
    with pytest.raises(ConfigError, match=r"--gpu"):
        autotune.plan(MLP, target_batch=64, gpu="t4", **option)


def test_model_fake_tensors_cannot_run_fails_clearly(tmp_path):
    model_file = tmp_path / "masked.py"
    model_file.write_text(MASKED_MODEL)
    with pytest.raises(EstimateUnavailable, match=r"--gpu t4 plans from memory estimates.*cannot be "
                                                  r"estimated under fake tensors.*Plan on the device"):
        autotune.plan(model_file, target_batch=64, gpu="t4")
    result = CliRunner().invoke(cli, ["plan", str(model_file), "--target-batch", "64", "--gpu", "t4",
                                      "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 1 and "Plan on the device" in result.output
    assert not (tmp_path / "p.json").exists()


def test_a_profile_that_nccl_leaves_nothing_of_is_refused_naming_the_sizes(monkeypatch):
    monkeypatch.setenv("NCCL_BUFFSIZE", str(2**30))  # 32 channels of 1 GiB: more than a T4 holds
    with pytest.raises(ConfigError, match=r"--gpu t4: .*16(\.00)? GiB less .*NCCL buffers \(for 2 ranks\) "
                                          r"leaves nothing for training.*NCCL_BUFFSIZE"):
        autotune.plan(EXAMPLES / "mlp.py", target_batch=64, world_size=2, gpu="t4")


def test_gpu_with_a_memory_limit_is_refused_naming_the_limit_as_typed():
    # The CLI passes the limit on in bytes: the error read "--memory-limit 67108864".
    from click.testing import CliRunner

    from autotune.cli.main import cli

    mlp = Path(__file__).resolve().parent.parent / "examples" / "mlp.py"
    result = CliRunner().invoke(cli, ["plan", str(mlp), "--target-batch", "64", "--memory-limit", "64MiB",
                                      "--gpu", "h100-80gb"])
    assert result.exit_code == 2, result.output
    assert "--memory-limit 64MiB and --gpu h100-80gb both name the device to plan for" in result.output
