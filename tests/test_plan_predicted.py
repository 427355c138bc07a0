"""``plan --optimize throughput --gpu``: settings ranked by predicted throughput, the prediction
recorded in the plan (file, ``autotune show``, the HTML report), and the options that shape it."""

import json

import pytest
from click.testing import CliRunner

import autotune

from autotune.cli.main import cli
from autotune.gpus.catalog import load_profile
from autotune.gpus.fixed_costs import nccl_buffer_bytes
from autotune.planning.planfile import load_plan, plan_to_json
from autotune.planning.types import Plan
from autotune.report.html import report_page
from autotune.timing.comm import network_from_profile
from autotune.timing.roofline import speed_for_profile
from autotune.timing.window import predict_window_time
from autotune.workload import load_workload

from conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    """An FSDP2 plan over two hosts of 2 H100s, ranked by prediction (one CLI run for the module)."""
    out = tmp_path_factory.mktemp("predicted") / "plan.json"
    result = CliRunner().invoke(cli, ["plan", MLP, "--target-batch", "64", "--world-size", "4", "--gpus-per-node", "2",
                                      "--gpu", "h100-80gb", "--optimize", "throughput",
                                      "--sharding", "fsdp", "--network-gbps", "200", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return result.output, load_plan(out), json.loads(out.read_text())


def test_the_plan_records_the_predicted_window(ranked):
    output, plan, data = ranked
    t = plan.step_time
    assert plan.optimize == "throughput" and plan.estimated and str(plan.sharding) == "fsdp"
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.bubble_s)
    assert t.samples_per_s == pytest.approx(plan.per_device_batch / t.step_s)
    assert t.exposed_comm_s > 0 and t.comm_s >= t.exposed_comm_s  # 4 ranks over two hosts
    assert 0 < t.mfu < 1
    assert set(data["step_time"]) >= {"step_s", "compute_s", "exposed_comm_s", "bubble_s", "recompute_s",
                                      "samples_per_s", "tokens_per_s", "mfu"}
    # The same window predicted directly: the plan states what the model predicts, nothing else.
    profile = load_profile("h100-80gb")
    direct = predict_window_time(load_workload(MLP), plan.micro_batches, speed=speed_for_profile(profile),
                                 precision=plan.precision, checkpointing=plan.checkpointing,
                                 sharding="fsdp", world_size=4, shard_group=plan.shard_group,
                                 network=network_from_profile(profile, network_gbps=200, gpus_per_node=2),
                                 reduce_every_micro_step=plan.reduce_every_micro_step)
    assert direct == t
    assert "step time:" in output and "ranked by predicted throughput" in output


def test_the_reason_says_what_was_ranked_and_why_the_winner_won(ranked):
    _, plan, _ = ranked
    why = plan.reasons["throughput"]
    assert why.startswith(f"ranked {len(plan.predicted)} configuration")
    assert "200 Gb/s per GPU between hosts" in why and "hosts of 2" in why
    assert plan.predicted[0].label() in why
    speeds = [c.step_time.samples_per_s for c in plan.predicted]
    assert speeds == sorted(speeds, reverse=True)
    assert "the fastest predicted" in plan.reasons["checkpointing"]


def test_new_fields_round_trip_and_are_optional(ranked):
    _, plan, data = ranked
    again = Plan.from_dict(json.loads(plan_to_json(plan)))
    assert again.step_time == plan.step_time
    assert [c.to_dict() for c in again.predicted] == [c.to_dict() for c in plan.predicted]
    older = {k: v for k, v in data.items() if k not in ("step_time", "predicted")}
    assert Plan.from_dict(older).step_time is None


def test_show_and_report_draw_the_split(ranked, tmp_path):
    _, plan, _ = ranked
    path = tmp_path / "p.json"
    path.write_text(plan_to_json(plan))
    shown = CliRunner().invoke(cli, ["show", str(path)])
    assert shown.exit_code == 0 and "exposed communication" in shown.output
    page = report_page(plan)
    assert 'id="step-time"' in page and 'id="predicted"' in page
    pytest.importorskip("matplotlib")
    assert all(f"step-part-{i}" in page for i in range(4))


def test_host_options_need_a_gpu_and_sensible_values(tmp_path):
    runner = CliRunner()
    base = ["plan", MLP, "--target-batch", "8", "-o", str(tmp_path / "p.json")]
    result = runner.invoke(cli, base + ["--network-gbps", "100"])
    assert result.exit_code == 2 and "--network-gbps 100" in result.output and "--gpu NAME" in result.output
    result = runner.invoke(cli, base + ["--gpu", "h100-80gb", "--gpus-per-node", "0"])
    assert result.exit_code == 2


SMALL_GPU = """\
name = "Small test GPU"
memory_bytes = 67_108_864
bf16 = true
fp16 = true
peak_tflops_fp32 = 20
peak_tflops_fp16 = 160
peak_tflops_bf16 = 160
memory_bandwidth_gb_per_s = 900
cuda_context_bytes = 0
allocator_reserve_bytes = 0
gpu_link_gb_per_s = 32
gpu_link_latency_us = 5.7
gpus_per_node = 8
source = "a test profile"
"""


@pytest.mark.slow  # two fake searches over micro-batches in the thousands: about 30 s here
def test_layouts_that_fit_are_ranked_and_the_fastest_is_planned(tmp_path):
    # mlp.py holds 40 MiB per AdamW replica (+ 10 MiB of DDP buckets, + two cuBLAS handles'
    # workspaces and the caching allocator's segments, which --gpu plans model): in 133 MiB a
    # replica leaves accumulation steps to save, so FSDP2 over both ranks is probed and ranked
    # beside it.
    profile = tmp_path / "small.toml"
    # NCCL's buffers for 2 ranks live outside torch's allocator: on top of the 133 MiB.
    profile.write_text(SMALL_GPU.replace("67_108_864", str(133 * 2**20 + nccl_buffer_bytes(2))))
    plan = autotune.plan(MLP, target_batch=8192, world_size=2, gpu=str(profile), optimize="throughput",
                         precision="fp32", checkpointing="off")
    layouts = {c.layout for c in plan.predicted}
    assert layouts == {"ddp", "fsdp (shard group 2)"}
    best = max(plan.predicted, key=lambda c: c.step_time.samples_per_s)
    assert plan.chosen_layout == best.layout and plan.micro_batches == best.micro_batches
    assert plan.reasons["sharding"].startswith(f"{best.layout}: the fastest predicted of ")
    other = next(c for c in plan.predicted if c.layout != best.layout)
    assert f"the next, {other.label()}" in plan.reasons["throughput"]


@pytest.mark.slow  # two ranked GPU-profile searches, about 25 s here
def test_a_ranked_planner_run_again_ranks_the_same_settings():
    # A layout search runs a layout's planner again for its deferred sync-on-last window. The
    # ranking built its plan as a request for the winner's settings and kept that request:
    # run again, checkpointing was no longer "auto", so only "off" was probed, which fits
    # nowhere here ("no configuration fits": 70B's TP 2 dropped out of its search that way).
    from autotune.orchestration.planner import _Planner, inspect_workload
    from autotune.orchestration.request import PlanOptions

    workload = load_workload(str(ROOT / "examples" / "tiny_lm.py"))
    options = PlanOptions(target_batch=128, world_size=2, gpu="h100-80gb", optimize="throughput",
                          headroom=0.999, sharding="fsdp", eval_batch=False)
    planner = _Planner(workload, options, inspected=inspect_workload(workload), estimable=set())
    first = planner.run()
    assert first.checkpointing.label == "on" and first.accumulation_steps > 1
    again = planner.run()
    assert (again.micro_batches, again.checkpointing, again.step_time) == (
        first.micro_batches, first.checkpointing, first.step_time)
    assert again.reasons["checkpointing"] == first.reasons["checkpointing"]
