"""The step-time model (autotune.timing): exact FLOPs of the fake step, recompute under
checkpointing, FSDP2's collectives, the roofline, the CPU speed cache and ``estimate --time``; the
checkpoint microbenchmark's recomputed ops, and the training loop's own cost per window and per
micro-step (``roofline.window_time``, ``tuning.loop_cost``)."""

import dataclasses
import json
import math
import time

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from autotune import Workload
from autotune.cli.main import cli
from autotune.timing import cpu_profile
from autotune.timing.costs import OpCost, StepCosts, causal_share
from autotune.timing.count import count_step_costs, count_steps_costs
from autotune.timing.roofline import DeviceSpeed, compute_time, speed_for_profile, window_time
from autotune.timing.window import StepModel, WindowTime, predict_window
from autotune.tuning import loop_cost

N, D_IN, D_HID, D_OUT = 4, 16, 32, 8


def _sum_loss(model, batch):
    return model(batch).sum()


def _workload(build) -> Workload:
    return Workload(model=build, make_batch=lambda n: torch.randn(n, D_IN), loss_fn=_sum_loss,
                    build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    source=build.__name__)


def _two_linears():
    return nn.Sequential(nn.Linear(D_IN, D_HID, bias=False), nn.Linear(D_HID, D_OUT, bias=False))


def _blocks():
    # ReLU saves its output, so recomputing a block re-runs every op of it.
    def block(i, o):
        return nn.Sequential(nn.Linear(i, o, bias=False), nn.ReLU())

    return nn.Sequential(block(D_IN, D_HID), block(D_HID, D_HID), block(D_HID, D_OUT))


def test_matmul_flops_are_exact_forward_and_backward():
    costs = count_step_costs(_workload(_two_linears), N)
    first, second = 2 * N * D_IN * D_HID, 2 * N * D_HID * D_OUT
    by_phase = costs.flops_by("phase")
    assert by_phase["forward"] == first + second
    # Backward: the gradients of both weights and of the second layer's input (the batch needs
    # none): twice the forward, less the first layer's input gradient.
    assert by_phase["backward"] == 2 * (first + second) - first
    assert costs.flops_by("op_class")["matmul"] == costs.total_flops
    assert {op.kernel for op in costs.ops if op.flops} == {"mm"}
    assert costs.flops_by("op_class").get("optimizer", 0) == 0
    assert costs.count_by("phase")["optimizer"] > 0  # AdamW's update ops, with their bytes
    assert costs.bytes_by("phase")["optimizer"] > 4 * (D_IN * D_HID + D_HID * D_OUT) * 4


def test_recompute_under_checkpointing_is_the_checkpointed_forward():
    off = count_step_costs(_workload(_blocks), N, checkpointing=False)
    on = count_step_costs(_workload(_blocks), N, checkpointing=True)
    forward = 2 * N * (D_IN * D_HID + D_HID * D_HID + D_HID * D_OUT)
    assert off.flops_by("phase").get("recompute", 0) == 0
    assert on.flops_by("phase")["recompute"] == forward
    assert on.total_flops == off.total_flops + forward
    for phase in ("forward", "backward"):
        assert on.flops_by("phase")[phase] == off.flops_by("phase")[phase]


def test_module_calls_and_checkpoint_blocks_are_counted_exactly():
    off = count_step_costs(_workload(_blocks), N, checkpointing=False)
    on = count_step_costs(_workload(_blocks), N, checkpointing=True)
    # The outer Sequential, its three blocks and their Linear and ReLU each: 1 + 3 + 6 calls.
    assert off.module_calls == {"forward": 10}
    assert off.checkpoint_blocks == 0
    # Checkpointed, each block is recomputed once by its own forward: its Linear and ReLU again.
    assert on.module_calls == {"forward": 10, "recompute": 6}
    assert on.checkpoint_blocks == 3


def _language_model():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = nn.Embedding(50, D_HID), nn.LayerNorm(D_HID)
            self.head = nn.Linear(D_HID, 50)

        def forward(self, tokens):
            logits = self.head(nn.functional.silu(nn.functional.gelu(self.norm(self.embed(tokens)))))
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    return Tiny()


