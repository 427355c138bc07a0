"""Predicted tokens/s per GPU, MFU and memory for Llama 3.1 on H100s, next to published figures.

Each case plans ``bench/llama_like.py`` (the Llama 3.1 shape AUTOTUNE_LLAMA names, sequences of
8192 tokens) for the ``h100-80gb`` profile with FSDP2 over the whole world and a local batch of 2
(``--micro-batch 2``, ``--target-batch 2 x world``), checkpointing auto, twice in fresh processes:
``--optimize memory`` (today's rule) and ``--optimize throughput`` (ranked by the predicted step
time). Printed: the prediction, the plan's predicted peak — the reserved memory of torch's caching
allocator as modelled for the GPU (``memory/cuda_allocator.py``), what
``torch.cuda.max_memory_reserved()`` would show and torchtitan logs — with the tensors' allocated
peak beside it, what each planning run cost (CPU seconds, the measure that the machine's load does
not inflate, and wall seconds) and their ratio. Layouts: FSDP2 over the whole world, or the
model-parallel layout a case names.

    python bench/step_time_llama.py [--cases 8b:8 8b:128 70b:256:tp2 405b:512:tp4 70b:256 8b:8:cp8]
                                    [--headroom 0.1]

A case SHAPE:WORLD[:LAYOUT[:bN]] (LAYOUT such as tp2, tp2cp4 or tp8pp8) plans that model-parallel
layout, FSDP2 over its data-parallel ranks, a local batch of 2 (or N, in micro-batches of 2: a
pipeline of pp 8 needs at least 16) per data-parallel rank; its
TPS/GPU then holds the layout's exposed tensor-parallel collectives and bubble
(``timing.layout``), per GPU.

Published (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md in github.com/pytorch/torchtitan,
Dec 2024; also arXiv:2410.06511): H100 SXM with 96 GB HBM2e at 500 W, 400 Gb/s per GPU, bf16,
sequence 8192, TPS/GPU read at iteration 90, memory = peak reserved:
- 8B, 8 GPUs, FSDP, local batch 2, selective AC: 5,762 TPS/GPU, 82.4 GiB (Table 1);
- 8B, 128 GPUs, same: 5,605 TPS/GPU, 67.0 GiB (Table 3); both "33% to 39% MFU" (the lower with
  torch.compile... "with or without torch.compile, respectively": 33% with, 39% without);
- 70B, 256 GPUs: only FSDP 32 x TP 8 with torch.compile and Float8, local batch 16: 829 TPS/GPU,
  71.9 GiB (Table 4) — not the layout planned here;
- 405B, 512 GPUs: only FSDP 8 x TP 8 x PP 8 with compile, Float8, AsyncTP, local batch 32, 1F1B:
  100 TPS/GPU, 82.5 GiB (Table 5) — not the layout planned here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.planning.planfile import load_plan  # noqa: E402
SEQ = 8192
LOCAL_BATCH = 2
GiB = 2**30

# (shape, world) -> (TPS/GPU, MFU text, memory GiB, what was run): the sources in the docstring.
PUBLISHED = {
    ("8b", 8): (5762, "33-39%", 82.4, "FSDP, selective AC"),
    ("8b", 128): (5605, "33-39%", 67.0, "FSDP, selective AC"),
    ("70b", 256): (829, "-", 71.9, "FSDP 32 x TP 8, compile, Float8, local batch 16"),
    ("405b", 512): (100, "-", 82.5, "FSDP 8 x TP 8 x PP 8, compile, Float8, local batch 32"),
}


def plan_once(shape: str, world: int, optimize: str, out: Path,
              headroom: float = 0.1, layout: dict | None = None,
              local_batch: int = LOCAL_BATCH) -> tuple[dict, float, float]:
    """The plan file, and the CPU and wall seconds its planning process took. ``layout``:
    {"tp": 2, "cp": 4, ...}; ``local_batch`` per data-parallel rank, in micro-batches of 2 (a
    pipeline's micro-batches are its accumulation steps: at least pp of them)."""
    layout = layout or {}
    data_parallel = world // (layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1))
    env = dict(os.environ, AUTOTUNE_LLAMA=shape, AUTOTUNE_LLAMA_SEQ=str(SEQ), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "autotune", "plan", str(ROOT / "bench" / "llama_like.py"),
               "--gpu", "h100-80gb", "--gpus-per-node", "8", "--world-size", str(world),
               "--target-batch", str(local_batch * data_parallel),
               "--micro-batch", str(LOCAL_BATCH), "--sharding", "fsdp", "--optimize", optimize,
               "--headroom", str(headroom), "-o", str(out), "--quiet",
               *[arg for degree, value in layout.items() for arg in (f"--{degree}", str(value))]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}, cpu, wall
    data = json.loads(out.read_text())
    # The planned trial's tensors (the plan file states the reserved peak; its trials both).
    trial = load_plan(out).planned_trial
    data["allocated_peak_bytes"] = trial.allocated_peak_bytes if trial is not None else None
    return data, cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 70B and 405B in the layouts the layout search plans for them (bench/llama_plans.py): under
    # FSDP2 alone neither fits a local batch of 2 (``70b:256``, ``405b:512`` say why).
    parser.add_argument("--cases", nargs="+", default=["8b:8", "8b:128", "70b:256:tp2", "405b:512:tp4"])
    parser.add_argument("--headroom", type=float, default=0.1,
                        help="the plans' --headroom (0.1, the planner's default)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="throughput_llama_") as tmp:
        for case in args.cases:
            shape, world, *split = case.split(":")
            world = int(world)
            layout = {degree: int(value) for degree, value in re.findall(r"(tp|cp|pp)(\d+)", split[0])} if split else {}
            local_batch = int(split[1][1:]) if len(split) > 1 and split[1].startswith("b") else LOCAL_BATCH
            memory, mem_cpu, mem_wall = plan_once(shape, world, "memory", Path(tmp) / f"{case}-m.json",
                                                  args.headroom, layout, local_batch)
            if "error" in memory:
                print(f"{shape} x {world}: no plan (FSDP2 over the world or the case's layout, local batch {local_batch}): "
                      f"{memory['error']} ({mem_cpu:.0f} CPU s, {mem_wall:.0f} s)", flush=True)
                continue
            ranked, cpu, wall = plan_once(shape, world, "throughput", Path(tmp) / f"{case}-t.json",
                                          args.headroom, layout, local_batch)
            t = ranked["step_time"]
            samples = t["samples_per_s"]
            tps, mfu, gib, layout = PUBLISHED.get((shape, world), (None, "-", None, "-"))
            ckpt = ranked["checkpointing"]
            rows.append(dict(
                case=f"{shape} x {world}" + (f" {split[0]}" if split else ""), ckpt="off" if not ckpt["blocks"] else
                ("on" if ckpt["blocks"] == ckpt["total"] else f"{ckpt['blocks']}/{ckpt['total']}"),
                step=t["step_s"], comm=t["exposed_comm_s"], tps=samples * SEQ, mfu=t["mfu"],
                peak=ranked["predicted_peak_bytes"] / GiB, memory_peak=memory["predicted_peak_bytes"] / GiB,
                allocated=(ranked["allocated_peak_bytes"] / GiB if ranked["allocated_peak_bytes"] else None),
                pub_tps=tps, pub_mfu=mfu, pub_gib=gib, pub_layout=layout,
                cost=cpu / mem_cpu, cpu=(mem_cpu, cpu), wall=(mem_wall, wall)))
            print_row(rows[-1], header=len(rows) == 1)
    print("\npredicted peak: torch's caching allocator's reserved memory at the planned micro-batch, "
          "as modelled (the CUDA context and NCCL buffers come on top), with the tensors' allocated "
          "peak in brackets, GiB; published memory: peak reserved; layout: FSDP2 over the world unless "
          "the case names one (tp2: FSDP x TP 2, ...)")
    print("TPS/GPU predicted = samples/s per GPU x 8192 tokens (torchtitan counts the sequence)")
    worst = max((r["cost"] for r in rows), default=float("nan"))
    print(f"planning cost, ranked / today's rule (CPU seconds): worst {worst:.2f}x")
    return 0


def _gib(value) -> str:
    return f"{value:.2f}" if value is not None else "-"  # a pipeline plan records no planned trial


def print_row(r: dict, *, header: bool) -> None:
    if header:
        print(f"{'case':<11} {'ckpt':>4} {'step s':>7} {'exp.comm s':>10} {'TPS/GPU':>8} {'MFU':>6} "
              f"{'reserved (alloc.) GiB':>21} | {'published TPS':>13} {'MFU':>6} {'GiB':>5} {'(layout)':<48} | "
              f"{'plan CPU s memory/ranked (ratio)':>34} {'wall s':>13}")
    pub_tps = f"{r['pub_tps']:,}" if r["pub_tps"] else "-"
    pub_gib = f"{r['pub_gib']:.1f}" if r["pub_gib"] else "-"
    print(f"{r['case']:<11} {r['ckpt']:>4} {r['step']:>7.3f} {r['comm']:>10.4f} {r['tps']:>8,.0f} "
          f"{r['mfu']:>6.1%} {r['peak']:>10.2f} ({_gib(r['allocated']):>6}) | {pub_tps:>13} {r['pub_mfu']:>6} {pub_gib:>5} "
          f"{r['pub_layout']:<48} | {r['cpu'][0]:>9.1f} / {r['cpu'][1]:>7.1f} ({r['cost']:.2f}x)"
          f"{'':>7} {r['wall'][0]:>6.0f}/{r['wall'][1]:<6.0f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
