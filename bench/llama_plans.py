"""Planning Llama-3.1-shaped models from few identical blocks: exactness, seconds and peak RSS.

Two tables (bench/README.md, "llama_plans.py"):

1. ``--check``: one rank's estimated step for an H100 (fake tensors, the CUDA caching allocator
   modelled) of bench/llama_like.py from three small builds' allocator traces synthesized for
   every block (``SynthesizedTrialsSession``, here for every setting, where a plan runs the full
   build of one whose small builds hold more than ``SYNTHESIS_MAX_SHARE`` of the blocks), against
   the full fake build: reserved peaks and the tensors' peak, with the CPU seconds of each. Each row runs in one child process per model, one after another.
2. ``--plan``: ``autotune plan bench/llama_like.py --gpu h100-80gb --gpus-per-node 8 --tp auto
   --cp auto --pp auto`` (issue 21's cases: 8B on 8 GPUs, 70B on 256, 405B on 512 at sequence
   8192, and 8B at sequence 131072 on 8, which needs context parallelism), each in a fresh
   process: its CPU seconds, wall seconds and peak RSS (getrusage), the layout the search chose,
   its split, checkpointing and per-rank peak, how many layouts it estimated and which it could
   not (a split this build lacks), and where ``--full`` asks, the same plan from full builds with
   its seconds. ``--optimize throughput`` ranks the layouts by predicted throughput instead of the
   fewest accumulation steps. ``--reasons`` adds the layout reason and each candidate's CPU seconds (timed
   around the search's planning of it, in the same process). ``--fixed`` plans data parallel
   only (the degrees at 1), as before the search.

    OMP_NUM_THREADS=1 python bench/llama_plans.py --check 8b 70b --plan 8b 70b 405b 8b-128k --full 8b
"""

from __future__ import annotations

import argparse
import json
import os
import re
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEQ_LEN = 8192
PLANS = {"8b": (8, 64, SEQ_LEN), "70b": (256, 512, SEQ_LEN), "405b": (512, 1024, SEQ_LEN),
         "8b-128k": (8, 8, 131072)}  # world size, target batch, sequence length
CHECKS = {  # (world size, micro-batch, precision, checkpointing, shard group[, window, tp])
    "8b": [(8, 1, "bf16", "on", None), (8, 2, "bf16", "on", None), (8, 1, "bf16", "off", None),
           (64, 2, "bf16", "on", None), (8, 1, "fp32", "16", None), (16, 1, "bf16", "on", 8),
           (1, 1, "bf16", "on", None), (8, 2, "bf16", "on", None, 2), (8, 2, "bf16", "on", None, 2, 2)],
    "70b": [(256, 1, "bf16", "on", None), (64, 2, "bf16", "on", 32), (256, 1, "bf16", "on", 32, 2),
            (256, 2, "bf16", "on", None, 2, 2)],
}