def test_norm_softmax_embedding_and_loss_kernels_are_told_apart():
    workload = Workload(model=_language_model, make_batch=lambda n: torch.randint(0, 50, (n, 6)),
                        loss_fn=lambda model, batch: model(batch), source="tiny language model",
                        build_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    kernels = {op.kernel for op in count_step_costs(workload, N).ops}
    families = ("layer_norm", "softmax", "embedding", "nll_loss", "gelu", "silu")
    for family in families:
        assert {family, f"{family}_backward"} <= kernels


def test_every_counted_family_has_its_curves_measured(monkeypatch):
    monkeypatch.setattr(cpu_profile, "_op_times", lambda ops: [2e-6] + [1e-3] * (len(ops) - 1))
    rates = cpu_profile._counted_kernel_rates()
    for family in ("layer_norm", "softmax", "embedding", "nll_loss", "gelu", "silu"):
        for name in (family, f"{family}_backward"):
            assert len(rates[name]) == len(cpu_profile.ROWS) and all(rate > 0 for _, rate in rates[name])


def test_roofline_adds_module_calls_checkpoint_blocks_and_optimizer_ops():
    costs = StepCosts(ops=(OpCost("optimizer", "optimizer", flops=0, bytes=0, count=4),),
                      collectives=(), micro_batch=1, module_calls={"forward": 5, "recompute": 3},
                      checkpoint_blocks=2)
    parts = compute_time(costs, _cached_speed())
    assert parts["other"] == pytest.approx(5 * 2e-6)
    assert parts["recompute"] == pytest.approx(3 * 2e-6 + 2 * 4e-4)
    assert parts["optimizer"] == pytest.approx(4 * 5e-6)
    assert compute_time(costs, _speed())["optimizer"] == pytest.approx(4 * 1e-6)  # none: per op


def test_scaled_speed_follows_the_probe():
    speed = _cached_speed()
    scaled = cpu_profile.scaled_speed(speed, (100.0, 10.0, 1e-6), (50.0, 20.0, 3e-6))
    assert scaled.peak_flops["fp32"] == pytest.approx(speed.peak_flops["fp32"] / 2)
    assert scaled.memory_bandwidth == pytest.approx(speed.memory_bandwidth * 2)
    for name in ("op_overhead_s", "recompute_op_overhead_s", "optimizer_op_overhead_s",
                 "module_call_s", "checkpoint_block_s"):
        assert getattr(scaled, name) == pytest.approx(3 * getattr(speed, name))
    assert scaled.matmul_curve == speed.matmul_curve  # fractions of the peak: unchanged
    assert scaled.cold_write_s_per_byte == pytest.approx(speed.cold_write_s_per_byte / 2)  # as bytes


def test_memory_kernel_microbenchmarks_count_bytes_as_the_step_does():
    x = torch.randn(64, 32, requires_grad=True)
    weight, bias = torch.ones(32, requires_grad=True), torch.zeros(32, requires_grad=True)
    forward, backward = cpu_profile._family_bytes(
        "layer_norm", lambda: nn.functional.layer_norm(x, (32,), weight, bias))
    # Reads x, weight, bias; writes the output, the mean and the inverse deviation per row.
    assert forward == 4 * (2 * 64 * 32 + 2 * 32 + 2 * 64)
    assert backward > 4 * 2 * 64 * 32  # reads the output's gradient and x, writes x's gradient


def test_one_thread_microbenchmarks_read_the_thread_cpu_clock():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_profile.clock() is time.thread_time
        torch.set_num_threads(2)
        assert cpu_profile.clock() is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_a_curves_sizes_are_timed_in_turns_on_one_clock(monkeypatch):
    # A machine slowing down steadily over the measurement (each op takes 1 + 10 t times its
    # work at t seconds). Timed one size after the other, the larger size would be timed later
    # alone, and its rate come out lower (a ratio of 6.7); in turns, both sizes
    # see the same moments and their ratio is the work's.
    now = [0.0]
    runs = []

    def drifting(work):
        def op():
            now[0] += work * (1.0 + 10.0 * now[0])
            runs.append(work)
        return op

    monkeypatch.setattr(cpu_profile, "clock", lambda: lambda: now[0])
    monkeypatch.setattr(cpu_profile, "_MIN_SECONDS", 0.01)
    small, large = cpu_profile._op_times([drifting(1e-3), drifting(4e-3)])
    assert large / small == pytest.approx(4.0, rel=0.1)
    # The timed runs alternate op by op after each op's first two calls (warm-up, calibration).
    timed = runs[4:]
    switches = sum(a != b for a, b in zip(timed, timed[1:]))
    assert switches == 2 * cpu_profile._REPEATS - 1


def test_every_size_of_a_curve_is_timed_in_one_group_beside_the_call_it_subtracts(monkeypatch):
    groups = []

    def recorded(ops):
        groups.append(len(ops))
        return [2e-6] + [1e-3] * (len(ops) - 1)

    monkeypatch.setattr(cpu_profile, "_op_times", recorded)
    rates = cpu_profile._kernel_rates()
    points = len(cpu_profile.CONVOLUTIONS) + 2 * len(cpu_profile.ATTENTIONS)  # causal and not
    # The one-element op, each forward, and each forward with its backward: one group.
    assert groups == [1 + 2 * points]
    assert rates["convolution"][0][1] == pytest.approx(2.0 * 8 * 16 * 32 * 32 * 8 * 9 / (1e-3 - 2e-6))
    # The same attention timed as long either way: the causal rate is per pair its mask keeps.
    head, length = cpu_profile.ATTENTIONS[0]
    whole = 4.0 * 2 * 8 * length * length * head / (1e-3 - 2e-6)
    assert rates["attention"][0][1] == pytest.approx(whole)
    assert rates["attention_causal"][0][1] == pytest.approx(whole * causal_share(length, length))
    assert rates["attention_causal_backward"][0][0] == 2 * rates["attention_causal"][0][0]


def test_the_bandwidth_adds_share_one_buffer_and_never_overwrite_their_inputs(monkeypatch):
    built = []
    monkeypatch.setattr(cpu_profile, "_cycling_add",
                        lambda inputs, outputs, n, inplace=False: built.append((inputs, outputs, n, inplace)))
    monkeypatch.setattr(cpu_profile, "_STREAM_BYTES", 4 * 3 * 2**10)
    cpu_profile._streaming_adds([2**4, 2**6])
    (inputs, outputs, _, _), (same_inputs, same_outputs, _, _) = built
    assert inputs is same_inputs and outputs is same_outputs  # one buffer, not one per size
    assert 4 * (inputs.numel() + outputs.numel()) == pytest.approx(cpu_profile._STREAM_BYTES, rel=1e-6)
    built.clear()
    cpu_profile._streaming_adds([2**4, 2**6], inplace=True)  # then the in-place adds, same buffer
    assert [(n, inplace) for *_, n, inplace in built] == [(2**4, False), (2**6, False), (2**4, True), (2**6, True)]
    assert len({id(inputs) for inputs, *_ in built}) == 1
    built.clear()
    cpu_profile._streaming_adds([2**11])  # a set larger than the buffer: two sets, not one
    (inputs, outputs, n, _), = built
    assert outputs.numel() == 2 * n and inputs.numel() == 4 * n
    monkeypatch.undo()

    inputs, outputs = torch.randn(2 * 64), torch.zeros(64)
    before = inputs.clone()
    for n in (4, 16, 64):
        add = cpu_profile._cycling_add(inputs, outputs, n)
        for _ in range(40):  # every set, several times
            add()
    assert torch.equal(inputs, before)
    # Set i of n elements adds inputs [2in, (2i+1)n) and [(2i+1)n, (2i+2)n) into outputs [in, (i+1)n).
    assert torch.equal(outputs, inputs[:64] + inputs[64:])
    # In place, set i adds inputs [2in, (2i+1)n) to outputs [in, (i+1)n): once per turn.
    outputs.zero_()
    add = cpu_profile._cycling_add(inputs, outputs, 16, inplace=True)
    for _ in range(3 * 4):  # every one of the 4 sets three times
        add()
    assert torch.equal(inputs, before)
    assert torch.allclose(outputs, 3 * torch.cat([inputs[32 * i:32 * i + 16] for i in range(4)]))


def test_measured_windows_read_the_given_clock():
    from autotune.memory.cpu import CPUMemoryBackend
    from autotune.tuning.measure import Configuration, measure_configuration

    ticks = iter(range(10**6))
    config = Configuration(precision="fp32", checkpointing="off", micro_batches=(N,))
    result = measure_configuration(_workload(_two_linears), CPUMemoryBackend(), config, windows=3,
                                   min_seconds=0, clock=lambda: float(next(ticks)))
    assert result.window_seconds == (1.0, 1.0, 1.0)  # one tick at each window's start and end


def _fsdp_blocks():
    return nn.Sequential(*(nn.Sequential(nn.Linear(D_HID, D_HID), nn.ReLU()) for _ in range(3)))


def test_fsdp_collectives_gather_and_scatter_each_block():
    workload = Workload(model=_fsdp_blocks, make_batch=lambda n: torch.randn(n, D_HID),
                        loss_fn=_sum_loss, source="fsdp-blocks")
    costs = count_step_costs(workload, N, sharding="fsdp", world_size=4)
    block_bytes = (D_HID * D_HID + D_HID) * 4  # fp32 weight and bias, gathered whole
    gathers = [c for c in costs.collectives if c.kind == "all_gather"]
    scatters = [c for c in costs.collectives if c.kind == "reduce_scatter"]
    assert {c.group_size for c in costs.collectives} == {4}
    assert [c.bytes for c in gathers if c.phase == "forward"] == [block_bytes] * 3
    # Resharded after forward: the backward gathers the blocks again (FSDP2 keeps the last one).
    assert all(c.bytes == block_bytes for c in gathers)
    assert len([c for c in gathers if c.phase == "backward"]) >= 2
    assert [c.bytes for c in scatters] == [block_bytes] * 3
    assert all(c.phase == "backward" for c in scatters)
    # Each rank computes the whole micro-batch's matmuls on the gathered parameters.
    assert costs.flops_by("phase")["forward"] == 3 * 2 * N * D_HID * D_HID


def _speed(**changes) -> DeviceSpeed:
    values = dict(name="test", peak_flops={"fp32": 1e9}, memory_bandwidth=1e8,
                  fractions={"matmul": 0.5, "attention": 0.25, "memory": 0.5}, op_overhead_s=1e-6)
    return DeviceSpeed(**{**values, **changes})


def test_roofline_takes_the_slower_of_flops_and_bytes_plus_overhead():
    costs = StepCosts(ops=(OpCost("matmul", "forward", flops=2e6, bytes=1e3, count=2),
                           OpCost("elementwise", "backward", flops=0, bytes=1e5, count=1),
                           OpCost("matmul", "recompute", flops=1e3, bytes=1e5, count=1)),
                      collectives=(), micro_batch=1)
    parts = compute_time(costs, _speed())
    assert parts["matmul"] == pytest.approx(2 * (1e6 / 5e8 + 1e-6))  # compute-bound
    assert parts["elementwise"] == pytest.approx(1e5 / 5e7 + 1e-6)
    assert parts["recompute"] == pytest.approx(1e5 / 5e7 + 1e-6)  # memory-bound
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


def test_roofline_uses_a_kernel_family_curve_where_the_device_has_one():
    costs = StepCosts(ops=(OpCost("matmul", "backward", flops=1e6, bytes=0, count=1,
                                  kernel="convolution_backward"),
                           OpCost("matmul", "backward", flops=1e6, bytes=0, count=1, kernel="mm")),
                      collectives=(), micro_batch=1)
    curves = {"convolution_backward": ((1e3, 0.1), (1e9, 0.1))}
    parts = compute_time(costs, _speed(op_overhead_s=0.0, matmul_curve={"fp32": ((1e3, 1.0),)},
                                       kernel_curves=curves))
    assert parts["matmul"] == pytest.approx(1e6 / 1e8 + 1e6 / 1e9)


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 2))


