"""What ranking by predicted throughput costs planning: ``--optimize throughput`` against today's rule.

For each case, ``autotune.plan(..., gpu=GPU, optimize=...)`` runs four times in one fresh child
process, alternating ``memory`` (today's rule) and ``throughput`` (ranked by the predicted step
time), and each mode's best CPU seconds (``time.process_time``: the measure the machine's load
inflates least; the first call also pays imports, hence best of two) are compared. Printed per
case: the plan, both costs and their ratio, and how many settings the ranking timed with how many
of their steps taken from the probe's own trials (``autotune.timing.recorded``) and how many counted
again in a session of their own.

    OMP_NUM_THREADS=1 python bench/ranking_cost.py [--cases mlp cnn_bn tiny_lm gpt_varlen 8b]

Cases: the four bundled examples (``--gpu h100-80gb --world-size 8 --target-batch 256``) and
the Llama 3.1 8B shape (bench/llama_like.py, sequence 8192) on 8 H100s with FSDP2 and a local
batch of 2, as bench/step_time_llama.py plans it; ``8b-windows`` is the same shape at sequence
2048 with ``--target-batch 256`` (accumulation windows: trials the ranking cannot reuse).
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
GPU = "h100-80gb"
EXAMPLE = dict(target_batch=256, world_size=8)
CASES = {
    "mlp": ("examples/mlp.py", {}, EXAMPLE),
    "cnn_bn": ("examples/cnn_bn.py", {}, EXAMPLE),
    "tiny_lm": ("examples/tiny_lm.py", {}, EXAMPLE),
    "gpt_varlen": ("examples/gpt_varlen.py", {}, EXAMPLE),
    "8b": ("bench/llama_like.py", {"AUTOTUNE_LLAMA": "8b", "AUTOTUNE_LLAMA_SEQ": "8192"},
           dict(target_batch=16, world_size=8, micro_batch=2, sharding="fsdp")),
    "8b-windows": ("bench/llama_like.py", {"AUTOTUNE_LLAMA": "8b", "AUTOTUNE_LLAMA_SEQ": "2048"},
                   dict(target_batch=256, world_size=8)),
}


def one_case(name: str) -> dict:
    """Runs in the child: the four plans of one case."""
    sys.path.insert(0, str(ROOT))
    import autotune
    from autotune.orchestration import predicted

    counted = []
    count = predicted.count_steps_costs

    def counting(workload, sizes, **kwargs):  # the steps the ranking counts in a session of its own
        counted.append(len(sizes))
        return count(workload, sizes, **kwargs)

    predicted.count_steps_costs = counting
    path, _, options = CASES[name]
    seconds: dict[str, list[float]] = {"memory": [], "throughput": []}
    for optimize in ("memory", "throughput") * 2:
        counted.clear()
        started = time.process_time()
        plan = autotune.plan(str(ROOT / path), gpu=GPU, optimize=optimize, **options)
        seconds[optimize].append(time.process_time() - started)
        if optimize == "throughput":
            ranked = plan
    steps = sum(len(set(c.micro_batches)) for c in ranked.predicted)
    return dict(case=name, memory=min(seconds["memory"]), throughput=min(seconds["throughput"]),
                plan=f"{ranked.chosen_layout}, {' + '.join(map(str, ranked.micro_batches))}, "
                     f"checkpointing {ranked.checkpointing.label}",
                settings=len(ranked.predicted), steps=steps, counted_again=sum(counted))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["mlp", "cnn_bn", "tiny_lm", "gpt_varlen", "8b"],
                        choices=sorted(CASES))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_case(args.one)))
        return 0
    print("| case | plan (ranked) | settings ranked | steps: from the probe / counted again | "
          "CPU s memory | CPU s throughput | ratio |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for name in args.cases:
        env = dict(os.environ, OMP_NUM_THREADS="1", **CASES[name][1])
        done = subprocess.run([sys.executable, __file__, "--one", name], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {name} | failed: {done.stderr.strip().splitlines()[-1:]} |", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        ratio = r["throughput"] / r["memory"]
        worst = max(worst, ratio)
        print(f"| {name} | {r['plan']} | {r['settings']} | {r['steps'] - r['counted_again']} / "
              f"{r['counted_again']} | {r['memory']:.2f} | {r['throughput']:.2f} | {ratio:.2f}x |",
              flush=True)
    print(f"\nworst ratio: {worst:.2f}x (target: at most 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
