"""The sharded step's costs beyond its ops (issue 22): FSDP2's hooks per unit and parameter,
DTensor's dispatch per op and listed tensor, counted on the fake step and priced by this CPU's
microbenchmarks (``timing.sharded_profile``); each collective's CPU cost on gloo ranks
(``timing.gloo``); module calls and checkpointed blocks counted once in a window's phases."""

import dataclasses
import math
import os
import socket

import pytest
import torch
from torch import nn

from autotune import Workload
from autotune.timing import cpu_profile
from autotune.timing.costs import CollectiveCall, OpCost, StepCosts
from autotune.timing.count import count_step_costs
from autotune.timing.gloo import CollectiveCpu, collective_cpu_seconds
from autotune.timing.roofline import DeviceSpeed, compute_time, phase_time
from autotune.timing.sharded_profile import SHARDED_FIELDS, ShardedOverheads
from autotune.timing.window import StepModel, predict_window

WIDTH, N = 8, 2


def _blocks():
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3)))


def _workload(**options) -> Workload:
    return Workload(model=_blocks, make_batch=lambda n: torch.randn(n, WIDTH),
                    loss_fn=lambda model, batch: model(batch).sum(),
                    build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    source="blocks", **options)


def _speed(**changes) -> DeviceSpeed:
    values = dict(name="test", peak_flops={"fp32": 1e9}, memory_bandwidth=1e8,
                  fractions={"matmul": 0.5, "attention": 0.25, "memory": 0.5}, op_overhead_s=1e-6)
    return DeviceSpeed(**{**values, **changes})


def test_fake_step_counts_fsdp_units_parameters_and_the_dtensor_ops_a_real_step_dispatches():
    from autotune.distributed.sharding.ranks import fake_process_group
    from autotune.distributed.sharding.wrap import build_mesh, shard_model
    from autotune.timing.sharded_profile import _dtensor_dispatches

    costs = count_step_costs(_workload(), N, sharding="fsdp", world_size=2)
    assert costs.sharded_units == 4  # three blocks and the root
    assert costs.sharded_params == 6
    # The same step on real DTensors: clipping over the sharded gradients, then AdamW (its
    # per-parameter path, as on CPU) on the sharded parameters.
    with fake_process_group(2):
        model = shard_model(_blocks(), mesh=build_mesh("cpu", 2, 2), sharding="fsdp")
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        model(torch.randn(N, WIDTH)).sum().backward()
        optimizer.step()  # the state, as the fake step's warm-up leaves it

        def phase():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

        ops, listed = _dtensor_dispatches(phase)
    assert costs.dtensor_ops == {"optimizer": ops}
    assert costs.dtensor_list_tensors == {"optimizer": listed}
    assert listed >= 2 * 6  # the clipping's foreach ops take every gradient


def test_a_replicated_step_has_no_sharded_costs():
    costs = count_step_costs(_workload(), N, sharding="ddp", world_size=2)
    assert (costs.sharded_units, costs.sharded_params) == (0, 0)
    assert costs.dtensor_ops == {} and costs.dtensor_list_tensors == {}


def _sharded_costs(**changes) -> StepCosts:
    values = dict(ops=(OpCost("matmul", "forward", flops=0, bytes=0, count=1),
                       OpCost("optimizer", "optimizer", flops=0, bytes=0, count=2)),
                  collectives=(), micro_batch=1, sharded_units=3, sharded_params=10,
                  dtensor_ops={"optimizer": 7}, dtensor_list_tensors={"optimizer": 5})
    return StepCosts(**{**values, **changes})