def test_bytes_count_each_input_once_and_views_none():
    from autotune.timing.count import _bytes_moved

    aten = torch.ops.aten
    state, grad = torch.zeros(256), torch.ones(256)
    # exp_avg_sq.addcmul_(grad, grad): the gradient is read once, the state read and written.
    out = aten.addcmul_.default(state, grad, grad)
    assert _bytes_moved(aten.addcmul_.default, (state, grad, grad), {}, out) == 3 * 4 * 256
    # matmul returns its reshaped output through _unsafe_view, a view whose schema does not say so.
    viewed = aten._unsafe_view.default(grad, [16, 16])
    assert viewed.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    assert _bytes_moved(aten._unsafe_view.default, (grad, [16, 16]), {}, viewed) == 0.0


def test_in_place_ops_are_a_kernel_family_of_their_own():
    # In place, an op writes where it reads; out of place, a CPU first reads its output's cache
    # lines to write them: the two reach different bandwidths per byte counted.
    workload = _workload(_two_linears)
    costs = count_step_costs(workload, N)
    optimizer = {op.kernel for op in costs.ops if op.phase == "optimizer" and op.bytes}
    assert "inplace" in optimizer and "" in optimizer  # AdamW's lerp_, addcmul_ ...; its sqrt, div
    speed = _speed(op_overhead_s=0.0, fractions={"matmul": 1.0, "attention": 1.0, "memory": 1.0},
                   kernel_byte_curves={"inplace": ((1.0, 2.0),)})
    plain = dataclasses.replace(speed, kernel_byte_curves={})
    inplace_ops = [op for op in costs.ops if op.kernel == "inplace"]
    assert inplace_ops
    for op in inplace_ops:
        faster = compute_time(dataclasses.replace(costs, ops=(op,)), speed)["total"]
        assert faster == pytest.approx(compute_time(dataclasses.replace(costs, ops=(op,)), plain)["total"] / 2)


