"""Predicted against measured step time on this CPU, side by side in one run (issue 22).

For every bundled example at three micro-batches, with and without activation checkpointing:
the predicted step time (``predict_step_time``'s parts: the fake step's FLOPs and bytes per op,
timed by the roofline with this CPU's speed, measured by ``autotune.timing.cpu_profile`` right
before each setting in this same run, since a shared machine's load drifts), next to the measured
one (single process, the training loop's own step via ``autotune.tuning.measure``: the median of
its timed windows of one micro-step each; the fastest is printed beside it). Prints each ratio
and, per example, the Spearman rank correlation of predicted and measured times.

    OMP_NUM_THREADS=1 python bench/step_time_accuracy.py

Pass criteria (issue 22): every ratio within 0.75-1.25 (25%); Spearman >= 0.9 per example.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autotune.cli.format import table  # noqa: E402
from autotune.memory.cpu import CPUMemoryBackend  # noqa: E402
from autotune.timing.cpu_profile import measure_cpu_speed  # noqa: E402
from autotune.timing.count import count_steps_costs  # noqa: E402
from autotune.timing.roofline import compute_time  # noqa: E402
from autotune.tuning.measure import Configuration, measure_configuration  # noqa: E402
from autotune.workload import load_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "examples/mlp.py": (16, 128, 1024),
    "examples/tiny_lm.py": (2, 8, 32),
    "examples/gpt_varlen.py": (4, 16, 64),
    "examples/cnn_bn.py": (8, 32, 128),
}


def spearman(xs, ys) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def measured_step(workload, n: int, checkpointing: str, windows: int) -> tuple[float, float]:
    """(median, fastest) of the timed windows: the median is the step's time under the load the
    machine has (as the CPU speed's microbenchmarks take their median run); the fastest shows
    how much that load varies."""
    config = Configuration(precision="fp32", checkpointing=checkpointing, micro_batches=(n,))
    result = measure_configuration(workload, CPUMemoryBackend(), config, windows=windows)
    return statistics.median(result.window_seconds), min(result.window_seconds)


def _measured_speed():
    started = time.perf_counter()
    speed = measure_cpu_speed(precisions=("fp32",))
    print(f"  {speed.name}: fp32 matmul {speed.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, memory "
          f"{speed.memory_bandwidth / 1e9:.2f} GB/s, {speed.op_overhead_s * 1e6:.2f} us per op, "
          f"{speed.recompute_op_overhead_s * 1e6:.1f} us per recomputed op "
          f"(measured in {time.perf_counter() - started:.1f} s)", flush=True)
    return speed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("examples", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--windows", type=int, default=7, help="timed windows per setting")
    args = parser.parse_args()
    started = time.perf_counter()
    rows, worst, spearmans = [], 0.0, {}
    for example in args.examples:
        sizes = EXAMPLES.get(example, (4, 16, 64))
        workload = load_workload(str(ROOT / example))
        predicted, measured = [], []
        for checkpointing in ("off", "on"):
            costs = count_steps_costs(workload, list(sizes), checkpointing=checkpointing)
            for n in sizes:
                # Measured again right before each setting: the machine's load drifts.
                print(f"{example} micro-batch {n} checkpointing {checkpointing}", flush=True)
                speed = _measured_speed()
                parts = compute_time(costs[n], speed)
                seconds, fastest = measured_step(workload, n, checkpointing, args.windows)
                predicted.append(parts["total"])
                measured.append(seconds)
                ratio = parts["total"] / seconds
                worst = max(worst, abs(ratio - 1))
                rows.append([example, str(n), checkpointing, f"{parts['total'] * 1e3:.2f}",
                             f"{seconds * 1e3:.2f}", f"{fastest * 1e3:.2f}", f"{ratio:.2f}",
                             f"{costs[n].total_flops / 1e9:.3f}", f"{costs[n].total_bytes / 1e6:.1f}",
                             str(costs[n].op_count),
                             " ".join(f"{k[:4]} {parts[k] * 1e3:.2f}" for k in
                                      ("matmul", "attention", "elementwise", "optimizer", "other",
                                       "recompute") if parts[k])])
        spearmans[example] = spearman(predicted, measured)
    print(table(["example", "micro-batch", "ckpt", "predicted ms", "measured ms", "fastest ms", "ratio", "GFLOP",
                 "MB moved", "ops", "breakdown ms"], rows))
    for example, rho in spearmans.items():
        print(f"Spearman {example}: {rho:.3f}")
    print(f"worst |ratio - 1|: {worst:.2f}; threads {torch.get_num_threads()}; "
          f"{time.perf_counter() - started:.0f} s")
    return 0 if worst <= 0.25 and min(spearmans.values()) >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
