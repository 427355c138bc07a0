"""This machine's gloo link, measured: the alpha–beta model's latency and bandwidth for CPU ranks.

Every rank of an initialised gloo process group times all-gathers, reduce-scatters and
all-reduces of a few sizes (the median of several repetitions, every kind and size taking turns
repetition by repetition, as the CPU's curves do: the link under the load the machine has, and
every size timed across the same moments of it); rank 0's times are fitted to ``steps * alpha + factor * bytes / bandwidth`` with
each collective's own factor and steps (``comm.terms``) by least squares, and every rank gets the
same ``Link`` back. A microbenchmark of the collectives alone, never of training steps.

On CPU ranks a collective is also work for the rank's own cores: gloo's threads copy, reduce and
push the bytes through the TCP stack. ``measure_gloo_cpu`` times the same collectives on the
process's CPU clock (every thread's work, none of the waiting for other ranks) and fits each kind
to ``per_call + per_byte * bytes``: what a rank's CPU time holds for each collective of its step,
whether or not it overlaps compute in wall time (``collective_cpu_seconds``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Link, terms

SIZES = (2**12, 2**16, 2**20, 2**22)
"""Bytes per collective's full buffer (4 KiB to 4 MiB of fp32)."""
REPEATS = 5
ATTEMPTS = 3
"""Measurements tried before a busy machine's noise is reported as an error."""
_MEASURED = ("all_gather", "reduce_scatter", "all_reduce")


def measure_gloo(group=None, *, sizes=SIZES, repeats: int = REPEATS, attempts: int = ATTEMPTS) -> Link:
    """The link between this group's ranks (call it on every rank)."""
    p = dist.get_world_size(group)

    def rows():  # (steps, factor * bytes, seconds)
        cases = _cases(sizes, p)
        out = []
        for (kind, elements), seconds in zip(cases, _median_times(cases, p, group, repeats)):
            factor, steps = terms(kind, p)
            out.append((steps, factor * elements * 4, seconds))
        return [out]

    (alpha, inverse_bandwidth), = _fitted_on_rank_0(rows, group, attempts, what="gloo timings")
    return Link(bandwidth=1.0 / inverse_bandwidth, latency=alpha)


@dataclass(frozen=True)
class CollectiveCpu:
    """CPU seconds one collective costs a rank's process, by kind: ``per_call[kind] +
    per_byte[kind] * bytes`` of its full (gathered / unscattered) buffer."""

    per_call: dict
    per_byte: dict

    def seconds(self, call) -> float:
        """One ``CollectiveCall``; a kind not measured costs what the dearest measured one does."""
        kind = call.kind if call.kind in self.per_call else max(
            self.per_call, key=lambda k: self.per_call[k] + self.per_byte[k] * call.bytes)
        return self.per_call[kind] + self.per_byte[kind] * call.bytes


def measure_gloo_cpu(group=None, *, sizes=SIZES, repeats: int = REPEATS,
                     attempts: int = ATTEMPTS) -> CollectiveCpu:
    """Each collective kind's CPU cost on this rank's process clock (call it on every rank; every
    rank gets rank 0's fit)."""
    p = dist.get_world_size(group)

    def rows():
        cases = _cases(sizes, p)
        times = _median_times(cases, p, group, repeats, clock=time.process_time)
        return [[(1.0, elements * 4.0, seconds) for (kind, elements), seconds in zip(cases, times)
                 if kind == measured] for measured in _MEASURED]

    fits = _fitted_on_rank_0(rows, group, attempts, what="gloo CPU timings")
    return CollectiveCpu(per_call={kind: fit[0] for kind, fit in zip(_MEASURED, fits)},
                         per_byte={kind: fit[1] for kind, fit in zip(_MEASURED, fits)})


def collective_cpu_seconds(calls, cpu: CollectiveCpu) -> float:
    """CPU seconds ``calls`` (``CollectiveCall``s) cost a rank's process."""
    return sum(cpu.seconds(call) for call in calls)


def _cases(sizes, p: int) -> list[tuple[str, int]]:
    """(kind, fp32 elements) of every measured kind at every size, divisible by the ``p`` ranks."""
    return [(kind, nbytes // 4 // p * p) for kind in _MEASURED for nbytes in sizes]


def _median_times(cases, p: int, group, repeats: int, clock=time.perf_counter) -> list[float]:
    """The median seconds of each (kind, elements) collective of ``cases``; each repetition runs
    every case once, after a barrier each (every rank runs the same cases in the same order)."""
    runs = [_collective(kind, elements, p, group) for kind, elements in cases]
    for run in runs:
        run()  # the first call sets up the algorithm's buffers
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, found in zip(runs, times):
            dist.barrier(group=group)
            start = clock()
            run()
            found.append(clock() - start)
    return [statistics.median(found) for found in times]


def _collective(kind: str, elements: int, p: int, group):
    full = torch.ones(elements)
    shard = torch.ones(elements // p)
    return {
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "all_reduce": lambda: dist.all_reduce(full, group=group),
    }[kind]


def _fitted_on_rank_0(measure, group, attempts: int, what: str) -> list[tuple[float, float]]:
    """Rank 0's fits of each row set ``measure()`` returns, on every rank. Every rank measures (the
    collectives need them all), only rank 0 fits; where a fit finds no bandwidth (a busy machine's
    noise outweighed the bytes) every rank measures again, up to ``attempts`` times."""
    root = dist.get_global_rank(group, 0) if group is not None else 0
    is_root = dist.get_rank() == root
    for _ in range(attempts):
        row_sets = measure()
        numbers = torch.full((len(row_sets), 2), float("nan"), dtype=torch.float64)
        if is_root:
            for i, rows in enumerate(row_sets):
                numbers[i] = torch.tensor(_fit(rows), dtype=torch.float64)
        dist.broadcast(numbers, src=root, group=group)
        if bool(torch.isfinite(numbers).all()):
            return [tuple(row) for row in numbers.tolist()]
    raise RuntimeError(f"{what} gave no bandwidth in {attempts} attempts (a fitted 1/bandwidth "
                       f"was not positive): rerun on a quieter machine")


def _fit(rows) -> tuple[float, float]:
    """Least squares of seconds = alpha * steps + beta * weighted bytes; (nan, nan) where beta is
    not positive."""
    a = torch.tensor([[s, b] for s, b, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in rows], dtype=torch.float64)
    # Relative error: each row divided by its time, so small collectives weigh as much as large.
    w = 1.0 / y
    alpha, beta = torch.linalg.lstsq(a * w[:, None], (y * w)[:, None]).solution[:, 0].tolist()
    if not beta > 0:
        return float("nan"), float("nan")
    return max(alpha, 0.0), beta


__all__ = ["CollectiveCpu", "SIZES", "collective_cpu_seconds", "measure_gloo", "measure_gloo_cpu"]
