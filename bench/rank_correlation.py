"""Spearman's rank correlation for the bench scripts that rank settings by predicted and measured
step time (step_time_accuracy.py, step_time_distributed.py, gpu_proof.py). Python 3.11's
``statistics.correlation`` has no ranked method (3.12 adds it), and scipy is no dependency."""

import statistics


def _ranks(values) -> list[float]:
    """Each value's rank from 0, ties taking their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs, ys) -> float:
    """The Pearson correlation of the ranks (nan where either side is constant)."""
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / spread if spread else float("nan")
