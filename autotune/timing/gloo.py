"""This machine's gloo link, measured: the alpha–beta model's latency and bandwidth for CPU ranks.

Every rank of an initialised gloo process group times all-gathers, reduce-scatters and
all-reduces of a few sizes (the median of several repetitions: the link under the load the
machine has, as the CPU's microbenchmarks take theirs); rank 0's times are fitted to ``steps * alpha + factor * bytes / bandwidth`` with
each collective's own factor and steps (``comm.terms``) by least squares, and every rank gets the
same ``Link`` back. A microbenchmark of the collectives alone, never of training steps.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .comm import Link, terms

SIZES = (2**12, 2**16, 2**20, 2**22)
"""Bytes per collective's full buffer (4 KiB to 4 MiB of fp32)."""
REPEATS = 5
_MEASURED = ("all_gather", "reduce_scatter", "all_reduce")


def measure_gloo(group=None, *, sizes=SIZES, repeats: int = REPEATS) -> Link:
    """The link between this group's ranks (call it on every rank)."""
    p = dist.get_world_size(group)
    rows = []  # (steps, factor * bytes, seconds)
    for kind in _MEASURED:
        for nbytes in sizes:
            seconds = _median_time(kind, nbytes // 4 // p * p, p, group, repeats)
            factor, steps = terms(kind, p)
            rows.append((steps, factor * (nbytes // 4 // p * p) * 4, seconds))
    fitted = torch.tensor([_fit(rows)], dtype=torch.float64)
    dist.broadcast(fitted, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    alpha, inverse_bandwidth = fitted[0].tolist()
    return Link(bandwidth=1.0 / inverse_bandwidth, latency=alpha)


def _median_time(kind: str, elements: int, p: int, group, repeats: int) -> float:
    full = torch.ones(elements)
    shard = torch.ones(elements // p)
    run = {
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "all_reduce": lambda: dist.all_reduce(full, group=group),
    }[kind]
    run()  # the first call sets up the algorithm's buffers
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit(rows) -> tuple[float, float]:
    """Least squares of seconds = alpha * steps + beta * weighted bytes, both kept positive."""
    a = torch.tensor([[s, b] for s, b, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in rows], dtype=torch.float64)
    # Relative error: each row divided by its time, so small collectives weigh as much as large.
    w = 1.0 / y
    alpha, beta = torch.linalg.lstsq(a * w[:, None], (y * w)[:, None]).solution[:, 0].tolist()
    if beta <= 0:
        raise RuntimeError(f"gloo timings give no bandwidth (fitted 1/bandwidth {beta}); rerun on a "
                           f"quieter machine")
    return max(alpha, 0.0), beta


__all__ = ["SIZES", "measure_gloo"]