def test_roofline_prices_fsdp_hooks_per_unit_and_parameter_and_dtensor_ops():
    speed = _speed(fsdp_step_s=1e-4, fsdp_unit_s=4e-4, fsdp_param_s=2e-5, dtensor_op_s=1e-5,
                   dtensor_list_tensor_s=3e-6)
    parts = compute_time(_sharded_costs(), speed)
    fsdp = 1e-4 + 3 * 4e-4 + 10 * 2e-5
    assert parts["other"] == pytest.approx(fsdp)
    assert parts["optimizer"] == pytest.approx(2 * 1e-6 + 7 * 1e-5 + 5 * 3e-6)
    phases = phase_time(_sharded_costs(), speed)
    assert phases["forward"] == pytest.approx(1e-6 + fsdp / 2)
    assert phases["backward"] == pytest.approx(fsdp / 2)
    assert sum(phases.values()) == pytest.approx(parts["total"])
    # Unsharded, or on a device without these costs (a GPU profile), nothing is added.
    plain = compute_time(_sharded_costs(sharded_units=0, sharded_params=0, dtensor_ops={},
                                        dtensor_list_tensors={}), speed)
    assert plain["total"] == pytest.approx(3e-6)
    assert compute_time(_sharded_costs(), _speed())["total"] == pytest.approx(3e-6)


def test_a_window_counts_module_calls_and_checkpoint_blocks_once():
    costs = StepCosts(ops=(OpCost("matmul", "forward", flops=0, bytes=0, count=1),
                           OpCost("matmul", "backward", flops=0, bytes=0, count=1),
                           OpCost("matmul", "recompute", flops=0, bytes=0, count=1),
                           OpCost("optimizer", "optimizer", flops=0, bytes=0, count=1)),
                      collectives=(), micro_batch=1, module_calls={"forward": 5, "recompute": 3},
                      checkpoint_blocks=2)
    speed = _speed(module_call_s=1e-5, checkpoint_block_s=1e-3)
    window = predict_window(StepModel({1: costs}, speed, "fp32"), [1])
    assert window.compute_s == pytest.approx(compute_time(costs, speed)["total"])
    assert window.recompute_s == pytest.approx(1e-6 + 3 * 1e-5 + 2 * 1e-3)


def test_sharded_costs_are_cached_and_scaled_with_the_profile(tmp_path):
    speed = _speed(fsdp_step_s=1e-4, fsdp_unit_s=4e-4, fsdp_param_s=2e-5, dtensor_op_s=1e-5,
                   dtensor_list_tensor_s=3e-6, matmul_curve={"fp32": ((1e3, 0.5),)})
    path = tmp_path / cpu_profile.CACHE_FILE
    cpu_profile.save_cached(path, "key", speed)
    assert cpu_profile.load_cached(path, "key") == speed
    scaled = cpu_profile.scaled_speed(speed, (1.0, 1.0, 1e-6), (1.0, 1.0, 2e-6))
    for name in SHARDED_FIELDS:
        assert getattr(scaled, name) == pytest.approx(2 * getattr(speed, name))
    assert tuple(f.name for f in dataclasses.fields(ShardedOverheads)) == SHARDED_FIELDS


@pytest.mark.parametrize("name", SHARDED_FIELDS)
def test_device_speed_refuses_negative_sharded_costs(name):
    with pytest.raises(ValueError):
        _speed(**{name: -1.0})


def test_sharded_microbenchmarks_measure_finite_costs_and_real_dispatch(monkeypatch):
    from autotune.timing.sharded_profile import measure_sharded_overheads

    monkeypatch.setattr(cpu_profile, "_MIN_SECONDS", 0.002)  # shorter timings: a fast test
    monkeypatch.setattr(cpu_profile, "_REPEATS", 3)
    measured = measure_sharded_overheads(cpu_profile._training_op_overhead(), cpu_profile._op_times,
                                         cpu_profile._dispatched_ops)
    values = dataclasses.asdict(measured)
    # Costs are differences of timings: on a loaded machine one can come out at zero (clamped),
    # so the test asserts what a cost may be; bench/step_time_distributed.py reports their sizes.
    assert set(values) == set(SHARDED_FIELDS)
    assert all(math.isfinite(v) and v >= 0 for v in values.values()), values


