"""Predicted against measured step time on this CPU, side by side in one run (issue 22).

For every bundled example at three micro-batches, with and without activation checkpointing:
the predicted step time (``predict_step_time``'s parts: the fake step's FLOPs, bytes, module calls
and checkpointed blocks, timed by the roofline with this CPU's speed, plus the training loop's own
work per micro-step and per window, ``roofline.window_time``) next to the measured one
(single process, the training loop's own step via ``autotune.tuning.measure``: the median of its
timed windows of one micro-step each; the fastest is printed beside it). One thread, in the
microbenchmarks and in the step, both timed on the thread's CPU clock (``cpu_profile.clock``).

The machine is shared and its load drifts: the full CPU profile (``measure_cpu_speed``) is taken
once per example, and a one-second ``speed_probe`` right before and right after each setting's
step rescales it (``scaled_speed``) to the speed around that step. The prediction is the geometric
mean of the two; "band" is the ratio with each of them, the noise of the load over one setting.

    python bench/step_time_accuracy.py

Pass criteria (issue 22): every ratio within 0.75-1.25 (25%); Spearman >= 0.9 per example.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool

import torch  # noqa: E402

from autotune.cli.format import table  # noqa: E402
from autotune.memory.cpu import CPUMemoryBackend  # noqa: E402
from autotune.timing.cpu_profile import clock, measure_cpu_speed, scaled_speed, speed_probe  # noqa: E402
from autotune.timing.count import count_steps_costs  # noqa: E402
from autotune.timing.roofline import window_time  # noqa: E402
from autotune.tuning.loop_cost import with_loop_costs  # noqa: E402
from autotune.tuning.measure import Configuration, measure_configuration  # noqa: E402
from autotune.workload import load_workload  # noqa: E402
from rank_correlation import spearman  # noqa: E402  (spearman: step_time_distributed imports it here)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "examples/mlp.py": (16, 128, 1024),
    "examples/tiny_lm.py": (2, 8, 32),
    "examples/gpt_varlen.py": (4, 16, 64),
    "examples/cnn_bn.py": (8, 32, 128),
}


def measured_step(workload, n: int, checkpointing: str, windows: int) -> tuple[float, float]:
    """(median, fastest) of the timed windows, on the thread's CPU clock as the microbenchmarks
    (``cpu_profile.clock``): the step's work without the time slices the shared machine gives
    other processes; the fastest beside the median shows what the load still moves (caches and
    memory bandwidth shared with the other processes)."""
    config = Configuration(precision="fp32", checkpointing=checkpointing, micro_batches=(n,))
    result = measure_configuration(workload, CPUMemoryBackend(), config, windows=windows,
                                   clock=clock())
    return statistics.median(result.window_seconds), min(result.window_seconds)


def _measured_speed():
    started = time.perf_counter()
    speed = with_loop_costs(measure_cpu_speed(precisions=("fp32",)))
    print(f"  {speed.name}: fp32 matmul {speed.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, memory "
          f"{speed.memory_bandwidth / 1e9:.2f} GB/s, {speed.op_overhead_s * 1e6:.2f} us per op, "
          f"{speed.recompute_op_overhead_s * 1e6:.1f} us per recomputed op, "
          f"{speed.module_call_s * 1e6:.1f} us per module call, "
          f"{speed.checkpoint_block_s * 1e6:.0f} us per checkpointed block, loop "
          f"{speed.loop_micro_step_s * 1e6:.0f} us per micro-step + {speed.loop_window_s * 1e6:.0f} us "
          f"per window, cold writes {speed.cold_write_s_per_byte * 2**20 * 1e3:.3f} ms per MiB "
          f"(measured in {time.perf_counter() - started:.1f} s)", flush=True)
    return speed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("examples", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--windows", type=int, default=7, help="timed windows per setting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows, ratios, bands, spearmans = [], [], [], {}
    for example in args.examples:
        sizes = EXAMPLES.get(example, (4, 16, 64))
        workload = load_workload(str(ROOT / example))
        print(example, flush=True)
        # The profile's own speed: probed on either side of it (it takes tens of seconds).
        first = speed_probe()
        speed = _measured_speed()
        after = speed_probe()
        base = tuple(math.sqrt(a * b) for a, b in zip(first, after))
        predicted, measured = [], []
        for checkpointing in ("off", "on"):
            costs = count_steps_costs(workload, list(sizes), checkpointing=checkpointing)
            for n in sizes:
                before = after
                seconds, fastest = measured_step(workload, n, checkpointing, args.windows)
                after = speed_probe()
                around = [window_time(costs[n], scaled_speed(speed, base, probe))
                          for probe in (before, after)]
                parts = {k: math.sqrt(around[0][k] * around[1][k]) for k in around[0]}
                low, high = sorted(p["total"] / seconds for p in around)
                predicted.append(parts["total"])
                measured.append(seconds)
                ratio = parts["total"] / seconds
                ratios.append(ratio)
                bands.append((low, high))
                print(f"  micro-batch {n} checkpointing {checkpointing}: ratio {ratio:.2f} "
                      f"(band {low:.2f}-{high:.2f})", flush=True)
                rows.append([example.removeprefix("examples/"), str(n), checkpointing,
                             f"{parts['total'] * 1e3:.2f}", f"{seconds * 1e3:.2f}",
                             f"{fastest * 1e3:.2f}", f"{ratio:.2f}", f"{low:.2f}-{high:.2f}",
                             f"{costs[n].total_flops / 1e9:.3f}", str(costs[n].op_count),
                             str(sum(costs[n].module_calls.values())), str(costs[n].checkpoint_blocks),
                             " ".join(f"{k[:4]} {parts[k] * 1e3:.2f}" for k in
                                      ("matmul", "attention", "elementwise", "optimizer", "other",
                                       "recompute", "loop") if parts[k])])
        spearmans[example] = spearman(predicted, measured)
    print(table(["example", "micro-batch", "ckpt", "predicted ms", "measured ms", "fastest ms", "ratio",
                 "band", "GFLOP", "ops", "modules", "blocks", "breakdown ms"], rows))
    for example, rho in spearmans.items():
        print(f"Spearman {example}: {rho:.3f}")
    within = sum(abs(r - 1) <= 0.25 for r in ratios)
    reachable = sum(low <= 1.25 and high >= 0.75 for low, high in bands)
    worst = max(abs(r - 1) for r in ratios)
    print(f"within 25%: {within} of {len(ratios)} (band overlapping 0.75-1.25: {reachable}); "
          f"worst |ratio - 1|: {worst:.2f}; threads {torch.get_num_threads()}; "
          f"{time.perf_counter() - started:.0f} s")
    return 0 if worst <= 0.25 and min(spearmans.values()) >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
