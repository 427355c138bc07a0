"""What the throughput bound saves a layout search ranked by throughput, and how far it stays above
each layout's own prediction (autotune.timing.bound).

For each case, three searches (``--tp auto --cp auto --pp auto``), each in a fresh child process,
one after the other: the memory rule (``--optimize memory``), then ranked by throughput with every
fitting layout planned whole (the bound switched off), then ranked by throughput with the bound.
Per candidate layout: its CPU seconds in each ranked search, what each gave (its predicted
samples/s per GPU, or why it was skipped), and, planned whole, the bound at the split and
checkpointing it was predicted at (never below that prediction). Totals: CPU seconds
(``time.process_time`` of the search) and their ratio to the memory rule's.

    OMP_NUM_THREADS=1 python bench/layout_bound.py [--cases 8b 70b wide]

Cases: ``8b``, ``70b`` and ``405b`` are bench/llama_plans.py's (Llama-3.1 8B on 8 H100s, target 64;
70B on 256, target 512; 405B on 512, target 1024, where data parallelism fits nowhere; sequence
8192); ``wide`` is tests/wide_decoder_model.py (two blocks at
Llama-3.2-1B's width, sequence 4096) on 4 H100s with 40% of each usable, target 16;
``wide-tight`` the same with 15% usable and target 32, where data parallelism fits nowhere (the
bound counts its step all the same).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCH = dict(gpu="h100-80gb", gpus_per_node=8, tp="auto", cp="auto", pp="auto", eval_batch=False)
CASES = {
    "8b": ("bench/llama_like.py", {"AUTOTUNE_LLAMA": "8b", "AUTOTUNE_LLAMA_SEQ": "8192"},
           dict(world_size=8, target_batch=64, seq_len=8192)),
    "70b": ("bench/llama_like.py", {"AUTOTUNE_LLAMA": "70b", "AUTOTUNE_LLAMA_SEQ": "8192"},
            dict(world_size=256, target_batch=512, seq_len=8192)),
    "405b": ("bench/llama_like.py", {"AUTOTUNE_LLAMA": "405b", "AUTOTUNE_LLAMA_SEQ": "8192"},
             dict(world_size=512, target_batch=1024, seq_len=8192)),
    "wide": ("tests/wide_decoder_model.py", {}, dict(world_size=4, target_batch=16, seq_len=4096, headroom=0.6)),
    "wide-tight": ("tests/wide_decoder_model.py", {},
                   dict(world_size=4, target_batch=32, seq_len=4096, headroom=0.85)),
}
MODES = ("memory", "whole", "bounded")


def one(name: str, mode: str) -> dict:
    """Runs in the child: one search, each candidate timed."""
    # The case's model size, also where ``--one`` is run by hand (the model file reads it).
    os.environ.update(CASES[name][1])
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import autotune
    from autotune.orchestration import layout_search, planner as planner_module
    from autotune.orchestration.predicted import reference_steps
    from autotune.precision import Precision
    from autotune.timing.bound import fastest_possible
    from autotune.timing.comm import network_from_profile

    rows, planners = [], {}
    search = layout_search.search_layouts

    def timed(candidates, evaluate, **kwargs):
        def each(layout, **screen):
            started = time.process_time()
            out = evaluate(layout, **screen)
            rows.append(dict(layout=layout.describe_degrees(), cpu_s=time.process_time() - started,
                             samples_per_s=out.samples_per_s, said=out.label or out.error))
            return out
        return search(candidates, each, **kwargs)

    layout_search.search_layouts = timed
    original = planner_module.fastest_predicted

    first_planner = []

    def recording(planner):
        if planner.options.parallel.trivial:  # the reference, whether it fits or not
            first_planner[:] = [planner]
        made = original(planner)
        planners[planner.options.parallel] = (planner, made)
        return made

    planner_module.fastest_predicted = recording
    if mode == "whole":
        layout_search._cannot_win = lambda *args, **kwargs: None
    path, _, options = CASES[name]
    started = time.process_time()
    plan = autotune.plan(str(ROOT / path), optimize="memory" if mode == "memory" else "throughput",
                         **SEARCH, **options)
    total = time.process_time() - started
    bounds = {}
    reference = first_planner[0] if first_planner else None
    if mode == "whole" and reference is not None:
        references = reference_steps(reference)
        network = network_from_profile(reference.target.profile, gpus_per_node=SEARCH["gpus_per_node"])
        for layout, (planner, made) in planners.items():
            if layout.trivial or not made.predicted:
                continue
            best = made.predicted[0]
            blocks = best.checkpointing
            bounds[layout.describe_degrees()] = fastest_possible(
                references, layout, best.micro_batches, recompute=bool(blocks.blocks) and blocks.blocks == blocks.total,
                network=network, seq_len=planner.workload.seq_len, hidden=planner.shape.hidden,
                blocks=planner.shape.blocks,
                activation_bytes=4 if Precision.parse(best.precision) is Precision.FP32 else 2,
                sharded_group=layout.data_parallel(planner.world_size) * layout.cp
                if str(best.sharding) == "fsdp" and planner.options.shard_group is None else None)
    return dict(case=name, mode=mode, total_s=total, rows=rows, bounds=bounds,
                plan=f"{plan.chosen_layout}, {' + '.join(map(str, plan.micro_batches))}, checkpointing "
                     f"{plan.checkpointing.label}",
                samples_per_s=plan.step_time.samples_per_s if plan.step_time else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["wide", "8b", "70b"], choices=sorted(CASES))
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(*args.one)), flush=True)
        return 0
    for name in args.cases:
        found = {}
        for mode in MODES:
            env = {**os.environ, **CASES[name][1]}
            done = subprocess.run([sys.executable, __file__, "--one", name, mode], env=env, cwd=ROOT,
                                  capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{name} {mode}: {done.stderr[-3000:]}")
            found[mode] = json.loads(line[len("RESULT "):])
        memory, whole, bounded = (found[m] for m in MODES)
        print(f"\n### {name}: {whole['plan']} ({whole['samples_per_s']:.4g} samples/s per GPU) ranked whole; "
              f"{bounded['plan']} with the bound; {memory['plan']} by the memory rule\n")
        print("| layout | whole: CPU s | predicted samples/s | bound at its split | bounded: CPU s | bounded: outcome |")
        print("|---|---|---|---|---|---|")
        after = {row["layout"]: row for row in bounded["rows"]}
        for row in whole["rows"]:
            other = after.get(row["layout"], {})
            bound = whole["bounds"].get(row["layout"])
            print(f"| {row['layout']} | {row['cpu_s']:.1f} | "
                  f"{'-' if row['samples_per_s'] is None else format(row['samples_per_s'], '.4g')} | "
                  f"{'-' if bound is None else format(bound, '.4g')} | "
                  f"{'-' if not other else format(other['cpu_s'], '.1f')} | "
                  f"{(other.get('said') or '-')[:160]} |")
        print(f"\nsearch CPU s: memory rule {memory['total_s']:.1f}, ranked whole {whole['total_s']:.1f} "
              f"({whole['total_s'] / memory['total_s']:.2f}×), bounded {bounded['total_s']:.1f} "
              f"({bounded['total_s'] / memory['total_s']:.2f}×)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
