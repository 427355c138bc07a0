"""Optimizers and the eval batch: estimate vs measured peak, probe vs exact, train vs eval batch.

Table 1, for each optimizer of tests/optimizer_models.py on its tiny LM (bitsandbytes 8-bit and
paged AdamW, torchao 8-bit and 4-bit AdamW, Hugging Face's and torch's Adafactor, AdamW with
two parameter groups): the optimizer state's bytes, the fake-tensor estimate of one steady-state
step at --micro-batch against the CPU backend's measured peak, and the probe's micro-batch under
--memory-limit against exact bisection over real steps (with the probe's real trials).

Table 2, for each bundled example (examples/*.py): the plan's training micro-batch (the probe's
largest, checkpointing off, fp32) and its eval micro-batch (forward only under no_grad), with the
seconds the eval batch added to the plan.

    python bench/optimizers.py
    python bench/optimizers.py --only bnb-AdamW8bit torchao-AdamW8bit --skip-eval

Exit status 1 when an estimate misses by more than --tolerance (3%) or a probe is not exact.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import time
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from autotune import plan, probe  # noqa: E402
from autotune.memory.cpu import CPUMemoryBackend  # noqa: E402
from autotune.precision import Precision  # noqa: E402
from autotune.probing.estimate import estimate_peak  # noqa: E402
from autotune.probing.trial import TrialSession  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

import optimizer_models  # noqa: E402

EXAMPLE_LIMITS = {"mlp": "64MiB", "cnn_bn": "64MiB", "tiny_lm": "128MiB", "gpt_varlen": "128MiB"}


def _state_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            inner = ([getattr(value, n) for n in value.__tensor_flatten__()[0]]
                     if hasattr(value, "__tensor_flatten__") else [value])
            total += sum(t.numel() * t.element_size() for t in inner)
    return total


def _bisection(workload, limit: str) -> tuple[int, int]:
    """(largest fitting n, real steps): doubling from 1, then bisection, every size a real step."""
    steps = 0
    with TrialSession(workload, CPUMemoryBackend(limit), precision=Precision.FP32) as session:
        def fits(n):
            nonlocal steps
            steps += 1
            return session.run(n).fits

        fit, fail = 0, 1
        while fits(fail):
            fit, fail = fail, fail * 2
        while fail - fit > 1:
            mid = (fit + fail) // 2
            fit, fail = (mid, fail) if fits(mid) else (fit, mid)
    return fit, steps


def optimizer_rows(names, micro_batch: int, limit: str):
    for name in names:
        package, _ = optimizer_models.OPTIMIZERS[name]
        if package is not None:
            try:
                importlib.import_module(package)
            except Exception as exc:  # noqa: BLE001 - report and go on
                yield [name, f"skipped: {package} does not import ({type(exc).__name__})"]
                continue
        workload = optimizer_models.workload(name)
        with TrialSession(workload, CPUMemoryBackend("4GiB"), precision=Precision.FP32) as session:
            measured = session.run(micro_batch).peak_bytes
            state = _state_bytes(session.optimizer)
        estimated = estimate_peak(workload, micro_batch)
        found = probe(workload, device="cpu", memory_limit=limit)
        exact, steps = _bisection(workload, limit)
        error = (estimated - measured) / measured
        yield [name, format_bytes(state), estimated, measured, f"{error:+.4%}", found.max_micro_batch,
               exact, len(found.trials), steps, error]


def eval_rows(names):
    for name in names:
        path = ROOT / "examples" / f"{name}.py"
        limit = EXAMPLE_LIMITS[name]
        args = dict(target_batch=1 << 14, device="cpu", memory_limit=limit, precision="fp32",
                    checkpointing="off")
        started = time.perf_counter()
        without = plan(path, eval_batch=False, **args)
        middle = time.perf_counter()
        planned = plan(path, **args)
        seconds = time.perf_counter() - middle - (middle - started)
        yield [name, limit, planned.micro_batch, planned.eval_micro_batch,
               f"{planned.eval_micro_batch / planned.micro_batch:.1f}x", f"{seconds:+.1f}",
               without.micro_batch == planned.micro_batch]


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(optimizer_models.OPTIMIZERS),
                        default=list(optimizer_models.OPTIMIZERS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--memory-limit", default="8MiB")
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--examples", nargs="+", choices=list(EXAMPLE_LIMITS), default=list(EXAMPLE_LIMITS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    bad = False
    rows = []
    for row in optimizer_rows(args.only, args.micro_batch, args.memory_limit):
        if len(row) > 2:
            error = row.pop()
            bad |= abs(error) > args.tolerance or row[5] != row[6]
        rows.append(row)
    print(f"optimizers on tests/optimizer_models.py's tiny LM: estimate at micro-batch "
          f"{args.micro_batch}, probe and bisection under {args.memory_limit} (CPU backend, fp32)")
    print(_table(["optimizer", "state", "estimated", "measured", "error", "probe", "exact",
                  "probe real steps", "bisection steps"],
                 [r if len(r) > 2 else r + [""] * 7 for r in rows]))
    if not args.skip_eval:
        print("\ntrain vs eval micro-batch (plan, fp32, checkpointing off, headroom 10%)")
        print(_table(["example", "budget", "train", "eval", "eval/train", "eval s added",
                      "same train plan"], list(eval_rows(args.examples))))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
