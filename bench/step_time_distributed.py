"""Predicted vs measured step time of 2- and 4-rank gloo training on this CPU, DDP and FSDP2.

Each run starts ``world`` processes (gloo, one torch thread each). Every rank first measures, all at
once so they share the machine as the training does, this CPU's speed
(``autotune.timing.cpu_profile.measure_cpu_speed``) and the gloo link
(``autotune.timing.gloo.measure_gloo``: collectives only). Then every configuration (ddp / fsdp x
checkpointing off / on x three micro-batches) trains real steps — forward, backward, gradient
clipping, optimizer step, as the probe's step — and rank 0 keeps the median step on the process's
CPU clock (its threads' work, gloo's included, without the time the scheduler gave other
processes: the clock the CPU microbenchmarks read at one thread) and the median wall time beside it. The parent
process predicts each step from the fake-tensor count (``predict_window_time``: the roofline on
the measured CPU speed, the alpha–beta model on the measured link, the runtime's overlap) and
prints both, their ratio, and the Spearman rank correlation per world size.

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
from autotune.timing.cpu_profile import load_cached, measure_cpu_speed, save_cached  # noqa: E402
from autotune.timing.gloo import measure_gloo  # noqa: E402
from autotune.timing.window import predict_window_time  # noqa: E402
from autotune.workload import load_workload  # noqa: E402
from autotune.workload.activation_checkpointing import enable_checkpointing  # noqa: E402
from step_time_accuracy import spearman  # noqa: E402

MICRO_BATCHES = {"tiny_lm": (4, 8, 16), "mlp": (64, 256, 1024), "gpt_varlen": (2, 4, 8)}
WARMUP, TIMED = 2, 9


def configurations(example: str):
    return [(sharding, ckpt, n) for sharding in ("ddp", "fsdp") for ckpt in (False, True)
            for n in MICRO_BATCHES[example]]


def _worker(rank: int, world: int, port: int, example: str, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        link = measure_gloo()
        speed = measure_cpu_speed()
        workload = load_workload(str(ROOT / "examples" / f"{example}.py"))
        measured = [t for sharding, ckpt, n in configurations(example)
                    for t in _step_times(workload, sharding, ckpt, n, world)]
        if rank == 0:
            save_cached(Path(out), "speed", speed)
            Path(out).with_suffix(".txt").write_text(
                " ".join(map(repr, [link.bandwidth, link.latency, *measured])))
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
    network = Network(intra=link, inter=None, gpus_per_node=world)
    workload = load_workload(str(ROOT / "examples" / f"{example}.py"))
    rows = []
    steps = numbers[2:]
    for i, (sharding, ckpt, n) in enumerate(configurations(example)):
        measured, wall = steps[2 * i], steps[2 * i + 1]
        predicted = predict_window_time(workload, [n], speed=speed, precision="fp32", checkpointing=ckpt,
                                        sharding=sharding, world_size=world, network=network)
        rows.append(dict(world=world, sharding=sharding, ckpt="on" if ckpt else "off", n=n,
                         predicted=predicted.step_s, exposed=predicted.exposed_comm_s,
                         measured=measured, wall=wall, link=link))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--example", default="tiny_lm", choices=sorted(MICRO_BATCHES))
    args = parser.parse_args()
    print(f"example {args.example}; gloo on {os.cpu_count()} CPU core(s); one torch thread per rank")
    print(f"{'world':>5} {'layout':>6} {'ckpt':>4} {'micro':>5} {'predicted ms':>12} {'(exposed)':>9} "
          f"{'measured ms':>11} {'(wall)':>9} {'ratio':>6}")
    for world in args.worlds:
        rows = run(world, args.example)
        link = rows[0]["link"]
        for r in rows:
            print(f"{r['world']:>5} {r['sharding']:>6} {r['ckpt']:>4} {r['n']:>5} {r['predicted'] * 1e3:>12.2f} "
                  f"{r['exposed'] * 1e3:>9.2f} {r['measured'] * 1e3:>11.2f} {r['wall'] * 1e3:>9.2f} "
                  f"{r['predicted'] / r['measured']:>6.2f}")
        within = sum(abs(r["predicted"] / r["measured"] - 1) <= 0.25 for r in rows)
        rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
        print(f"world {world}: gloo link {link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} us a step; "
              f"{within}/{len(rows)} within 25%; Spearman {rho:.3f}")


if __name__ == "__main__":
    main()