def test_sharded_costs_come_from_runs_timed_in_one_group_each():
    # Every FSDP2 step (three stacks, sharded and plain) in one group, and the four DTensor runs in
    # another: each cost is a difference of differences of those timings, which a drift between
    # separately timed runs would move. A machine where a sharded step costs 40 us, 300 us per
    # unit and 20 us per parameter more than its plain step gives back exactly those.
    from autotune.timing import sharded_profile

    groups = []

    def time_ops(fns):
        groups.append(len(fns))
        if len(fns) == 4:  # AdamW and clipping, sharded and plain
            return [1e-3, 1e-3, 1e-3, 1e-3]
        times = []
        for units, layers in sharded_profile._UNIT_SHAPES:
            params = 2 * (units * layers + 1)  # weights and biases, the root Linear's too
            times += [40e-6 + 300e-6 * (units + 1) + 20e-6 * params, 0.0]
        return times

    measured = sharded_profile.measure_sharded_overheads(0.0, time_ops, lambda fn: 0)
    assert groups == [6, 4]
    assert measured.fsdp_step_s == pytest.approx(40e-6)
    assert measured.fsdp_unit_s == pytest.approx(300e-6)
    assert measured.fsdp_param_s == pytest.approx(20e-6)
    assert measured.dtensor_op_s == 0.0 and measured.dtensor_list_tensor_s == 0.0


def test_pooling_and_batch_norm_curves_count_bytes_as_the_step_does(monkeypatch):
    seen = {}

    def record(points):
        for family, forward_bytes, backward_bytes, _ in points:
            seen.setdefault(family, (forward_bytes, backward_bytes))

    monkeypatch.setattr(cpu_profile, "_rates", record)
    cpu_profile._memory_kernel_rates()
    batch, channels, side = cpu_profile.POOLED[0]
    size = 4.0 * batch * channels * side * side
    # max_pool2d reads the input, writes a quarter and its int64 indices; its backward reads the
    # output's gradient, the input and the indices, and writes the input's gradient.
    assert seen["pooling"] == (1.75 * size, 2.75 * size)
    assert seen["batch_norm"][0] == pytest.approx(2 * size, rel=1e-2)


def test_collective_cpu_cost_is_per_call_plus_per_byte_by_kind():
    cpu = CollectiveCpu(per_call={"all_gather": 1e-4, "reduce_scatter": 2e-4, "all_reduce": 1e-4},
                        per_byte={"all_gather": 1e-9, "reduce_scatter": 3e-9, "all_reduce": 2e-9})
    calls = [CollectiveCall("all_gather", 1000, 2, "forward"),
             CollectiveCall("reduce_scatter", 1000, 2, "backward")]
    assert collective_cpu_seconds(calls, cpu) == pytest.approx(1e-4 + 1e-6 + 2e-4 + 3e-6)
    # A kind not measured costs what the dearest measured kind would.
    assert cpu.seconds(CollectiveCall("broadcast", 1000, 2, "forward")) == pytest.approx(2e-4 + 3e-6)


def test_a_noisy_gloo_measurement_is_taken_again_and_only_rank_0_fits(monkeypatch):
    from autotune.timing import gloo

    # Rank 1 of a pair: its own times (which once fit a negative bandwidth and raised there) are
    # never fitted; it takes whatever rank 0 broadcasts, and measures again when that is nan.
    monkeypatch.setattr(gloo.dist, "get_rank", lambda: 1)
    broadcasts = iter([float("nan"), 2e-9])

    def broadcast(numbers, src, group=None):
        assert src == 0
        numbers.fill_(next(broadcasts))

    monkeypatch.setattr(gloo.dist, "broadcast", broadcast)
    measured = []
    noisy = [[(1.0, 1e3, 5e-4), (1.0, 1e6, 1e-4)]]  # more bytes, less time
    fits = gloo._fitted_on_rank_0(lambda: measured.append(1) or noisy, None, 3, what="t")
    assert len(measured) == 2 and fits == [(2e-9, 2e-9)]
    # Rank 0 fits: a negative slope is nan (measure again), a clean one is kept.
    assert all(math.isnan(v) for v in gloo._fit(noisy[0]))
    alpha, beta = gloo._fit([(1.0, 1e3, 1e-4 + 1e-6), (1.0, 1e6, 1e-4 + 1e-3)])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(1e-9)
    # Every attempt noisy: the error says so, after `attempts` measurements.
    monkeypatch.setattr(gloo.dist, "broadcast", lambda numbers, src, group=None: numbers.fill_(float("nan")))
    measured.clear()
    with pytest.raises(RuntimeError, match="no bandwidth in 3 attempts"):
        gloo._fitted_on_rank_0(lambda: measured.append(1) or noisy, None, 3, what="t")
    assert len(measured) == 3


