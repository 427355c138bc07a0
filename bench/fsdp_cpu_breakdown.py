"""Where a 2-rank gloo FSDP2 step's CPU goes beside DDP's, thread by thread, and how FSDP2's hooks
grow with a unit's bytes (issue 22: the residual of ``step_time_distributed.py``).

Part 1 (2 gloo ranks, tiny_lm, one torch thread each): rank 0's main thread's forward and backward
(``time.thread_time``) and every other thread's CPU (``/proc/self/task/*/schedstat``: gloo's tcp
loop and run loops) over the same steps, DDP and FSDP2, medians of 7 steps after 2 warm-ups.
Part 2 (one process, a fake process group of 2): ``sharded_profile``'s FSDP2 microbenchmark (4
units of 4 ``Linear(W, W)``, sharded less unsharded, less the extra ops at ``op_overhead_s``) at
growing widths W.

    python bench/fsdp_cpu_breakdown.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.distributed.sharding.ranks import fake_process_group  # noqa: E402
from autotune.distributed.sharding.wrap import build_mesh, shard_model  # noqa: E402
from autotune.timing import sharded_profile  # noqa: E402
from autotune.timing.cpu_profile import _dispatched_ops, _op_times, _training_op_overhead  # noqa: E402
from autotune.workload import load_workload  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "tiny_lm.py")
MICRO_BATCHES, WIDTHS, WARMUP, TIMED = (4, 16), (4, 64, 128, 181, 256), 2, 7


def _other_threads_ns() -> dict[str, int]:
    main, out = str(threading.get_native_id()), {}
    for tid in os.listdir("/proc/self/task"):
        if tid != main:
            try:
                out[tid] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
            except OSError:  # the thread ended
                pass
    return out


def _phases(model, workload, n: int) -> tuple[float, float, float]:
    """Median ms of (main thread's forward, its backward, the other threads' CPU)."""
    batch, rows = workload.batch(n), []
    for i in range(WARMUP + TIMED):
        dist.barrier()
        before, t0 = _other_threads_ns(), time.thread_time()
        loss, _ = workload.loss(model, batch)
        t1 = time.thread_time()
        loss.backward()
        t2, after = time.thread_time(), _other_threads_ns()
        model.zero_grad(set_to_none=True)
        others = sum(v - before[k] for k, v in after.items() if k in before) / 1e9
        if i >= WARMUP:
            rows.append((t1 - t0, t2 - t1, others))
    return tuple(statistics.median(c) * 1e3 for c in zip(*rows))


def _worker(rank: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        workload = load_workload(EXAMPLE)
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(workload.new_model())
        torch.manual_seed(0)
        fsdp = shard_model(workload.new_model(), mesh=build_mesh("cpu", 2, 2), sharding="fsdp")
        for n in MICRO_BATCHES:
            a, b = _phases(ddp, workload, n), _phases(fsdp, workload, n)
            if rank == 0:
                print(f"| {n} | {a[0]:.1f} / {a[1]:.1f} | {b[0]:.1f} / {b[1]:.1f} | {a[2]:.1f} | {b[2]:.1f} "
                      f"| {sum(b) - sum(a):.1f} |", flush=True)
    finally:
        dist.destroy_process_group()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("| micro | DDP main fwd / bwd ms | FSDP2 main fwd / bwd ms | DDP other threads ms "
          "| FSDP2 other threads ms | FSDP2 - DDP ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    mp.spawn(_worker, args=(port,), nprocs=2, join=True)
    torch.set_num_threads(1)
    op_overhead = _training_op_overhead()
    print("\n| width | unsharded MiB | FSDP2 extra ms |\n| ---: | ---: | ---: |")
    with fake_process_group(2):
        mesh = build_mesh("cpu", 2, 2)
        for width in WIDTHS:
            sharded_profile._WIDTH = width  # the microbenchmark's layer width
            extra, units, _ = sharded_profile._fsdp_extra(mesh, 4, 4, op_overhead, _op_times, _dispatched_ops)
            nbytes = 4 * (width * width + width) * (4 * (units - 1) + 1)  # units of 4 layers, a root layer
            print(f"| {width} | {nbytes / 2**20:.2f} | {extra * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
