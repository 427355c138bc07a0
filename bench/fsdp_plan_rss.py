"""Planning big models for a GPU this machine does not have: peak RSS and seconds.

Runs `autotune plan bench/llama_like.py --gpu h100-80gb` in a fresh process for Llama-shaped
models of 1B (world 8), 8B (world 8) and 70B (world 64) parameters, target batch 256, and prints the
child's peak resident memory (getrusage), its wall and CPU seconds, the settings probed and the
measured fake steps the plan took (warm-up steps not counted; a measure of the work that does not
depend on the machine's load), and the plan (sharding, shard group, split, checkpointing). The
targets: RSS under 2 GiB, under 2 minutes.

    python bench/fsdp_plan_rss.py [--shapes 1b 8b 70b]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD = {"1b": 8, "8b": 8, "70b": 64}


def run(shape: str, out: pathlib.Path) -> dict:
    env = dict(os.environ, AUTOTUNE_LLAMA=shape,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "autotune", "plan", str(ROOT / "bench" / "llama_like.py"),
               "--target-batch", "256", "--gpu", "h100-80gb", "--world-size", str(WORLD[shape]),
               "-o", str(out)]
    # getrusage(RUSAGE_CHILDREN) holds the largest finished child so far: one child per shape
    # is measured in its own python (python -c) so the numbers do not mix.
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "rc = subprocess.run(sys.argv[1:]).returncode; u = resource.getrusage("
               "resource.RUSAGE_CHILDREN); print(rc, u.ru_maxrss, u.ru_utime + u.ru_stime, "
               "time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", wrapper, *command], env=env, capture_output=True,
                          text=True)
    rc, rss_kib, cpu_s, wall_s = done.stdout.strip().splitlines()[-1].split()
    if int(rc):
        raise RuntimeError(done.stderr[-3000:])
    plan = json.loads(out.read_text())
    return {"rss_gib": int(rss_kib) / 2**20, "cpu_s": float(cpu_s), "wall_s": float(wall_s),
            "plan": plan}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(WORLD), choices=list(WORLD))
    args = parser.parse_args()
    print("| model | world | params | peak RSS | CPU s | wall s | settings | fake steps | "
          "sharding | split | ckpt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            found = run(shape, pathlib.Path(tmp) / f"{shape}.json")
            plan = found["plan"]
            group = f" / {plan['shard_group']}" if plan.get("shard_group") else ""
            split = f"{plan['derived']['micro_batch']} × {plan['derived']['accumulation_steps']}"
            probes = plan["settings"]
            steps = sum(len((s.get("probe") or {}).get("trials", [])) for s in probes)
            print(f"| {shape} | {WORLD[shape]} | {plan['workload']['param_count'] / 1e9:.2f}B | "
                  f"{found['rss_gib']:.2f} GiB | {found['cpu_s']:.0f} | {found['wall_s']:.0f} | "
                  f"{len(probes)} | {steps} | {plan['sharding']}{group} | {split} | "
                  f"{'on' if plan['checkpointing'] else 'off'} |", flush=True)
            ok = ok and found["rss_gib"] < 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