def test_convolution_pooling_and_batch_norm_are_told_apart():
    workload = Workload(model=_conv_net, make_batch=lambda n: torch.randn(n, 3, 8, 8),
                        loss_fn=_sum_loss, source="conv-net")
    kernels = {(op.kernel, op.phase) for op in count_step_costs(workload, 2).ops
               if op.kernel and op.kernel != "inplace"}
    assert kernels == {(k, phase) for base in ("convolution", "batch_norm", "pooling", "mm")
                       for k, phase in ((base, "forward"), (f"{base}_backward", "backward"))
                       if k != "mm_backward"} | {("mm", "backward")}
    speed = _cached_speed()
    assert speed.byte_rate(1e3, "pooling") == pytest.approx(0.1 * speed.memory_bandwidth)
    assert speed.byte_rate(1e3) == pytest.approx(2.0 * speed.memory_bandwidth)


def test_recomputed_ops_take_the_recompute_overhead():
    costs = StepCosts(ops=(OpCost("other", "recompute", flops=0, bytes=0, count=10),),
                      collectives=(), micro_batch=1)
    assert compute_time(costs, _cached_speed())["recompute"] == pytest.approx(10 * 3e-5)
    assert compute_time(costs, _speed())["recompute"] == pytest.approx(10 * 1e-6)


