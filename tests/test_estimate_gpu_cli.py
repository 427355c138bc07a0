"""``autotune estimate --gpu NAME``: one option for a GPU target, the modelled reserved peak without
``--time`` and the step time with it; ``--cuda NAME`` still runs, as a deprecated alias."""

import json

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.gpus.catalog import load_profile
from autotune.gpus.fixed_costs import nccl_buffer_bytes
from autotune.probing.estimate import estimate_cuda_peaks

from conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py")
BASE = ["estimate", MLP, "--micro-batch", "8"]


def test_gpu_gives_the_modelled_reserved_peak_and_what_lives_outside_torch():
    profile = load_profile("h100-80gb")
    args = BASE + ["--gpu", "h100-80gb", "--world-size", "4"]  # four DDP replicas: NCCL's buffers
    result = CliRunner().invoke(cli, args + ["--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)["8"]
    tensors, reserved = estimate_cuda_peaks(MLP, [8], gpu_name=profile.name, world_size=4)[8]
    assert (answer["allocated_bytes"], answer["reserved_bytes"]) == (tensors, reserved)
    assert reserved > tensors
    assert answer["outside_torch_bytes"] == profile.cuda_context_bytes + nccl_buffer_bytes(4)
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0 and "warning" not in text.output
    assert profile.name in text.output and "reserved/allocated" in text.output
    assert "outside torch" in text.output and "of 80.00 GiB" in text.output


def test_gpu_with_time_gives_the_step_time_on_that_gpu():
    result = CliRunner().invoke(cli, BASE + ["--gpu", "h100-80gb", "--time", "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)["8"]
    assert answer["device"] == load_profile("h100-80gb").name and answer["seconds"] > 0


def test_cuda_still_runs_with_a_one_line_deprecation_warning():
    result = CliRunner().invoke(cli, BASE + ["--cuda", "H100", "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)["8"]  # stdout stays the JSON it was
    assert (answer["allocated_bytes"], answer["reserved_bytes"]) == estimate_cuda_peaks(
        MLP, [8], gpu_name="H100")[8]
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "--cuda is deprecated; use --gpu NAME" in warning[0]


def test_cuda_with_gpu_or_time_is_a_usage_error_naming_the_fix():
    both = CliRunner().invoke(cli, BASE + ["--cuda", "H100", "--gpu", "h100-80gb"])
    assert both.exit_code == 2 and "drop --cuda" in both.output
    timed = CliRunner().invoke(cli, BASE + ["--cuda", "H100", "--time"])
    assert timed.exit_code == 2 and "--time --gpu NAME" in timed.output


def test_an_unknown_gpu_names_the_option():
    result = CliRunner().invoke(cli, BASE + ["--gpu", "no-such-gpu"])
    assert result.exit_code in (1, 2) and "no-such-gpu" in result.output


def test_gpu_estimates_one_step_so_accumulation_steps_is_refused():
    result = CliRunner().invoke(cli, BASE + ["--gpu", "h100-80gb", "--accumulation-steps", "2"])
    assert result.exit_code == 2 and "--accumulation-steps 2 with --gpu" in result.output


@pytest.mark.parametrize("degrees", [
    ("tp", 2),
    # 8 s, and pipeline estimates run best in a process of their own (.ci/run's note).
    pytest.param(("pp", 2), marks=pytest.mark.slow),
])
def test_time_counts_one_rank_of_a_model_parallel_layout(degrees):
    # --time under --tp / --pp: the compute of one rank's step (its local shards; a pipeline's
    # busiest stage per micro-batch), communication and bubble not included, as the header says.
    from autotune.distributed.layout import Layout
    from autotune.distributed.pipeline import fake_pipeline_supported
    from autotune.timing.predict import predict_step_time

    name, degree = degrees
    if name == "pp" and not fake_pipeline_supported():
        pytest.skip("torch 2.13's schedules read a tensor's value: no fake pipeline")
    lm = str(ROOT / "examples" / "tiny_lm.py")
    base = ["estimate", lm, "--micro-batch", "4", "--gpu", "h100-80gb", "--time", "--world-size", "2",
            "--sharding", "fsdp"]
    whole = json.loads(CliRunner().invoke(cli, base + ["--json"]).stdout)["4"]
    result = CliRunner().invoke(cli, base + [f"--{name}", str(degree), "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)["4"]
    assert 0 < answer["flops"] < whole["flops"]  # a rank computes part of the model
    expected = predict_step_time(lm, 4, gpu="h100-80gb", sharding="fsdp", world_size=2,
                                 parallel=Layout(**{name: degree}))[4]
    assert answer["flops"] == expected.costs.total_flops and answer["seconds"] == expected.seconds
    if name == "tp":
        text = CliRunner().invoke(cli, base + ["--tp", "2"])
        assert text.exit_code == 0, text.output
        assert "one rank of FSDP 1 × TP 2; no communication, no pipeline bubble" in text.output


def test_a_precision_the_gpu_lacks_is_refused_by_estimate_as_by_plan(tmp_path):
    # estimate --gpu t4 --precision bf16 printed a peak; plan refused the pair, after loading the
    # model (17 s for GPT-2): now both refuse, plan before it reads the model file.
    import autotune

    tiny = ROOT / "examples" / "tiny_lm.py"
    for command in (["estimate", tiny, "--micro-batch", 4], ["plan", tiny, "--target-batch", 8, "-o", tmp_path / "p.json"]):
        result = CliRunner().invoke(cli, [str(a) for a in command] + ["--gpu", "t4", "--precision", "bf16"])
        assert result.exit_code == 2, result.output
        assert "--precision bf16: the NVIDIA T4 (--gpu t4) does not support bf16" in result.output
    with pytest.raises(autotune.ConfigError, match="does not support bf16"):
        autotune.plan(tmp_path / "no_such_model.py", target_batch=8, gpu="t4", precision="bf16")
