"""autotune.plan(): which settings it probes, world size resolution, ranks agreeing (gloo, 1 rank)."""

import pytest
import torch

import autotune
from autotune.errors import ConfigError
from autotune.distributed.environment import resolve_world_size as _resolve_world_size
from autotune.workload.contract import Workload
from plan_helpers import linear_probe


def _workload(batchnorm=False, blocks=False):
    """A Sequential of single layers (whose checkpointing frees nothing, ``checkpointing_futile``),
    or with ``blocks`` of two blocks of Linear and ReLU each."""
    def build():
        if blocks:
            return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
                                         for _ in range(2)))
        layers = [torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)]
        return torch.nn.Sequential(*layers, *( [torch.nn.BatchNorm1d(4)] if batchnorm else []))

    return Workload(model=build, make_batch=lambda n: torch.randn(n, 4),
                    loss_fn=lambda m, b: m(b).sum(), source="test-model")


@pytest.fixture
def probes(monkeypatch):
    """Fake probes: micro-batch 10 fits without checkpointing, 64 with; records the calls."""
    calls = []

    def fake(workload, *, precision, checkpointing, max_micro_batch, backend, **_):
        calls.append((precision, checkpointing.enabled, max_micro_batch))
        found = min(64 if checkpointing else 10, max_micro_batch)
        return linear_probe(found, precision=precision, checkpointing=checkpointing, upper=max_micro_batch)

    monkeypatch.setattr("autotune.orchestration.planner.probe", fake)
    return calls


def test_auto_checkpointing_probes_both_and_records_why(probes):
    plan = autotune.plan(_workload(blocks=True), target_batch=64, device="cpu", precision="fp32", headroom=0.0)
    assert probes == [("fp32", False, 64), ("fp32", True, 64)]
    assert plan.checkpointing.enabled and plan.micro_batches == [64]
    assert [s.allowed_micro_batch for s in plan.settings] == [10, 64]
    assert "from 7 to 1" in plan.reasons["checkpointing"]


def test_auto_checkpointing_does_not_probe_blocks_that_are_single_layers(probes):
    # Checkpointing a Linear keeps its input, which the Linear keeps for its backward anyway:
    # nothing to probe (the stub probe would have claimed 64).
    plan = autotune.plan(_workload(), target_batch=64, device="cpu", precision="fp32", headroom=0.0)
    assert probes == [("fp32", False, 64)]
    assert not plan.checkpointing.enabled and len(plan.micro_batches) == 7 and max(plan.micro_batches) == 10
    why = plan.reasons["checkpointing"]
    assert why.startswith("auto: off, not probed: its repeated blocks are single layers (2 Linear)")
    assert plan.workload.checkpointing_futile in why


def test_auto_checkpointing_skips_the_second_probe_when_the_share_fits(probes):
    plan = autotune.plan(_workload(), target_batch=8, device="cpu", precision="fp32", headroom=0.0)
    assert probes == [("fp32", False, 8)]
    assert not plan.checkpointing.enabled


def test_pinned_micro_batch_is_the_probe_bound(probes):
    plan = autotune.plan(_workload(), target_batch=64, device="cpu", precision="fp32",
                         checkpointing="off", micro_batch=8, headroom=0.0)
    assert probes == [("fp32", False, 8)]
    assert plan.micro_batches == [8] * 8


def test_auto_precision_on_cpu_is_fp32_when_bf16_buys_nothing(probes, monkeypatch):
    # bf16 autocast trained T5 10x slower on a CPU that reports bf16, for no larger micro-batch.
    monkeypatch.setattr("autotune.orchestration.planner.supports_bf16", lambda device: True)
    plan = autotune.plan(_workload(), target_batch=8, device="cpu", checkpointing="off")
    assert plan.precision == "fp32" and probes == [("fp32", False, 8)]
    assert "fp32 on the CPU" in plan.reasons["precision"]
    plan = autotune.plan(_workload(), target_batch=40, device="cpu", checkpointing="off")
    assert plan.precision == "fp32" and plan.micro_batches == [10] * 4
    assert "no fewer" in plan.reasons["precision"]