def test_gpu_profile_speed_uses_its_datasheet_peaks():
    speed = speed_for_profile("h100-80gb")
    assert speed.peak_flops["bf16"] == pytest.approx(989.5e12)
    assert speed.memory_bandwidth == pytest.approx(3350e9)
    assert all(0 < f <= 1 for f in speed.fractions.values())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_device_speed_refuses_non_finite_or_negative_numbers(bad):
    with pytest.raises(ValueError):
        _speed(memory_bandwidth=bad)


def _cached_speed() -> DeviceSpeed:
    return _speed(matmul_curve={"fp32": ((1e3, 0.1), (1e9, 1.0))}, memory_curve=((1e3, 2.0), (1e8, 1.0)),
                  kernel_curves={"convolution_backward": ((1e3, 0.05),)},
                  kernel_byte_curves={"pooling": ((1e3, 0.1), (1e6, 0.2)), "layer_norm": ((1e3, 0.3),)},
                  recompute_op_overhead_s=3e-5, module_call_s=2e-6, checkpoint_block_s=4e-4,
                  optimizer_op_overhead_s=5e-6, cold_write_s_per_byte=2e-10)


def test_cpu_speed_cache_round_trips_and_is_used(tmp_path, monkeypatch):
    speed = _cached_speed()
    cpu_profile.save_cached(tmp_path / cpu_profile.CACHE_FILE, cpu_profile.machine_key(), speed)
    assert cpu_profile.load_cached(tmp_path / cpu_profile.CACHE_FILE, cpu_profile.machine_key()) == speed

    def no_measuring():
        raise AssertionError("measured although cached")

    monkeypatch.setattr(cpu_profile, "measure_cpu_speed", no_measuring)
    assert cpu_profile.cpu_speed(cache_dir=tmp_path) == speed


