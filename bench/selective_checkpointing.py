"""Selective checkpointing side by side: the planner's K of N blocks against all N blocks (same
split) and against no checkpointing (more accumulation steps), on one budget.

Plans twice on the CPU backend (``--checkpointing auto`` and ``off``), then times the three
configurations side by side, window by window (``compare_configurations``, as the throughput
search's final comparison does), and ranks them by their median window; ``--repeats`` runs the
comparison again to show how stable the ranking is on a shared machine. A fourth, reference row
times no checkpointing at the selective plan's split: over the budget (timed windows do not count
bytes), it only splits the selective plan's cost into recomputation (selective ÷ it) and the
larger micro-batch (it ÷ none with more steps).

    python bench/selective_checkpointing.py examples/tiny_lm.py --threads 1 \\
        --target-batch 16 --memory-limit 50MiB

``--curve`` instead times, without checkpointing and with no budget, the target batch split into
micro-batches of 1, 2, 4, ... (all side by side), and every block checkpointed at one step: how
much a larger micro-batch buys on this machine, and what recomputation costs.

Pass criteria (issue 15): the selective plan is faster than full checkpointing and than no
checkpointing with more accumulation steps (ratios > 1 in every repeat).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autotune  # noqa: E402
from autotune.cli.format import table  # noqa: E402
from autotune.memory import backend_for  # noqa: E402
from autotune.tuning.measure import Configuration, compare_configurations  # noqa: E402
from autotune.workload.contract import load_workload  # noqa: E402


def _config(micro_batches, blocks=None, *, checkpointing=True) -> Configuration:
    return Configuration(precision="fp32", checkpointing=checkpointing, checkpointed_blocks=blocks,
                         micro_batches=tuple(micro_batches))


def _curve(workload, args) -> int:
    """Samples/s of the target batch by micro-batch, relative to one step of the whole batch."""
    target = args.target_batch
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= target and target % n == 0]
    configs = {f"{n} x {target // n}": _config([n] * (target // n), checkpointing=False) for n in sizes}
    configs[f"{target} x 1, every block checkpointed"] = _config([target])
    names, whole = list(configs), f"{target} x 1"
    ratios = {name: [] for name in names}
    backend = backend_for("cpu", None)
    for _ in range(args.repeats):
        results = compare_configurations(workload, backend, list(configs.values()), seconds=args.seconds)
        speeds = dict(zip(names, (r.samples_per_s for r in results)))
        for name in names:
            ratios[name].append(speeds[name] / speeds[whole])
    rows = [[name, f"{min(rs):.2f}-{max(rs):.2f}"] for name, rs in ratios.items()]
    print(f"{args.model_file}, target batch {target}, {torch.get_num_threads()} thread(s), "
          f"{args.repeats} repeat(s) of {args.seconds:g}s")
    print(table(["split, no checkpointing unless said", f"samples/s ÷ {whole}'s (min-max)"], rows,
                align="lr"))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_file")
    parser.add_argument("--target-batch", type=int, default=16)
    parser.add_argument("--memory-limit", default="50MiB")
    parser.add_argument("--headroom", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="side-by-side time per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's own, the machine's cores)")
    parser.add_argument("--curve", action="store_true",
                        help="time the target batch by micro-batch instead (no budget)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    workload = load_workload(args.model_file)
    if args.curve:
        return _curve(workload, args)
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
    split = selective.micro_batches
    configs = {
        f"selective ({selective.checkpointing_label})": _config(split, selective.blocks),
        f"full (all {selective.total_blocks} blocks)": _config(split),
        "none, more steps": _config(plain.micro_batches, checkpointing=False),
        "reference: none at the selective split, over budget": _config(split, checkpointing=False),
    }
    backend = backend_for("cpu", args.memory_limit)
    print(f"{args.model_file}, target batch {args.target_batch}, CPU budget {args.memory_limit}, "
          f"headroom {args.headroom:g}, {torch.get_num_threads()} thread(s); planning {planning:.1f}s")
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
    judged = names[1:3]
    for name, rs in ratios.items():
        verdict = ("PASS" if all(r > 1 for r in rs) else "FAIL") if name in judged else "(not judged)"
        print(f"selective / {name}: {min(rs):.2f}-{max(rs):.2f}x over {len(rs)} repeat(s) -> {verdict}")
    return 0 if all(r > 1 for name in judged for r in ratios[name]) else 1


if __name__ == "__main__":
    sys.exit(main())