def check(shape: str) -> list[dict]:
    """Rows of (few-block estimate, full-build estimate) for ``shape``, in a child process (the
    model's shape is read from the environment at import)."""
    code = ("import json, sys; sys.path.insert(0, %r); from bench.llama_plans import _check_rows; "
            "print(json.dumps(_check_rows(%r)))" % (str(ROOT), shape))
    done = subprocess.run([sys.executable, "-c", code], env=_env(shape), capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_rows(shape: str) -> list[dict]:
    from autotune.distributed.layout import parse_layout
    from autotune.memory.fake import EstimateMemoryBackend
    from autotune.probing import affine_blocks
    from autotune.probing.affine_blocks import full_builds, synthesized_traces
    from autotune.probing.api import window_trial

    fell_back = []
    original = affine_blocks.SynthesizedTrialsSession._full_session

    def full_build(session):
        fell_back.append(session.unsynthesizable)
        return original(session)

    rows = []
    for world, n, precision, checkpointing, group, *more in CHECKS[shape]:
        window, tp = (*more, 1, 1)[:2]
        args = dict(micro_batch=n, window=window, precision=precision, checkpointing=checkpointing,
                    sharding="fsdp" if world > 1 else "ddp", world_size=world, shard_group=group,
                    parallel=parse_layout(tp=tp) if tp > 1 else None)
        found, fell_back[:] = {}, []
        for way in ("few", "full"):
            started = time.process_time()
            # The small builds' traces, synthesized for whatever share of the model they hold
            # (a planner synthesizes up to SYNTHESIS_MAX_SHARE of the blocks).
            affine_blocks.SynthesizedTrialsSession._full_session = full_build
            try:
                with full_builds() if way == "full" else synthesized_traces(max_share=None):
                    trial = window_trial(ROOT / "bench" / "llama_like.py",
                                         EstimateMemoryBackend(None, for_cuda=True), **args)
            finally:
                del affine_blocks.SynthesizedTrialsSession._full_session
            found[way] = (trial.reserved_peak_bytes, trial.activation_peak_bytes, trial.step_peak_bytes,
                          trial.allocated_peak_bytes, time.process_time() - started)
        rows.append({"world": world, "group": group, "n": n, "precision": precision,
                     "checkpointing": checkpointing, "window": window, "tp": tp, **found,
                     "unsynthesized": fell_back[0] if fell_back else None})
    return rows


def plan(shape: str, out: pathlib.Path, *, full: bool, search: bool = True, optimize: str = "memory") -> dict:
    world, target, seq = PLANS[shape]
    command = ["-m", "autotune", "plan", str(ROOT / "bench" / "llama_like.py"), "--gpu",
               "h100-80gb", "--gpus-per-node", "8", "--world-size", str(world), "--target-batch",
               str(target), "--seq-len", str(seq), "--optimize", optimize, "-o", str(out)]
    if search:
        command += ["--tp", "auto", "--cp", "auto", "--pp", "auto"]
    # The same command, each candidate layout's planning timed (CPU seconds, on stderr), and
    # where ``full`` asks, with the estimates on full builds.
    code = _TIMED + ("from autotune.probing import affine_blocks; affine_blocks._enabled = False; "
                     if full else "")
    command = ["-c", code + "sys.argv = ['autotune', *sys.argv[1:]]; "
               "runpy.run_module('autotune', run_name='__main__')", *command[2:]]
    # getrusage(RUSAGE_CHILDREN) holds the largest finished child so far: each plan is measured
    # from its own python so the numbers do not mix.
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "rc = subprocess.run(sys.argv[1:]).returncode; u = resource.getrusage("
               "resource.RUSAGE_CHILDREN); print(rc, u.ru_maxrss, u.ru_utime + u.ru_stime, "
               "time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable, *command],
                          env=_env(shape.split("-")[0], seq), capture_output=True, text=True)
    rc, rss_kib, cpu_s, wall_s = done.stdout.strip().splitlines()[-1].split()
    found = {"rss_gib": int(rss_kib) / 2**20, "cpu_s": float(cpu_s), "wall_s": float(wall_s),
             "candidates": [line[len("[candidate] "):] for line in done.stderr.splitlines()
                            if line.startswith("[candidate] ")]}
    if int(rc):
        # An answer too: no layout this build can estimate fits.
        error = next((line for line in done.stderr.splitlines() if line.startswith("Error: ")), None)
        if error is None or "fit" not in error:
            raise RuntimeError(done.stderr[-3000:])
        return {**found, "plan": None, "error": error}
    return {**found, "plan": json.loads(out.read_text())}


_TIMED = (
    "import sys, runpy, time; from autotune.orchestration import layout_search; "
    "search = layout_search.search_layouts\n"
    "def timed(candidates, evaluate, **kw):\n"
    "    def each(layout, **screen):\n"
    "        started = time.process_time(); out = evaluate(layout, **screen)\n"
    "        print(f'[candidate] {layout.describe_degrees()}: {time.process_time() - started:.0f} CPU s, '\n"
    "              f'{out.label or out.error}', file=sys.stderr, flush=True)\n"
    "        return out\n"
    "    return search(candidates, each, **kw)\n"
    "layout_search.search_layouts = timed\n")


def _layout(made: dict) -> str:
    from autotune.distributed.layout import Layout

    layout = Layout.from_dict(made.get("parallel")).describe(made["world_size"], made["sharding"].upper())
    group = made.get("shard_group")
    return layout + (f" (shard group {group})" if group and "×" not in layout and group != made["world_size"]
                     else "")


def _searched(made: dict) -> str:
    """Which splits the search could not estimate (not in this build)."""
    reason = made["reasons"].get("layout", "")
    lacking = sorted(set(re.findall(r"(tensor|context|pipeline) parallelism is not available", reason)))
    return f"not in this build: {', '.join(lacking)}" if lacking else "every candidate answered"


def _fits_nowhere(error: str) -> str:
    """The smallest per-rank need the error names (its settings' "needs X" or "with X in use")."""
    needs = re.findall(r"checkpointing (\w+), one rank of \d+ under ([\w-]+)\): one training step "
                       r"at micro-batch 1 ran out of memory with ([\d.]+ [KMGT]iB) in use", error)
    return "; ".join(f"{layout} ckpt {ckpt} {need}" for ckpt, layout, need in needs) or error[:200]