@pytest.mark.parametrize("corrupt", ["not json", "[]", "NaN-entry", "other-key", "negative"])
def test_cpu_speed_cache_refuses_corrupt_files(tmp_path, monkeypatch, corrupt):
    path, key = tmp_path / cpu_profile.CACHE_FILE, cpu_profile.machine_key()
    cpu_profile.save_cached(path, key, _cached_speed())
    entry = json.loads(path.read_text())[key]
    if corrupt == "NaN-entry":
        entry["memory_bandwidth"] = math.nan
        path.write_text(json.dumps({key: entry}))
    elif corrupt == "negative":
        entry["op_overhead_s"] = -1
        path.write_text(json.dumps({key: entry}))
    elif corrupt == "other-key":
        path.write_text(json.dumps({"another machine": entry}))
    else:
        path.write_text(corrupt)
    assert cpu_profile.load_cached(path, key) is None
    fresh = dataclasses.replace(_cached_speed(), name="measured again")
    monkeypatch.setattr(cpu_profile, "measure_cpu_speed", lambda: fresh)
    assert cpu_profile.cpu_speed(cache_dir=tmp_path) == fresh
    assert cpu_profile.load_cached(path, key) == fresh  # and the file is good again


def test_cli_estimate_time_prints_the_breakdown(monkeypatch):
    result = CliRunner().invoke(cli, ["estimate", "examples/mlp.py", "--micro-batch", "8",
                                      "--micro-batch", "64", "--time", "--gpu", "h100-80gb"])
    assert result.exit_code == 0, result.output
    assert "H100" in result.output and "matmul ms" in result.output and "recompute ms" in result.output
    # On this CPU the step is the loop's window of one micro-step: the loop's own cost is in it.
    speed = dataclasses.replace(_cached_speed(), loop_micro_step_s=3e-5, loop_window_s=2e-4)
    monkeypatch.setattr(loop_cost, "cpu_speed_with_loop", lambda **_: speed)
    result = CliRunner().invoke(cli, ["estimate", "examples/mlp.py", "--micro-batch", "8", "--time",
                                      "--checkpointing", "on", "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)["8"]
    assert answer["device"] == "test" and answer["flops"] > 0
    assert answer["breakdown_seconds"]["loop"] == pytest.approx(2e-4 + 3e-5)
    assert answer["seconds"] == pytest.approx(sum(answer["breakdown_seconds"].values()))


def test_window_time_adds_the_loop_per_window_and_per_micro_step_and_one_optimizer_step():
    costs = StepCosts(ops=(OpCost("elementwise", "forward", flops=0, bytes=0, count=10),
                           OpCost("optimizer", "optimizer", flops=0, bytes=0, count=4)),
                      collectives=(), micro_batch=1)
    speed = _speed(loop_micro_step_s=3e-5, loop_window_s=2e-4)
    parts = window_time(costs, speed, 5)
    assert parts["elementwise"] == pytest.approx(5 * 10 * 1e-6)
    assert parts["optimizer"] == pytest.approx(4 * 1e-6)  # once per window
    assert parts["loop"] == pytest.approx(2e-4 + 5 * 3e-5)
    assert parts["total"] == pytest.approx(5 * 10e-6 + 4e-6 + 2e-4 + 5 * 3e-5)
    assert window_time(costs, _speed(), 1)["loop"] == 0.0  # a profile without loop costs
    with pytest.raises(ValueError):
        window_time(costs, speed, 0)


def test_predicted_window_adds_the_loop_per_window_and_per_micro_step():
    costs = StepCosts(ops=(OpCost("elementwise", "forward", flops=0, bytes=0, count=10),
                           OpCost("optimizer", "optimizer", flops=0, bytes=0, count=4)),
                      collectives=(), micro_batch=2)
    bare = predict_window(StepModel({2: costs}, _speed(), "fp32"), [2, 2, 2])
    with_loop = predict_window(StepModel({2: costs}, _speed(loop_micro_step_s=3e-5, loop_window_s=2e-4),
                                         "fp32"), [2, 2, 2])
    assert bare.loop_s == 0.0  # a GPU profile has no loop costs
    assert with_loop.loop_s == pytest.approx(2e-4 + 3 * 3e-5)
    assert with_loop.step_s == pytest.approx(bare.step_s + with_loop.loop_s)
    assert with_loop.compute_s == pytest.approx(bare.compute_s)  # the loop is not compute
    assert with_loop.samples_per_s == pytest.approx(6 / with_loop.step_s)
    assert WindowTime.from_dict(with_loop.to_dict()) == with_loop


def test_scaled_speed_scales_the_loop_costs_as_every_per_call_cost():
    speed = _speed(loop_micro_step_s=3e-5, loop_window_s=2e-4)
    scaled = cpu_profile.scaled_speed(speed, (100.0, 10.0, 1e-6), (100.0, 10.0, 2e-6))
    assert scaled.loop_micro_step_s == pytest.approx(6e-5)
    assert scaled.loop_window_s == pytest.approx(4e-4)


def test_checkpoint_microbenchmark_divides_by_the_ops_the_step_counts_as_recomputed():
    body, leaves = cpu_profile._checkpoint_layers(3)

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList(leaves[1:])

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)

    workload = Workload(model=Layers, make_batch=lambda n: torch.randn(n, 4),
                        loss_fn=lambda model, batch: model(batch).sum(), source="layers")
    recomputed = sum(op.count for op in count_step_costs(workload, 2).ops if op.phase == "recompute")
    assert recomputed == cpu_profile._recomputed_ops(body, leaves)


def test_checkpoint_microbenchmark_is_finite_and_not_negative():
    # What it measures is the bench's business (per_op came out 0.0 once in CI: the difference of
    # two noisy medians, clamped); here, that a real run gives usable numbers.
    block, per_op = cpu_profile._checkpoint_overheads(5e-6)
    assert math.isfinite(block) and block >= 0
    assert math.isfinite(per_op) and per_op >= 0


def test_checkpoint_microbenchmark_splits_the_extra_time_into_block_and_recomputed_ops(monkeypatch):
    # A machine where every dispatched op takes 2 us and a checkpointed block 30 us more: the
    # derivation gives back exactly those.
    op_cost, block_cost = 2e-6, 30e-6

    def timed(op):
        checkpointed = cpu_profile._dispatched_ops(op, recomputed=True) > 0
        return op_cost * cpu_profile._dispatched_ops(op) + (block_cost if checkpointed else 0.0)

    monkeypatch.setattr(cpu_profile, "_op_times", lambda ops: [timed(op) for op in ops])
    block, per_op = cpu_profile._checkpoint_overheads(op_cost)
    assert per_op == pytest.approx(op_cost, rel=1e-9)
    assert block == pytest.approx(block_cost, rel=1e-9)


def test_loop_costs_are_measured_once_and_cached_with_the_profile(tmp_path, monkeypatch):
    speed = _speed(peak_flops={"fp32": 1e11}, memory_bandwidth=1e10,
                   matmul_curve={"fp32": ((1e3, 0.1), (1e9, 1.0))})
    monkeypatch.setattr(cpu_profile, "measure_cpu_speed", lambda: speed)
    measured = loop_cost.cpu_speed_with_loop(cache_dir=tmp_path)
    for value in (measured.loop_micro_step_s, measured.loop_window_s):
        assert math.isfinite(value) and value >= 0
    assert measured.loop_micro_step_s + measured.loop_window_s > 0  # the loop does cost something
    assert dataclasses.replace(measured, loop_micro_step_s=0.0, loop_window_s=0.0,
                               sources=speed.sources) == speed

    def no_measuring(_):
        raise AssertionError("measured although cached")

    monkeypatch.setattr(loop_cost, "with_loop_costs", no_measuring)
    assert loop_cost.cpu_speed_with_loop(cache_dir=tmp_path) == measured


def test_loop_costs_come_from_two_windows_taking_turns(monkeypatch):
    # A window of 8 samples as one micro-step and as 8: timed side by side on the profile's clock
    # (``compare_configurations``), the loop's costs are what is left beyond the roofline's step.
    from autotune.tuning.measure import Measurement

    speed = _speed(peak_flops={"fp32": 1e11}, memory_bandwidth=1e10)
    costs = count_steps_costs(loop_cost._trivial_workload(), [1, 8])
    bare = {steps: window_time(costs[size], speed, steps)["total"] for steps, size in ((1, 8), (8, 1))}
    window_s, micro_step_s = 300e-6, 40e-6
    calls = []

    def compared(workload, backend, configs, *, seconds, clock):
        calls.append(([config.micro_batches for config in configs], clock))
        return [Measurement(samples_per_s=1.0, peak_bytes=None,
                            window_seconds=(9.0, bare[steps] + window_s + steps * micro_step_s, 0.0))
                for steps in (1, 8)]

    monkeypatch.setattr(loop_cost, "compare_configurations", compared)
    measured = loop_cost.with_loop_costs(speed)
    assert calls == [([(8,), (1,) * 8], cpu_profile.clock())]
    assert measured.loop_micro_step_s == pytest.approx(micro_step_s, rel=1e-9)
    assert measured.loop_window_s == pytest.approx(window_s, rel=1e-9)


def test_a_pipeline_window_divides_into_micro_steps_and_keeps_its_one_reduce_scatter():
    """``count._per_micro_step``: a pipeline rank's window of 4 micro-steps alike, as one
    micro-step and its optimizer phase; the sharded stage's reduce-scatter (once per window, on
    the last backward) and the optimizer's ops stay whole."""
    from autotune.timing.costs import CollectiveCall
    from autotune.timing.count import _per_micro_step

    window = StepCosts(
        ops=(OpCost("matmul", "forward", flops=400.0, bytes=80.0, count=8),
             OpCost("matmul", "backward", flops=800.0, bytes=160.0, count=16),
             OpCost("optimizer", "optimizer", flops=0.0, bytes=64.0, count=3)),
        collectives=(*[CollectiveCall("send", 1024, 2, "forward")] * 4,
                     *[CollectiveCall("all_gather", 512, 2, "forward")] * 8,
                     CollectiveCall("reduce_scatter", 2048, 2, "backward"),
                     CollectiveCall("all_reduce", 4, 2, "optimizer")),
        micro_batch=2, module_calls={"forward": 40, "optimizer": 1}, checkpoint_blocks=8)
    one = _per_micro_step(window, 4)
    assert one.flops_by("phase") == {"forward": 100.0, "backward": 200.0, "optimizer": 0.0}
    assert one.count_by("phase") == {"forward": 2, "backward": 4, "optimizer": 3}
    assert one.bytes_by("phase")["optimizer"] == 64.0
    kinds = sorted((c.kind, c.phase) for c in one.collectives)
    assert kinds == [("all_gather", "forward"), ("all_gather", "forward"), ("all_reduce", "optimizer"),
                     ("reduce_scatter", "backward"), ("send", "forward")]
    assert one.module_calls == {"forward": 10, "optimizer": 1} and one.checkpoint_blocks == 2
    assert _per_micro_step(window, 1) is window