def test_gloo_collectives_take_turns_size_by_size(monkeypatch):
    # Each repetition runs every kind and size once (after a barrier each), so every size of a
    # fit is timed across the same moments of a machine whose load drifts.
    from autotune.timing import gloo

    order = []
    monkeypatch.setattr(gloo, "_collective", lambda kind, elements, p, group: lambda: order.append((kind, elements)))
    monkeypatch.setattr(gloo.dist, "barrier", lambda group=None: None)
    ticks = iter(range(10**6))
    cases = [("all_gather", 8), ("all_gather", 64), ("all_reduce", 8)]
    times = gloo._median_times(cases, 2, None, 3, clock=lambda: float(next(ticks)))
    assert order == cases + cases * 3  # a first call of each, then three rounds
    assert times == [1.0, 1.0, 1.0]


def _gloo_cpu_worker(rank, world, port, out):
    from autotune.timing.gloo import measure_gloo_cpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cpu = measure_gloo_cpu(sizes=(2**12, 2**16, 2**20), repeats=3)
        if rank == 0:
            with open(out, "w") as f:
                f.write(repr((cpu.per_call, cpu.per_byte)))
    finally:
        torch.distributed.destroy_process_group()


def _spawned(worker, tmp_path, *args, nprocs: int):
    """What ``worker``(rank, *args, port, out) wrote to ``out``, run on ``nprocs`` processes."""
    import ast

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.txt"
    torch.multiprocessing.spawn(worker, args=(*args, port, str(out)), nprocs=nprocs, join=True)
    return ast.literal_eval(out.read_text())


@pytest.mark.slow
def test_gloo_cpu_costs_are_measured_on_two_ranks(tmp_path):
    per_call, per_byte = _spawned(_gloo_cpu_worker, tmp_path, 2, nprocs=2)
    assert set(per_call) == set(per_byte) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(math.isfinite(v) and v >= 0 for v in (*per_call.values(), *per_byte.values()))
    assert all(v > 0 for v in per_byte.values())  # moving bytes costs the ranks CPU time


def _sharded_overheads_under_a_group(rank, port, out):
    from autotune.timing.sharded_profile import measure_sharded_overheads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        # Measured in a fresh process.
        measured = measure_sharded_overheads(5e-6, cpu_profile._op_times, cpu_profile._dispatched_ops)
        with open(out, "w") as f:
            f.write(repr(dataclasses.asdict(measured)))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_sharded_microbenchmarks_run_beside_an_initialised_process_group(tmp_path):
    values = _spawned(_sharded_overheads_under_a_group, tmp_path, nprocs=1)
    assert set(values) == set(SHARDED_FIELDS)
    assert values["fsdp_unit_s"] > 0 and values["dtensor_op_s"] > 0


@pytest.mark.slow  # two counted fake steps of an HF model: about 8 s
def test_a_tensor_parallel_rank_counts_the_flops_of_its_own_shards(monkeypatch):
    # A 2-layer HF Llama: its tp_plan shards every projection of each block and the LM head
    # column-wise, so each of 2 ranks does exactly half of the model's matmul and attention
    # FLOPs. Counted at the DTensors' global shapes (or with the shape propagation DTensor
    # runs on the host once per op), a rank would count more.
    from autotune import Layout

    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    model = os.path.join(os.path.dirname(__file__), "cp_hf_llama_model.py")
    whole = count_step_costs(model, N, sharding="fsdp")
    split = count_step_costs(model, N, sharding="fsdp", world_size=2, parallel=Layout(tp=2))
    for phase in ("forward", "backward"):
        flops = {name: sum(o.flops for o in costs.ops if o.phase == phase)
                 for name, costs in (("whole", whole), ("split", split))}
        assert flops["whole"] > 0 and flops["split"] == flops["whole"] / 2, (phase, flops)
    # The tensor-parallel activations' collectives are timed per block (timing.layout), not
    # recorded twice; the gradient norm's all-reduces over the mesh are.
    assert {(c.kind, c.phase) for c in split.collectives} == {("all_reduce", "optimizer")}
