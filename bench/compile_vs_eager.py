"""Compiled vs eager training steps: the probe's answer and the peak there, side by side.

For each model and memory limit, ``autotune.probe`` runs once eager and once per torch.compile
backend (``compile=``), on the CPU memory backend: the largest micro-batch whose real step fits,
the measured peak of one step at the eager answer (the same micro-batch for every column, so
the peaks compare like for like), the graphs torch.compile compiled over all trials, and the
probe's seconds.

The CPU backend counts the tensors the step's ops return and the buffers inductor's generated
code allocates (docs/fine-tuning.md, "torch.compile"). Inductor compiles C++ per graph: minutes on
a loaded machine.

    python bench/compile_vs_eager.py                         # eager, aot_eager, inductor
    python bench/compile_vs_eager.py --backends aot_eager --cases tiny_lm
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.memory.cpu import CPUMemoryBackend  # noqa: E402
from autotune.precision import Precision  # noqa: E402
from autotune.probing.api import probe  # noqa: E402
from autotune.probing.trial import TrialSession  # noqa: E402
from autotune.compiled import with_compile  # noqa: E402
from autotune.workload.contract import load_workload  # noqa: E402

CASES = [("tiny_lm", ROOT / "examples" / "tiny_lm.py", "256MiB"),
         ("gpt_varlen", ROOT / "examples" / "gpt_varlen.py", "64MiB")]


def _peak_at(path, limit, backend, n) -> int:
    workload = with_compile(load_workload(path), backend)
    session = TrialSession(workload, CPUMemoryBackend(limit), precision=Precision.FP32)
    with session:
        trial = session.run(n)
    return trial.peak_bytes if trial.fits else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--cases", nargs="+", default=[name for name, _, _ in CASES])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; CPU memory backend; fp32, checkpointing off")
    print(f"{'model':<11} {'limit':>7} {'step':<27} {'max mb':>6} {'vs eager':>8} "
          f"{'peak @ eager mb':>16} {'vs eager':>8} {'graphs':>6} {'seconds':>8}")
    for name, path, limit in CASES:
        if name not in args.cases:
            continue
        eager_answer = eager_peak = None
        for backend in [None, *args.backends]:
            started = time.perf_counter()
            result = probe(str(path), memory_limit=limit, compile=backend)
            seconds = time.perf_counter() - started
            if eager_answer is None:
                eager_answer = result.max_micro_batch
            peak = _peak_at(path, limit, backend, eager_answer)
            eager_peak = eager_peak or peak
            label = "eager" if backend is None else f"compiled ({backend})"
            graphs = "-" if result.graphs_compiled is None else str(result.graphs_compiled)
            print(f"{name:<11} {limit:>7} {label:<27} {result.max_micro_batch:>6} "
                  f"{result.max_micro_batch / eager_answer:>8.3f} {peak / 2**20:>12.2f} MiB "
                  f"{peak / eager_peak:>8.4f} {graphs:>6} {seconds:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
