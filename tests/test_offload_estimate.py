"""fsdp-offload: the device's per-rank peak, counted on the same fake step as fsdp's, with the
shards, sharded gradients, optimizer state and optimizer step in host memory."""

import dataclasses

import pytest

from autotune.errors import ConfigError
from autotune.orchestration.planner import plan
from autotune.planning.export import export_plan
from autotune.probing.estimate import estimate_offload_host_peaks, estimate_peaks
from autotune.distributed.sharding import Sharding
from autotune.units import format_bytes
from autotune.workload import load_workload
from plan_helpers import linear_probe, setting
from test_plan_sharding import _plan, _sharded

MiB = 1 << 20


def test_offload_leaves_the_resident_state_in_host_memory(examples_dir, one_thread):
    # mlp.py: 10 MiB of fp32 parameters and AdamW (two moments), one rank of 4.
    model_file = examples_dir / "mlp.py"
    shard = sum(p.numel() * p.element_size() for p in load_workload(model_file).new_model().parameters()) / 4
    fsdp = estimate_peaks(model_file, [1, 4], sharding="fsdp", world_size=4)
    offload = estimate_peaks(model_file, [1, 4], sharding="fsdp-offload", world_size=4)
    host = estimate_offload_host_peaks(model_file, [1, 4], world_size=4)
    for n in (1, 4):
        # The device no longer holds the shards and both moments (3 shards' worth), nor the
        # sharded gradients made so far in backward (at most one more).
        assert 3 * shard <= fsdp[n] - offload[n] <= 4 * shard
        # The host holds shards, gradients and moments, and the optimizer step's temporaries.
        assert 4 * shard <= host[n] <= 5 * shard
    assert host[1] == host[4]  # nothing on the host grows with the micro-batch
    assert offload[4] > offload[1]  # activations stay on the device


def test_offload_device_estimate_counts_the_uploaded_shards(examples_dir, one_thread):
    # FSDP2 copies each host shard to the device before the all-gather: on fake CPU tensors that
    # copy is a no-op, and the estimate adds it where it lives (beside the all-gather output).
    from autotune.memory.cpu import HostDeviceTracker

    counted = []
    real = HostDeviceTracker.count_transient

    def spy(self, nbytes):
        counted.append(nbytes)
        return real(self, nbytes)

    HostDeviceTracker.count_transient = spy
    try:
        estimate_peaks(examples_dir / "mlp.py", [1], sharding="fsdp-offload", world_size=4)
    finally:
        HostDeviceTracker.count_transient = real
    # One upload per block all-gather (forward and backward), each a quarter of a layer or so.
    assert counted and max(counted) <= (1024 * 1024 + 1024) * 4 / 4 + 64


def _offloaded(max_micro, group, **kwargs):
    tried = _sharded(max_micro, group, **kwargs)
    tried.sharding = Sharding.FSDP_OFFLOAD
    return tried


def test_offload_comes_last_in_the_order_of_preference():
    nothing = setting(None, error="does not fit at micro-batch 1")
    # fsdp reaches 2 steps, offload 1: offload wins, saying by how much.
    plan_ = _plan(64, 4, nothing, _sharded(8, 4), _offloaded(16, 4))
    assert plan_.sharding is Sharding.FSDP_OFFLOAD and plan_.accumulation_steps == 1
    assert "cuts accumulation steps from 2 (fsdp) to 1" in plan_.reasons["sharding"]
    assert "host memory" in plan_.reasons["sharding"]
    # As few steps with the shards on the device: fsdp wins (no host traffic).
    plan_ = _plan(64, 4, nothing, _sharded(16, 4), _offloaded(16, 4))
    assert plan_.sharding is Sharding.FSDP
    plan_ = _plan(64, 4, setting(linear_probe(16), headroom=0.0), _offloaded(16, 4))
    assert plan_.sharding is Sharding.DDP


def test_plan_offloads_a_model_that_fits_only_offloaded(examples_dir, one_thread):
    # mlp.py as one rank of 4 under fsdp needs about 24.6 MiB at micro-batch 1 (its shards and
    # AdamW moments on the device); offloaded, about 16 MiB: a 22 MiB budget (10% headroom)
    # fits only that.
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="22MiB", precision="fp32", checkpointing="off")
    assert (result.sharding, result.shard_group) == (Sharding.FSDP_OFFLOAD, 4)
    assert [s.sharding for s in result.settings][-1] is Sharding.FSDP_OFFLOAD
    assert all(s.probe is None for s in result.settings if s.sharding is Sharding.FSDP)
    assert "nothing fits sharded (fsdp)" in result.reasons["sharding"]
    assert result.predicted_peak_bytes <= 22 * MiB * 0.9
    offloaded = next(s for s in result.settings if s.sharding is Sharding.FSDP_OFFLOAD)
    host = max(t.host_peak_bytes for t in offloaded.probe.trials)
    assert host >= 10 * MiB  # shards, gradients and two moments: 4 × a quarter of 10 MiB
    assert f"also needs {format_bytes(host)} of host memory" in result.reasons["memory"]
    # Every export carries the offload.
    assert "offload" in export_plan(result, "hf").config["fsdp"]
    zero = export_plan(result, "deepspeed").config["zero_optimization"]
    assert zero["offload_param"] == zero["offload_optimizer"] == {"device": "cpu"}
    assert export_plan(result, "lightning").config["fsdp_strategy"]["cpu_offload"] is True
    # Accelerate shards only on accelerators: the CPU plan is refused, the same plan for CUDA
    # devices offloads its parameters.
    with pytest.raises(ConfigError, match="--to accelerate"):
        export_plan(result, "accelerate")
    on_gpus = dataclasses.replace(result, device=dataclasses.replace(result.device, kind="cuda"))
    assert export_plan(on_gpus, "accelerate").config["fsdp_config"]["fsdp_offload_params"] is True


@pytest.mark.parametrize("sharding", ["fsdp-offload"])
def test_explicit_offload_is_planned(examples_dir, one_thread, sharding):
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="64MiB", precision="fp32", checkpointing="off", sharding=sharding)
    assert (result.sharding, result.shard_group) == (Sharding.FSDP_OFFLOAD, 4)
    assert result.reasons["sharding"] == "fsdp-offload (shard group 4) as requested"


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_auto_does_not_offload_where_fsdp_fits(examples_dir, one_thread):
    # 40 MiB: no replica fits, fsdp does: offload is not even estimated.
    result = plan(examples_dir / "mlp.py", target_batch=64, world_size=4, device="cpu",
                  memory_limit="40MiB", precision="fp32", checkpointing="off")
    assert result.sharding is Sharding.FSDP
    assert Sharding.FSDP_OFFLOAD not in {s.sharding for s in result.settings}


def test_cli_estimate_prints_the_device_peak_and_the_host_memory(examples_dir, one_thread):
    from click.testing import CliRunner

    from autotune.cli.main import cli

    args = ["estimate", str(examples_dir / "mlp.py"), "--micro-batch", "4", "--world-size", "4",
            "--sharding", "fsdp-offload"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    device = estimate_peaks(examples_dir / "mlp.py", [4], sharding="fsdp-offload", world_size=4)[4]
    host = estimate_offload_host_peaks(examples_dir / "mlp.py", [4], world_size=4)[4]
    assert f"({device} bytes)" in result.output and "the device's" in result.output
    assert f"host memory per rank (shards, gradients, optimizer state and step, at any " \
           f"micro-batch): {format_bytes(host)}" in result.output
