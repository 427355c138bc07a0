"""autotune probe --max-seq-len against an exact bisection over real steps (issue 20).

For tiny Hugging Face GPT-2 and Llama (2 layers, tests/seq_len_models.py) and the packed-sequence
Llama example, under CPU budgets: the longest sequence whose full training step fits at
micro-batch 1, as ``probe_seq_len`` finds it (seeded on fake tensors, then real steps) and as a
plain bisection over real steps finds it (the reference), with the real steps and seconds each
took. Both use the CPU backend's byte counting, so the answers must be equal.

    python bench/max_seq_len.py [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import autotune  # noqa: E402
from autotune.memory import backend_for  # noqa: E402
from autotune.precision import Precision  # noqa: E402
from autotune.probing.trial import TrialSession  # noqa: E402
from autotune.units import parse_bytes  # noqa: E402

from seq_len_models import POSITIONS, build_gpt2, build_llama, make_batch  # noqa: E402

CASES = [
    ("tiny GPT-2", lambda: autotune.Workload(model=build_gpt2, make_batch=make_batch), "4MiB", 1),
    ("tiny GPT-2", lambda: autotune.Workload(model=build_gpt2, make_batch=make_batch), "8MiB", 8),
    ("tiny Llama", lambda: autotune.Workload(model=build_llama, make_batch=make_batch), "3MiB", 1),
    ("tiny Llama", lambda: autotune.Workload(model=build_llama, make_batch=make_batch), "6MiB", 64),
    ("packed Llama (examples/real/llama_packed.py)",
     lambda: autotune.load_workload(ROOT / "examples" / "real" / "llama_packed.py"), "16MiB", 8),
]


def bisection(workload, memory_limit: str, multiple: int, limit: int) -> tuple[int, int]:
    """(longest length that fits, real steps), by bisection over real steps from [0, limit]."""
    length = [multiple]
    stepped = dataclasses.replace(workload, make_batch=lambda n: workload.batch(n, length[0]))
    session = TrialSession(stepped, backend_for("cpu", parse_bytes(memory_limit)), precision=Precision.FP32)
    lo, hi, steps = 0, limit // multiple + 1, 0
    with session:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            length[0] = mid * multiple
            steps += 1
            lo, hi = (mid, hi) if session.run(1).fits else (lo, mid)
    return lo * multiple, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    headers = ["model", "budget", "multiple", "probe", "exact", "equal", "real steps (probe)",
               "fake steps", "probe s", "real steps (bisection)", "bisection s"]
    rows = []
    for name, build, limit, multiple in CASES:
        workload = build()
        started = time.perf_counter()
        found = autotune.probe_seq_len(workload, memory_limit=limit, device="cpu", seq_multiple=multiple)
        probe_s = time.perf_counter() - started
        started = time.perf_counter()
        upper = found.upper_bound or POSITIONS
        exact, steps = bisection(workload, limit, multiple, upper)
        rows.append([name, limit, multiple, found.max_seq_len, exact,
                     "yes" if exact == found.max_seq_len else "NO", len(found.trials),
                     found.estimate_steps, f"{probe_s:.1f}", steps,
                     f"{time.perf_counter() - started:.1f}"])
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in rows:
            print("| " + " | ".join(map(str, row)) + " |")
    else:
        widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
        for row in [headers, *rows]:
            print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main()