def _print_candidates(found: dict) -> None:
    for line in found["candidates"]:
        print(f"  - {line}", flush=True)
    print(flush=True)


def _env(shape: str, seq: int = SEQ_LEN) -> dict:
    return dict(os.environ, AUTOTUNE_LLAMA=shape, AUTOTUNE_LLAMA_SEQ=str(seq),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.3f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", nargs="*", default=[], choices=list(CHECKS))
    parser.add_argument("--plan", nargs="*", default=[], choices=list(PLANS))
    parser.add_argument("--full", nargs="*", default=[], choices=list(PLANS),
                        help="also plan these from full builds, for the speed-up")
    parser.add_argument("--fixed", action="store_true",
                        help="plan data parallel only (--tp/--cp/--pp 1), as before the layout search")
    parser.add_argument("--reasons", action="store_true", help="print each plan's layout reason")
    parser.add_argument("--optimize", choices=("memory", "throughput"), default="memory",
                        help="--plan's rule: the fewest steps (memory) or the predicted throughput")
    args = parser.parse_args()
    ok = True
    if args.check:
        print(f"| model | world / group | tp | n × window | precision | ckpt | synthesized: reserved "
              f"peak (forward-backward, optimizer), tensors | full build | difference | synthesized "
              f"CPU s | full CPU s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for shape in args.check:
            for row in check(shape):
                few, full = row["few"], row["full"]
                same = few[:4] == full[:4]
                ok = ok and same
                synthesized = (f"{few[0]} ({few[1]}, {few[2]}), {few[3]}" if not row["unsynthesized"]
                               else f"full build: {row['unsynthesized']}")
                print(f"| {shape} | {row['world']} / {row['group'] or row['world']} | {row['tp']} | "
                      f"{row['n']} × {row['window']} | {row['precision']} | {row['checkpointing']} | "
                      f"{synthesized} | {full[0]} ({full[1]}, {full[2]}), "
                      f"{full[3]} | {few[0] - full[0]} B | {few[4]:.1f} | {full[4]:.1f} |", flush=True)
    if args.plan:
        print("\n| model | world | target | sequence | CPU s | wall s | peak RSS | layout | split | ckpt | "
              "per-rank peak | search | full build: CPU s (speed-up) | same plan |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory(prefix="llama_plans_") as tmp:
            for shape in args.plan:
                world, target, seq = PLANS[shape]
                found = plan(shape, pathlib.Path(tmp) / f"{shape}.json", full=False, search=not args.fixed,
                             optimize=args.optimize)
                made = found["plan"]
                ok = ok and found["cpu_s"] < 60 and found["rss_gib"] < 2
                head = (f"| {shape} | {world} | {target} | {seq} | {found['cpu_s']:.0f} | "
                        f"{found['wall_s']:.0f} | {found['rss_gib']:.2f} GiB |")
                if made is None:
                    print(f"{head} none fits: {_fits_nowhere(found['error'])} | - | - | - | - | not run | - |",
                          flush=True)
                    if args.reasons:
                        print(f"\n  {found['error']}\n", flush=True)
                        _print_candidates(found)
                    continue
                versus, same = "not run", "-"
                if shape in args.full:
                    before = plan(shape, pathlib.Path(tmp) / f"{shape}-full.json", full=True,
                                  search=not args.fixed, optimize=args.optimize)
                    versus = f"{before['cpu_s']:.0f} ({before['cpu_s'] / found['cpu_s']:.1f}x)"
                    keys = ("micro_batches", "sharding", "shard_group", "checkpointing",
                            "predicted_peak_bytes", "parallel")
                    same = "yes" if before["plan"] and all(made.get(k) == before["plan"].get(k)
                                                          for k in keys) else "NO"
                    ok = ok and same == "yes"
                derived, ckpt = made["derived"], made["checkpointing"]
                search = _searched(made) if "layout" in made["reasons"] else "data parallel only"
                print(f"{head} {_layout(made)} | {derived['micro_batch']} × {derived['accumulation_steps']} | "
                      f"{ckpt['blocks']} of {ckpt['total']} | {_gib(made['predicted_peak_bytes'])} | "
                      f"{search} | {versus} | {same} |", flush=True)
                if args.reasons:
                    print(f"\n  layout: {made['reasons'].get('layout')}\n", flush=True)
                    _print_candidates(found)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