def _precision_probes(monkeypatch, largest):
    """Probes that honour ``least`` (one trial at the upper bound: it or nothing) and record
    (precision, upper, least); ``largest``: {precision: the largest micro-batch that fits}."""
    calls = []
    monkeypatch.setattr("autotune.orchestration.planner.supports_bf16", lambda device: True)

    def fake(workload, *, precision, checkpointing, max_micro_batch, backend, least=None, **_):
        calls.append((str(precision), max_micro_batch, least))
        found = min(largest[str(precision)], max_micro_batch)
        if least is not None and found < least:
            found = 0
        return linear_probe(found, precision=precision, checkpointing=checkpointing, upper=max_micro_batch)

    monkeypatch.setattr("autotune.orchestration.planner.probe", fake)
    return calls


def test_auto_precision_on_cpu_is_bf16_where_it_buys_accumulation_steps(monkeypatch):
    calls = _precision_probes(monkeypatch, {"fp32": 10, "bf16": 20})
    plan = autotune.plan(_workload(), target_batch=40, device="cpu", checkpointing="off", headroom=0.0)
    assert plan.precision == "bf16" and plan.micro_batches == [20, 20]
    assert "fp32 needs 4 accumulation steps and bf16 needs 2" in plan.reasons["precision"]
    # fp32 takes 4 steps; bf16 is first asked whether it fits 14 (3 steps), then searched.
    assert calls == [("fp32", 40, None), ("bf16", 14, 14), ("bf16", 40, None)]


def test_auto_precision_on_cpu_asks_bf16_one_trial_where_it_cannot_buy_a_step(monkeypatch):
    # The README's quickstart searched bf16 in full (estimates, real trials, the fewest blocks) to
    # learn that it needed fp32's steps: 104 s of planning on a CPU where bf16 is slow, 25 s now.
    calls = _precision_probes(monkeypatch, {"fp32": 10, "bf16": 13})
    plan = autotune.plan(_workload(), target_batch=40, device="cpu", checkpointing="off", headroom=0.0)
    assert plan.precision == "fp32" and plan.micro_batches == [10] * 4
    assert calls == [("fp32", 40, None), ("bf16", 14, 14)]
    assert plan.reasons["precision"] == (
        "auto: fp32 on the CPU (bf16 autocast is usually much slower on the CPU, and bf16 buys no "
        "fewer than fp32's 4 accumulation steps: in bf16, micro-batch 14 (3 steps) does not fit the "
        "budget less headroom)")
    # A pinned micro-batch: bf16 cannot change the steps, nor is it asked one trial.
    calls.clear()
    plan = autotune.plan(_workload(), target_batch=40, device="cpu", checkpointing="off", headroom=0.0,
                         micro_batch=10)
    assert plan.precision == "fp32" and ("bf16", 14, 14) not in calls


def test_fingerprint_and_base_lr_from_options(probes):
    plan = autotune.plan(_workload(batchnorm=True), target_batch=8, device="cpu", base_lr=0.1,
                         base_batch=4, lr_rule="linear")
    assert plan.workload.param_count == 2 * (16 + 4) + 8
    assert plan.workload.optimizer == "AdamW" and plan.workload.batchnorm
    assert plan.lr.lr == pytest.approx(0.2)


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _resolve_world_size(None, False) == 4
    assert _resolve_world_size(2, False) == 2
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError) as info:
        _resolve_world_size(None, False)
    assert "WORLD_SIZE='four'" in str(info.value)
    monkeypatch.delenv("WORLD_SIZE")
    assert _resolve_world_size(None, False) == 1


def test_ranks_agree_through_all_reduce(probes, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan = autotune.plan(_workload(), target_batch=8, device="cpu", precision="fp32")
    finally:
        dist.destroy_process_group()
    assert plan.distributed is True and plan.world_size == 1
    assert not any("one process" in w for w in plan.warnings)


def test_errors_name_options_as_the_caller_wrote_them(examples_dir):
    # plan() from Python names its keyword arguments; the CLI names its flags, for the same mistake.
    from click.testing import CliRunner

    from autotune.cli.main import cli
    from autotune.errors import PlanError

    with pytest.raises(PlanError, match="target_batch=130 is not divisible by world_size=4; use 128 or 132"):
        autotune.plan(examples_dir / "mlp.py", target_batch=130, world_size=4, device="cpu")
    with pytest.raises(ConfigError, match=r"optimize='fastest' is not a goal"):
        autotune.plan(examples_dir / "mlp.py", target_batch=8, optimize="fastest", device="cpu")
    result = CliRunner().invoke(cli, ["plan", str(examples_dir / "mlp.py"), "--target-batch", "130",
                                      "--world-size", "4", "--device", "cpu"])
    assert result.exit_code == 1
    assert "--target-batch 130 is not divisible by --world-size 4; use 128 or 132" in result.output
