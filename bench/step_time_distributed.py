"""Predicted vs measured step time of 2- and 4-rank gloo training on this CPU, DDP and FSDP2.

Each run starts ``world`` processes (gloo, one torch thread each). Every rank first measures, all at
once so they share the machine as the training does, this CPU's speed
(``autotune.timing.cpu_profile.measure_cpu_speed``, FSDP2's and DTensor's per-call costs included),
then, in the process group, the gloo link (``timing.gloo.measure_gloo``: wall time) and each
collective's CPU cost (``timing.gloo.measure_gloo_cpu``: the process's CPU clock); collectives
only. Then every configuration (ddp / fsdp x checkpointing off / on x three micro-batches) trains
real steps — forward, backward, gradient clipping, optimizer step, as the probe's step — and rank 0
keeps the median step on the process's CPU clock (every thread's work, gloo's included, without
the time the scheduler gave other processes or the time a rank waited for another) and the median
wall time beside it.

The parent process predicts the same quantity from the fake-tensor count: the step's compute on
the measured speed (``StepModel``/``predict_window``'s ``compute_s``: ops, module calls,
checkpointed blocks, FSDP2's hooks, DTensor dispatch; on the main thread) plus every collective's
CPU cost (``collective_cpu_seconds``: gloo's threads), which a CPU clock counts whether or not it
overlaps compute; waiting (the exposed communication of the wall-time model) is not CPU time. The
wall-time prediction (``step_s``: compute + exposed communication on the measured link) is printed
beside it, with the measured wall time; on a machine whose cores are shared by more threads than
it has, wall time measures the other processes as much as the step.

    OMP_NUM_THREADS=1 python bench/step_time_distributed.py [--worlds 2 4] [--example tiny_lm]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.distributed.sharding.wrap import build_mesh, shard_model  # noqa: E402
from autotune.timing.comm import Link, Network  # noqa: E402
from autotune.timing.count import count_steps_costs  # noqa: E402
from autotune.timing.cpu_profile import load_cached, measure_cpu_speed, save_cached  # noqa: E402
from autotune.timing.gloo import CollectiveCpu, collective_cpu_seconds, measure_gloo, measure_gloo_cpu  # noqa: E402
from autotune.timing.window import StepModel, predict_window, trainable_bytes, window_collectives  # noqa: E402
from autotune.workload import load_workload  # noqa: E402
from autotune.workload.activation_checkpointing import enable_checkpointing  # noqa: E402
from step_time_accuracy import spearman  # noqa: E402

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MICRO_BATCHES = {"tiny_lm": (4, 8, 16), "mlp": (64, 256, 1024), "gpt_varlen": (2, 4, 8)}
WARMUP, TIMED = 2, 9


def configurations(example: str):
    return [(sharding, ckpt, n) for sharding in ("ddp", "fsdp") for ckpt in (False, True)
            for n in MICRO_BATCHES[example]]


def _worker(rank: int, world: int, port: int, example: str, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    speed = measure_cpu_speed(precisions=("fp32",))  # before the process group: see sharded_profile
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        link, cpu = measure_gloo(), measure_gloo_cpu()
        workload = load_workload(str(ROOT / "examples" / f"{example}.py"))
        measured = [t for sharding, ckpt, n in configurations(example)
                    for t in _step_times(workload, sharding, ckpt, n, world)]
        if rank == 0:
            save_cached(Path(out), "speed", speed)
            Path(out).with_suffix(".txt").write_text(" ".join(map(repr, [
                link.bandwidth, link.latency, *(cpu.per_call[k] for k in KINDS),
                *(cpu.per_byte[k] for k in KINDS), *measured])))
    finally:
        dist.destroy_process_group()


def _step_times(workload, sharding: str, ckpt: bool, n: int, world: int) -> tuple[float, float]:
    """(median on the process's CPU clock, median wall time) of the timed steps."""
    torch.manual_seed(0)
    model = workload.new_model()
    if sharding == "fsdp":
        shard_model(model, mesh=build_mesh("cpu", world, world), sharding="fsdp")
        if ckpt:
            enable_checkpointing(model)
        wrapped = model
    else:
        if ckpt:
            enable_checkpointing(model)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer = workload.new_optimizer(params)
    batch = workload.batch(n)
    times, walls = [], []
    for _ in range(WARMUP + TIMED):
        dist.barrier()
        start, wall = time.process_time(), time.perf_counter()
        loss, _ = workload.loss(wrapped, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.process_time() - start)
        walls.append(time.perf_counter() - wall)
    return statistics.median(times[WARMUP:]), statistics.median(walls[WARMUP:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, example: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="throughput_gloo_") as tmp:
        out = str(Path(tmp) / "speed.json")
        mp.spawn(_worker, args=(world, _free_port(), example, out), nprocs=world, join=True)
        speed = load_cached(Path(out), "speed")
        numbers = [float(x) for x in Path(out).with_suffix(".txt").read_text().split()]
    link = Link(bandwidth=numbers[0], latency=numbers[1])
    cpu = CollectiveCpu(per_call=dict(zip(KINDS, numbers[2:5])), per_byte=dict(zip(KINDS, numbers[5:8])))
    network = Network(intra=link, inter=None, gpus_per_node=world)
    workload = load_workload(str(ROOT / "examples" / f"{example}.py"))
    gradient_bytes = trainable_bytes(workload)
    rows, models = [], {}
    steps = numbers[8:]
    for i, (sharding, ckpt, n) in enumerate(configurations(example)):
        if (sharding, ckpt) not in models:
            counted = count_steps_costs(workload, MICRO_BATCHES[example], checkpointing=ckpt,
                                        sharding=sharding, world_size=world)
            models[sharding, ckpt] = StepModel(counted, speed, "fp32")
        model = models[sharding, ckpt]
        window = predict_window(model, [n], network=network, world_size=world, sharding=sharding,
                                gradient_bytes=gradient_bytes)
        gloo_cpu = collective_cpu_seconds(window_collectives(
            model, [n], sharding=sharding, world_size=world, gradient_bytes=gradient_bytes), cpu)
        rows.append(dict(world=world, sharding=sharding, ckpt="on" if ckpt else "off", n=n,
                         predicted=window.compute_s + window.loop_s + gloo_cpu, gloo_cpu=gloo_cpu,
                         wall_predicted=window.step_s, measured=steps[2 * i], wall=steps[2 * i + 1],
                         link=link, cpu=cpu, speed=speed))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--example", default="tiny_lm", choices=sorted(MICRO_BATCHES))
    args = parser.parse_args()
    print(f"example {args.example}; gloo on {os.cpu_count()} CPU core(s); one torch thread per rank")
    print("| world | layout | ckpt | micro | predicted CPU ms | of it gloo CPU | measured CPU ms | ratio "
          "| predicted wall ms | measured wall ms |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for world in args.worlds:
        rows = run(world, args.example)
        for r in rows:
            print(f"| {r['world']} | {r['sharding']} | {r['ckpt']} | {r['n']} | {r['predicted'] * 1e3:.2f} "
                  f"| {r['gloo_cpu'] * 1e3:.2f} | {r['measured'] * 1e3:.2f} "
                  f"| {r['predicted'] / r['measured']:.2f} | {r['wall_predicted'] * 1e3:.2f} "
                  f"| {r['wall'] * 1e3:.2f} |", flush=True)
        link, cpu, speed = rows[0]["link"], rows[0]["cpu"], rows[0]["speed"]
        print(f"world {world}: rank 0's CPU speed: fp32 matmul {speed.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, "
              f"memory {speed.memory_bandwidth / 1e9:.2f} GB/s, {speed.op_overhead_s * 1e6:.2f} us per op, "
              f"cold writes {speed.cold_write_s_per_byte * 2**20 * 1e3:.3f} ms per MiB; "
              f"FSDP2 {speed.fsdp_step_s * 1e6:.0f} us per step + {speed.fsdp_unit_s * 1e6:.0f} us per unit + "
              f"{speed.fsdp_param_s * 1e6:.1f} us per parameter; DTensor {speed.dtensor_op_s * 1e6:.1f} us per op "
              f"+ {speed.dtensor_list_tensor_s * 1e6:.1f} us per listed tensor")
        within = sum(abs(r["predicted"] / r["measured"] - 1) <= 0.25 for r in rows)
        rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
        costs = ", ".join(f"{k} {cpu.per_call[k] * 1e6:.0f} us + {cpu.per_byte[k] * 1e9:.2f} ns/B" for k in KINDS)
        print(f"world {world}: gloo link {link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} us a step; "
              f"CPU per collective: {costs}; {within}/{len(rows)} within 25%; Spearman {rho:.3f}", flush=True)


if __name__ == "__main__":
    main()
