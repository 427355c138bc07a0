"""What `--sharding auto` costs a replicated plan: planning time with auto against ddp pinned.

Issue 10 asks that probing time stays close to today's for plans that end up replicated: sharded
settings are estimated on fake tensors, and only where a replica leaves accumulation steps to save.
For each case this plans the same bundled example twice per round, `sharding="ddp"` and
`sharding="auto"`, alternating which goes first, on the CPU backend under a memory limit, and
prints the median seconds of each, their ratio, and what auto chose (and whether it estimated
FSDP at all).

    OMP_NUM_THREADS=1 python bench/sharding_probe_time.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autotune  # noqa: E402

# (example, target batch, world size, memory limit): replicated plans that take one step (auto
# never estimates FSDP) and plans where the replica leaves steps (auto estimates FSDP per rank).
CASES = [
    ("mlp", 256, 4, "160MiB"),
    ("cnn_bn", 64, 4, "32MiB"),
    ("tiny_lm", 16, 4, "200MiB"),
    ("tiny_lm", 64, 4, "40MiB"),
    ("gpt_varlen", 64, 4, "8MiB"),
    ("gpt_varlen", 64, 4, "5MiB"),
]


def _plan(example: str, target: int, world: int, limit: str, sharding: str):
    started = time.perf_counter()
    made = autotune.plan(str(ROOT / "examples" / f"{example}.py"), target_batch=target,
                         world_size=world, memory_limit=limit, sharding=sharding)
    return time.perf_counter() - started, made


def _describe(made) -> str:
    group = f"/{made.shard_group}" if made.shard_group else ""
    sharded_tried = sum(1 for s in made.settings if s.sharding.sharded)
    return (f"{made.sharding}{group} {made.micro_batch}×{made.accumulation_steps} "
            f"({sharded_tried} sharded settings estimated)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    # The first plan() in a process pays one-off costs (lazy imports, first dispatches): untimed.
    _plan(*CASES[0], "ddp")
    print("| example | target | world | limit | ddp s | auto s | auto/ddp | ddp plan | auto plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for example, target, world, limit in CASES:
        seconds = {"ddp": [], "auto": []}
        plans = {}
        for round_ in range(args.rounds):
            order = ("ddp", "auto") if round_ % 2 == 0 else ("auto", "ddp")
            for sharding in order:
                took, plans[sharding] = _plan(example, target, world, limit, sharding)
                seconds[sharding].append(took)
        ddp, auto = statistics.median(seconds["ddp"]), statistics.median(seconds["auto"])
        print(f"| {example} | {target} | {world} | {limit} | {ddp:.1f} | {auto:.1f} | "
              f"{auto / ddp:.2f} | {_describe(plans['ddp'])} | {_describe(plans['auto'])} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
