"""A window's predicted time from hand-made step costs (autotune.timing.window): micro-steps,
one optimizer phase, exposed communication by the runtime's rules, the bubble, MFU and rates."""

import pytest

from autotune.timing.comm import Link, Network
from autotune.timing.costs import CollectiveCall, OpCost, StepCosts
from autotune.timing.window import (StepModel, WindowTime, bubble_fraction, ddp_bucket_calls,
                                     predict_window)
from autotune.timing.roofline import DeviceSpeed

# 100 FLOP/s, unlimited bandwidth, no per-op cost: an op of F FLOPs takes F / 100 s.
SPEED = DeviceSpeed(name="unit", peak_flops={"fp32": 100.0}, memory_bandwidth=1e30,
                    fractions={"matmul": 1.0, "attention": 1.0, "memory": 1.0})


def step(n, *, recompute=True, collectives=(), per_sample=25.0):
    """Forward 1 s, backward 2 s, recompute 1 s (at n = 4), optimizer 0.5 s; 16 tokens a sample."""
    f = per_sample * n
    ops = [OpCost("matmul", "forward", f, 0, 1), OpCost("matmul", "backward", 2 * f, 0, 1),
           OpCost("optimizer", "optimizer", 50.0, 0, 1)]
    if recompute:
        ops.append(OpCost("matmul", "recompute", f, 0, 1))
    return StepCosts(ops=tuple(ops), collectives=tuple(collectives), micro_batch=n, tokens=16 * n)


def test_one_rank_window_is_micro_steps_plus_one_optimizer_phase():
    model = StepModel({4: step(4)}, SPEED, "fp32")
    p = predict_window(model, [4, 4])
    # Two micro-steps of 1 + 2 + 1 s, one optimizer phase of 0.5 s.
    assert p.step_s == pytest.approx(8.5) and p.compute_s == pytest.approx(8.5)
    assert p.recompute_s == pytest.approx(2) and p.optimizer_s == pytest.approx(0.5)
    assert p.exposed_comm_s == 0 and p.bubble_s == 0
    assert p.samples_per_s == pytest.approx(8 / 8.5)
    assert p.tokens_per_s == pytest.approx(128 / 8.5)
    # MFU: forward + backward FLOPs only (no recompute, no optimizer) over time x peak.
    assert p.mfu == pytest.approx(2 * 300 / (8.5 * 100))


def test_ddp_all_reduces_its_buckets_on_the_last_micro_step_only():
    mib = 2**20
    assert [c.bytes for c in ddp_bucket_calls(52 * mib, 2)] == [mib, 25 * mib, 25 * mib, mib]
    assert ddp_bucket_calls(10, 1) == ()
    # 1 MiB/s: buckets of 1 and 2 MiB take 1 and 2 s (all-reduce over 2 ranks: factor 1). The
    # backward (2 s + 1 s recompute) hides the first; the last is exposed.
    net = Network(intra=Link(float(mib), 0.0), inter=None, gpus_per_node=8)
    model = StepModel({4: step(4)}, SPEED, "fp32")
    p = predict_window(model, [4, 4], network=net, world_size=2, gradient_bytes=3 * mib)
    assert p.exposed_comm_s == pytest.approx(2) and p.comm_s == pytest.approx(3)
    assert p.step_s == pytest.approx(8.5 + 2)


def fsdp_calls():
    def call(kind, phase):  # 2 bytes over 2 ranks on a 1 B/s link: 1 s each
        return CollectiveCall(kind=kind, bytes=2, group_size=2, phase=phase)
    return [call("all_gather", "forward"), call("all_gather", "forward"),
            call("all_gather", "backward"), call("reduce_scatter", "backward"),
            call("all_gather", "backward"), call("reduce_scatter", "backward")]


UNIT = Network(intra=Link(1.0, 0.0), inter=None, gpus_per_node=8)


def test_fsdp_window_gathers_every_micro_step_and_reduces_as_planned():
    model = StepModel({4: step(4, collectives=fsdp_calls())}, SPEED, "fp32")
    # Forward: first gather 1 + (1 - 0.5) = 1.5. Backward (3 s over 2 blocks): first gather 1,
    # last reduce-scatter 1, the pair (1 + 1 - 1.5) = 0.5 -> 2.5; without the reduce-scatters
    # (sync off) 1 + max(0, 1 - 1.5) = 1.
    every = predict_window(model, [4, 4], network=UNIT, world_size=2, sharding="fsdp",
                           reduce_every_micro_step=True)
    assert every.exposed_comm_s == pytest.approx(2 * (1.5 + 2.5))
    on_last = predict_window(model, [4, 4], network=UNIT, world_size=2, sharding="fsdp",
                             reduce_every_micro_step=False)
    assert on_last.exposed_comm_s == pytest.approx((1.5 + 1) + (1.5 + 2.5))
    assert on_last.comm_s == pytest.approx(6 + 4)


def test_the_optimizer_phases_collectives_run_once_a_window():
    norm = CollectiveCall(kind="all_reduce", bytes=3, group_size=2, phase="optimizer")
    model = StepModel({4: step(4, collectives=[norm])}, SPEED, "fp32")
    p = predict_window(model, [4, 4, 4], network=UNIT, world_size=2, sharding="fsdp")
    assert p.exposed_comm_s == pytest.approx(3)


def test_pipeline_bubble_is_the_schedules_idle_share():
    assert bubble_fraction(1, 8) == 0 and bubble_fraction(4, 8) == pytest.approx(3 / 11)
    model = StepModel({4: step(4)}, SPEED, "fp32")
    p = predict_window(model, [4, 4], pipeline_stages=4)
    assert p.bubble_s == pytest.approx(12)
    assert p.bubble_s / (p.bubble_s + 8) == pytest.approx(bubble_fraction(4, 2))


def test_steps_between_counted_micro_batches_are_interpolated():
    model = StepModel({2: step(2), 6: step(6)}, SPEED, "fp32")
    exact = StepModel({4: step(4)}, SPEED, "fp32")
    assert predict_window(model, [4]).step_s == pytest.approx(predict_window(exact, [4]).step_s)
    assert predict_window(model, [8]).step_s == pytest.approx(
        predict_window(StepModel({8: step(8)}, SPEED, "fp32"), [8]).step_s)
    with pytest.raises(ValueError, match="not counted"):
        StepModel({4: step(4)}, SPEED, "fp32").at(5)


def test_prediction_round_trips_and_refuses_non_finite_numbers():
    p = predict_window(StepModel({4: step(4)}, SPEED, "fp32"), [4])
    assert WindowTime.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="step_s"):
        WindowTime(**{**p.to_dict(), "step_s": float("nan")})
