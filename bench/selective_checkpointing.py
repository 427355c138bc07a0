"""Selective checkpointing side by side: the planner's K of N blocks against all N blocks (same
split) and against no checkpointing (more accumulation steps), on one budget.

Plans twice on the CPU backend (``--checkpointing auto`` and ``off``), then times the three
configurations side by side, window by window (``compare_configurations``, as the throughput
search's final comparison does), and ranks them by their median window; ``--repeats`` runs the
comparison again to show how stable the ranking is on a shared machine.

    OMP_NUM_THREADS=1 python bench/selective_checkpointing.py examples/tiny_lm.py \\
        --target-batch 16 --memory-limit 50MiB

Pass criteria (issue 15): the selective plan is faster than full checkpointing and than no
checkpointing with more accumulation steps (ratios > 1 in every repeat).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune  # noqa: E402
from autotune.cli.format import table  # noqa: E402
from autotune.memory import backend_for  # noqa: E402
from autotune.tuning.measure import Configuration, compare_configurations  # noqa: E402
from autotune.workload.contract import load_workload  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_file")
    parser.add_argument("--target-batch", type=int, default=16)
    parser.add_argument("--memory-limit", default="50MiB")
    parser.add_argument("--headroom", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="side-by-side time per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    workload = load_workload(args.model_file)
    common = dict(target_batch=args.target_batch, device="cpu", memory_limit=args.memory_limit,
                  headroom=args.headroom, precision="fp32")
    started = time.perf_counter()
    selective = autotune.plan(workload, checkpointing="auto", **common)
    plain = autotune.plan(workload, checkpointing="off", **common)
    planning = time.perf_counter() - started
    if not selective.checkpointing or selective.blocks == selective.total_blocks:
        print(f"the planner chose checkpointing {selective.checkpointing_label}: no selective plan "
              f"on this budget; pick a --memory-limit between full and no checkpointing")
        return 1
    configs = {
        f"selective ({selective.checkpointing_label})": Configuration(
            precision="fp32", checkpointing=True, checkpointed_blocks=selective.blocks,
            micro_batches=tuple(selective.micro_batches)),
        f"full (all {selective.total_blocks} blocks)": Configuration(
            precision="fp32", checkpointing=True, micro_batches=tuple(selective.micro_batches)),
        "none, more steps": Configuration(precision="fp32", checkpointing=False,
                                          micro_batches=tuple(plain.micro_batches)),
    }
    backend = backend_for("cpu", args.memory_limit)
    print(f"{args.model_file}, target batch {args.target_batch}, CPU budget {args.memory_limit}, "
          f"headroom {args.headroom:g}; planning {planning:.1f}s")
    print(f"planner: {selective.reasons['checkpointing']}\n")
    names = list(configs)
    rows, ratios = [], {name: [] for name in names[1:]}
    for repeat in range(args.repeats):
        results = compare_configurations(workload, backend, list(configs.values()), seconds=args.seconds)
        speeds = [r.samples_per_s for r in results]
        for name, config, result, speed in zip(names, configs.values(), results, speeds):
            ratio = speeds[0] / speed if speed else float("nan")
            if name != names[0]:
                ratios[name].append(ratio)
            rows.append([repeat + 1, name, f"{max(config.micro_batches)} x {config.accumulation_steps}",
                         f"{speed:.1f}" if speed else "OOM", len(result.window_seconds),
                         "-" if name == names[0] else f"{ratio:.2f}x"])
    print(table(["repeat", "configuration", "split", "samples/s (median window)", "windows",
                 "selective is"], rows, align="rllrrr"))
    print()
    for name, rs in ratios.items():
        verdict = "PASS" if all(r > 1 for r in rs) else "FAIL"
        print(f"selective / {name}: {min(rs):.2f}-{max(rs):.2f}x over {len(rs)} repeat(s) -> {verdict}")
    return 0 if all(r > 1 for rs in ratios.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
