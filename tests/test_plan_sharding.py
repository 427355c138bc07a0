"""Sharding as a planning setting: the pure choice, the plan() flow, the CLI and the plan file."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.errors import ConfigError, PlanError
from autotune.orchestration.planner import fingerprint_workload, plan
from autotune.planning.planfile import load_plan, save_plan
from autotune.planning.policy import PlanRequest, build_plan, sharding_worth_estimating
from autotune.planning.types import SettingTried
from autotune.distributed.sharding import Sharding
from autotune.workload import Workload, load_workload
from plan_helpers import device, fingerprint, linear_probe, setting

MiB = 1 << 20


def _sharded(max_micro, group, **kwargs):
    tried = setting(linear_probe(max_micro), headroom=0.0, **kwargs)
    tried.sharding, tried.shard_group = Sharding.FSDP, group
    return tried


def _plan(target, world, *settings, sharding="auto"):
    request = PlanRequest(target_batch=target, world_size=world, checkpointing="off", headroom=0.0,
                          sharding=sharding)
    return build_plan(request, workload=fingerprint(), settings=list(settings), device=device(),
                      versions={"autotune": "0.1.0", "torch": "2.x", "cuda": None})


def test_a_model_that_fits_nowhere_replicated_gets_a_sharded_plan():
    ddp = setting(None, error="does not fit at micro-batch 1")
    plan_ = _plan(64, 4, ddp, _sharded(8, 2), _sharded(16, 4))
    assert plan_.sharding is Sharding.FSDP and plan_.shard_group == 4
    assert plan_.micro_batches == [16]
    assert "nothing fits replicated" in plan_.reasons["sharding"]
    assert plan_.ddp_bucket_bytes == 0  # the sharded step counted its own buffers


def test_ties_go_to_the_least_communication():
    # ddp needs 2 steps; fsdp on groups of 2 and 4 both need 1: the smaller group wins.
    plan_ = _plan(64, 4, setting(linear_probe(8), headroom=0.0), _sharded(16, 2), _sharded(20, 4))
    assert (plan_.sharding, plan_.shard_group, plan_.accumulation_steps) == (Sharding.FSDP, 2, 1)
    assert "cuts accumulation steps from 2 (ddp) to 1" in plan_.reasons["sharding"]
    # Where ddp reaches as few steps, it wins over any sharding.
    plan_ = _plan(64, 4, setting(linear_probe(16), headroom=0.0), _sharded(16, 4))
    assert plan_.sharding is Sharding.DDP and plan_.shard_group is None
    assert "as many accumulation steps" in plan_.reasons["sharding"]


def test_sharding_is_estimated_only_where_it_can_save_steps():
    request = PlanRequest(target_batch=64, world_size=4, sharding="auto")
    assert sharding_worth_estimating([setting(linear_probe(8), headroom=0.0)], request)
    assert not sharding_worth_estimating([setting(linear_probe(16, upper=16), headroom=0.0)], request)
    one_rank = PlanRequest(target_batch=64, world_size=1, sharding="auto")
    assert not sharding_worth_estimating([setting(None, error="no")], one_rank)
    pinned = PlanRequest(target_batch=64, world_size=4, sharding="ddp")
    assert not sharding_worth_estimating([setting(None, error="no")], pinned)


def test_nothing_fits_anywhere_names_every_layout():
    ddp = setting(None, error="ddp does not fit")
    fsdp = SettingTried(precision="fp32", checkpointing=False, error="fsdp does not fit",
                        sharding="fsdp", shard_group=4)
    with pytest.raises(PlanError, match=r"fp32, checkpointing off: ddp does not fit; fp32, "
                                        r"checkpointing off, fsdp \(shard group 4\): fsdp does not fit"):
        _plan(64, 4, ddp, fsdp)


def test_a_replica_that_fits_only_without_its_ddp_buckets_says_so():
    # Micro-batch 1 peaks at 110 MiB of 1000; DDP's gradient buckets (the model's 900 MiB of
    # parameters) push it over: the message names them and points at sharding.
    params = 900 * MiB
    ddp = setting(linear_probe(1), headroom=0.0, extra=params)
    request = PlanRequest(target_batch=64, world_size=4, checkpointing="off", headroom=0.0,
                          sharding="ddp")
    with pytest.raises(PlanError) as raised:
        build_plan(request, workload=fingerprint(param_bytes=params), settings=[ddp], device=device(),
                   versions={"autotune": "0.1.0", "torch": "2.x", "cuda": None})
    message = str(raised.value)
    assert "peak 110.00 MiB plus 900.00 MiB of DDP gradient buckets against 1000.00 MiB" in message
    assert "--sharding auto (or fsdp) shards the model" in message


def test_plan_file_keeps_sharding_and_the_settings_layouts(tmp_path):
    plan_ = _plan(64, 4, setting(None, error="no"), _sharded(16, 4))
    path = tmp_path / "plan.json"
    save_plan(plan_, path)
    data = json.loads(path.read_text())
    assert data["sharding"] == "fsdp" and data["shard_group"] == 4
    assert [s["sharding"] for s in data["settings"]] == ["ddp", "fsdp"]
    loaded = load_plan(path)
    assert loaded.sharding is Sharding.FSDP and loaded.chosen_setting.shard_group == 4
    # Files written before the layouts were recorded still load as ddp settings.
    for s in data["settings"]:
        del s["sharding"], s["shard_group"]
    path.write_text(json.dumps(data))
    assert all(s.sharding is Sharding.DDP for s in load_plan(path).settings)


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_plan_shards_a_model_that_does_not_fit_replicated(examples_dir, one_thread):
    # mlp.py: 10 MiB of parameters, so AdamW needs 40 MiB per replica: nothing fits 40 MiB with
    # the DDP buckets, one rank of 4 under FSDP2 holds a quarter.
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="40MiB", precision="fp32", checkpointing="off")
    assert result.sharding is Sharding.FSDP and result.micro_batches == [16]
    ddp = [s for s in result.settings if s.sharding is Sharding.DDP]
    assert ddp and all(s.probe is None for s in ddp)
    assert result.predicted_peak_bytes <= 36 * MiB
    assert "nothing fits replicated" in result.reasons["sharding"]
    # The smallest shard group that reaches one step: groups of 2 hold half the model.
    assert result.shard_group == 2


def test_explicit_sharding_and_shard_group(examples_dir, one_thread):
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="64MiB", precision="fp32", checkpointing="off", sharding="fsdp")
    assert (result.sharding, result.shard_group) == (Sharding.FSDP, 4)
    assert result.reasons["sharding"] == "fsdp (shard group 4) as requested"
    assert [s.sharding for s in result.settings] == [Sharding.FSDP]
    with pytest.raises(ConfigError, match="shard_group=3 does not divide world_size=4"):
        plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
             memory_limit="64MiB", sharding="fsdp", shard_group=3)
    with pytest.raises(ConfigError, match="sharding='zero' is not a sharding"):
        plan(examples_dir / "mlp.py", target_batch=64, world_size=4, sharding="zero")


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_replicated_plans_do_not_estimate_sharding_when_a_replica_reaches_the_share(examples_dir,
                                                                                      one_thread):
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="256MiB", precision="fp32", checkpointing="off")
    assert result.sharding is Sharding.DDP
    assert [s.sharding for s in result.settings] == [Sharding.DDP]
    assert "sharding would only add communication" in result.reasons["sharding"]


def test_cli_plan_prints_the_sharding_and_why(examples_dir, tmp_path, one_thread):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(examples_dir / "mlp.py"), "--target-batch", "64",
                                      "--world-size", "4", "--device", "cpu", "--memory-limit",
                                      "40MiB", "--precision", "fp32", "--checkpointing", "off",
                                      "--shard-group", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "sharding:     fsdp, shard group 4 (auto: fsdp (shard group 4), because nothing fits " \
           "replicated" in result.output
    assert "fsdp (shard group 4)" in result.output.split("split:")[0]  # the settings table
    assert json.loads(out.read_text())["sharding"] == "fsdp"
    bad = CliRunner().invoke(cli, ["plan", str(examples_dir / "mlp.py"), "--target-batch", "64",
                                   "--sharding", "zero3"])
    assert bad.exit_code == 2


def test_cli_estimate_one_rank_of_a_world(examples_dir, one_thread):
    args = ["estimate", str(examples_dir / "mlp.py"), "--micro-batch", "4", "--json"]
    replica = json.loads(CliRunner().invoke(cli, args).output)["4"]
    result = CliRunner().invoke(cli, [*args, "--sharding", "fsdp", "--world-size", "4"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["4"] < replica


def test_fingerprint_never_materialises_the_weights():
    import resource

    import torch

    # 2**29 parameters: 2 GiB if it were built for real.
    workload = Workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(1 << 16, 1 << 13),
                                                          torch.nn.Linear(1 << 13, 1 << 0)),
                        make_batch=lambda n: torch.zeros(n, 1 << 16))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    found = fingerprint_workload(workload)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert found.param_count == (1 << 29) + (1 << 13) + (1 << 13) + 1
    assert found.param_bytes == 4 * found.param_count
    assert grown_kib < 256 * 1024  # well under the 2 GiB a real build would touch


@pytest.mark.slow
def test_a_memory_limited_fsdp_plan_fits_a_real_four_rank_gloo_run(examples_dir, tmp_path):
    from fsdp_helpers import real_fsdp_fits

    limit = 40 * MiB
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit=limit, precision="fp32", checkpointing="off")
    assert result.sharding is Sharding.FSDP
    with pytest.raises(Exception, match="does not fit"):  # a replica does not fit at 1
        plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
             memory_limit=limit, precision="fp32", checkpointing="off", sharding="ddp")
    fits = real_fsdp_fits(examples_dir / "mlp.py", 4, [result.micro_batch], tmp_path,
                          memory_limit=limit, shard_group=result.shard_group)
    assert all(all(rank) for rank in fits[result.micro_batch]), fits


@pytest.mark.slow
def test_verify_runs_a_sharded_plan_as_one_of_its_ranks(examples_dir, one_thread):
    from autotune.orchestration.verify import verify_plan

    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="40MiB", precision="fp32", checkpointing="off")
    checked = verify_plan(result, device="cpu", memory_limit="40MiB", steps=2)
    assert checked.confirmed
    # Real tensors, a fake process group: the same bytes the estimate counted.
    assert checked.measured_peak_bytes == pytest.approx(result.predicted_peak_bytes, rel=0.01)


def _plan_under_torchrun(model_file, out):
    """fsdp_plan_script.py on 2 gloo ranks: every rank's plan (rank 0's at ``out``)."""
    import os
    import subprocess

    from conftest import rank_command

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    command = rank_command(2, tests / "fsdp_plan_script.py", model_file, out)
    # A timeout here is ranks left waiting in each other's collectives.
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return load_plan(out), load_plan(f"{out}.rank1")


@pytest.mark.slow
def test_ranks_whose_peaks_differ_run_the_same_trials_and_take_the_larger_peak(examples_dir, tmp_path):
    # Rank 1 holds an extra 512 KiB per sample through its loss: alone, its search would stop
    # short of rank 0's in the middle of a step, and leave rank 0 waiting in FSDP2's collectives.
    model_file = tmp_path / "uneven_mlp.py"
    model_file.write_text((examples_dir / "mlp.py").read_text() + (
        "\n\ndef loss_fn(model, batch):\n"
        "    import torch.distributed as dist\n"
        "    x, y = batch\n"
        "    extra = x.repeat(1, 256) if dist.get_rank() == 1 else x[:, :0]\n"
        "    return nn.functional.cross_entropy(model(x), y) + 0 * extra.sum()\n"))
    rank0, rank1 = _plan_under_torchrun(model_file, tmp_path / "plan.json")
    trials = [[(t.micro_batch, t.fits, t.peak_bytes) for t in s.probe.trials]
              for s in (rank0.chosen_setting, rank1.chosen_setting)]
    assert trials[0] == trials[1]
    assert rank0.micro_batches == rank1.micro_batches
    budget = rank0.chosen_setting.probe.device.budget_bytes
    assert any(not fits and peak > budget for _, fits, peak in trials[0])  # measured to the end


@pytest.mark.slow
def test_under_torchrun_every_rank_measures_real_fsdp2(examples_dir, tmp_path):
    out = tmp_path / "plan.json"
    planned, _ = _plan_under_torchrun(examples_dir / "mlp.py", out)
    assert planned.distributed and planned.sharding is Sharding.FSDP and planned.shard_group == 2
    chosen = planned.chosen_setting
    assert not any("fake tensors" in note for note in chosen.probe.notes)  # measured, not estimated
    assert "one rank of 2 under fsdp" in chosen.probe.notes[0]


def test_a_sync_on_last_window_ruled_out_by_its_tensors_says_what_they_held():
    # The planner estimates holding the unsharded gradients until the last micro-step within the
    # budget less the headroom; where the estimate stopped at its tensors (a lower bound), the
    # plan reduce-scatters every micro-step and says the window holds at least that much.
    from autotune.planning.policy import SyncOnLast

    request = PlanRequest(target_batch=64, world_size=4, checkpointing="off", headroom=0.0,
                          sharding="fsdp")
    sharded = _sharded(8, 4)

    def planned(on_last):
        return build_plan(request, workload=fingerprint(), settings=[sharded], device=device(),
                          versions={"autotune": "0.1.0", "torch": "2.x", "cuda": None},
                          sync_on_last=on_last)

    ruled_out = planned(SyncOnLast(micro_batch=8, steps=2, peak_bytes=None, at_least_bytes=1200 * MiB,
                                   held_gradient_bytes=300 * MiB))
    assert ruled_out.reduce_every_micro_step is True and ruled_out.micro_batches == [8, 8]
    assert ruled_out.reasons["gradient_sync"].startswith(
        "every micro-step: holding this rank's unsharded gradients until the last micro-step "
        "(300.00 MiB of unsharded gradients) holds at least 1.17 GiB of tensors, past the "
        "1000.00 MiB the headroom leaves; reduce-scattering every micro-step")
    fits = planned(SyncOnLast(micro_batch=8, steps=2, peak_bytes=500 * MiB, held_gradient_bytes=300 * MiB))
    assert fits.reduce_every_micro_step is False and fits.predicted_peak_bytes == 500 * MiB
