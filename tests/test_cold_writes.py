"""New tensors a step's forward (and checkpoint's recompute) writes out of cache: counted per op
(``OpCost.fresh``), priced by the CPU profile's cold write (``DeviceSpeed.cold_write_s_per_byte``)
in those phases' kernel families only, and measured by a copy into memory in cache against one
cycling out of it."""

import dataclasses

import pytest
import torch
from torch import nn

from autotune import Workload
from autotune.timing import cpu_profile
from autotune.timing.costs import OpCost, StepCosts
from autotune.timing.count import _traffic, count_step_costs
from autotune.timing.roofline import DeviceSpeed, compute_time, phase_time

aten = torch.ops.aten


def _speed(**changes) -> DeviceSpeed:
    values = dict(name="test", peak_flops={"fp32": 1e9}, memory_bandwidth=1e8,
                  fractions={"matmul": 0.5, "attention": 0.5, "memory": 0.5}, op_overhead_s=0.0)
    return DeviceSpeed(**{**values, **changes})


def _fresh_bytes(func, *args, **kwargs) -> float:
    return _traffic(func, args, kwargs, func(*args, **kwargs))[1]


def test_fresh_bytes_are_new_outputs_not_inputs_written_in_place_or_views():
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    assert _fresh_bytes(aten.mm.default, a, b) == 8 * 4 * 4
    assert _traffic(aten.mm.default, (a, b), {}, aten.mm.default(a, b))[0] == 4 * (8 * 16 + 16 * 4 + 8 * 4)
    assert _fresh_bytes(aten.add_.Tensor, torch.zeros(8, 16), a) == 0.0
    assert _fresh_bytes(aten.view.default, a, [16, 8]) == 0.0
    # Several new outputs: layer norm's output, mean and reciprocal standard deviation.
    assert _fresh_bytes(aten.native_layer_norm.default, a, [16], None, None, 1e-5) == 4 * (8 * 16 + 8 + 8)
    # Written into an out= argument: the caller's tensor, not a new one.
    assert _fresh_bytes(aten.mm.out, a, b, out=torch.empty(8, 4)) == 0.0
    # A foreach op's list of new tensors (one return, a list), and its in-place form.
    xs = [torch.ones(4), torch.ones(8)]
    assert _fresh_bytes(aten._foreach_mul.Scalar, xs, 2.0) == 4 * 12
    assert _fresh_bytes(aten._foreach_mul_.Scalar, xs, 2.0) == 0.0


def test_a_steps_counted_ops_carry_their_new_outputs():
    workload = Workload(model=lambda: nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU()),
                        make_batch=lambda n: torch.randn(n, 16), loss_fn=lambda m, x: m(x).sum(),
                        build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), source="t")
    costs = count_step_costs(workload, 4)
    by_kernel = {(op.phase, op.kernel): op for op in costs.ops}
    assert by_kernel[("forward", "mm")].fresh == 4 * 32 * 4  # the linear's output
    assert by_kernel[("forward", "gelu")].fresh == 4 * 32 * 4
    assert by_kernel[("optimizer", "inplace")].fresh == 0.0  # AdamW's in-place updates
    for op in costs.ops:
        assert 0.0 <= op.fresh <= op.bytes


def test_cold_writes_are_priced_in_the_forward_and_recompute_kernel_families_only():
    fresh, cost = 4e6, 1e-10
    ops = (OpCost("elementwise", "forward", 0.0, 8e6, 2, "gelu", fresh),
           OpCost("elementwise", "recompute", 0.0, 8e6, 2, "gelu", fresh),
           OpCost("elementwise", "optimizer", 0.0, 8e6, 2, "inplace", fresh),
           OpCost("elementwise", "backward", 0.0, 8e6, 2, "gelu_backward", fresh),
           # an op priced by the memory curve, whose adds were measured writing out of cache
           OpCost("elementwise", "forward", 0.0, 8e6, 2, "", fresh),
           OpCost("matmul", "forward", 1e8, 8e6, 2, "mm", fresh))
    costs = StepCosts(ops=ops, collectives=(), micro_batch=4)
    warm, cold = _speed(), _speed(cold_write_s_per_byte=cost)
    for op in ops:
        alone = dataclasses.replace(costs, ops=(op,))
        extra = compute_time(alone, cold)["total"] - compute_time(alone, warm)["total"]
        expected = fresh * cost if op.phase in ("forward", "recompute") and op.kernel else 0.0
        assert extra == pytest.approx(expected, abs=1e-15), op
    forward = phase_time(costs, cold)["forward"] - phase_time(costs, warm)["forward"]
    assert forward == pytest.approx(2 * fresh * cost)


def test_cold_write_cost_is_the_cycling_copys_extra_time_per_byte(monkeypatch):
    timed = []

    def op_times(ops):
        timed.append(ops)
        return [1e-4, 3.5e-4]  # the copy into one output, then the cycling copy

    monkeypatch.setattr(cpu_profile, "_op_times", op_times)
    cost = cpu_profile._cold_write_cost()
    assert len(timed) == 1 and len(timed[0]) == 2  # both timed together, in turns
    assert cost == pytest.approx(2.5e-4 / (4 * cpu_profile.COLD_WRITE_ELEMENTS))
    monkeypatch.setattr(cpu_profile, "_op_times", lambda ops: [3e-4, 2e-4])  # a busy moment
    assert cpu_profile._cold_write_cost() == 0.0


def test_the_cycling_copy_writes_each_set_in_turn():
    source, outputs = torch.arange(4.0), torch.zeros(12)
    copy = cpu_profile._cycling_copy(source, outputs)
    for turn in range(3):
        copy()
        assert torch.equal(outputs[:4 * (turn + 1)], source.repeat(turn + 1))
        assert not outputs[4 * (turn + 1):].any()


def test_the_profile_measures_a_cold_write_cost_within_reason():
    cost = cpu_profile._cold_write_cost()
    # Slower than no cost at all, and faster than a byte per microsecond (1 MB/s).
    assert 0.0 <= cost < 1e-6
