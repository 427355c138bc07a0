"""Tensor parallel per-rank peak: the one-process fake estimate against real gloo runs on the CPU.

For tiny_lm (a plan autotune derives: its MLPs split, its packed attention replicated) and the
tiny Hugging Face Llama (its own tp_plan), TP 2 on 2 ranks and FSDP 2 x TP 2 on 4 ranks: the
estimate (fake tensors, fake process group) against the same step under torchrun with gloo, each
rank measuring every micro-batch --repeats times with the CPU memory backend. Prints the estimate,
the typical real peak (the largest rank's median over the repeats), the largest (any rank, any
repeat), and the errors against both.

    python bench/tp_estimate_accuracy.py [--micro-batches 1 2 4] [--repeats 5]

Exit status 1 when the estimate is more than --tolerance (3%) below the typical real peak. The
estimate holds a collective's buffers until the next collective, as gloo's worker thread sometimes
does (the largest real peak); repeats where it let go at once are below it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from autotune import Layout  # noqa: E402
from autotune.probing.estimate import estimate_peaks  # noqa: E402
from autotune.units import format_bytes  # noqa: E402
from fsdp_helpers import real_fsdp_peaks, typical_peak, worst_peak  # noqa: E402

MODELS = {"tiny_lm": ROOT / "examples" / "tiny_lm.py", "llama": ROOT / "examples" / "real" / "llama.py"}
LAYOUTS = {2: "TP 2", 4: "FSDP 2 × TP 2"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    print("| model | layout | n | estimate | real typical | error | real max | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    with tempfile.TemporaryDirectory() as out:
        for name, path in MODELS.items():
            for world, label in LAYOUTS.items():
                estimated = estimate_peaks(path, args.micro_batches, sharding="fsdp", world_size=world,
                                           parallel=Layout(tp=2))
                real = real_fsdp_peaks(path, world, args.micro_batches, pathlib.Path(out),
                                       repeats=args.repeats, tp=2)
                for n in args.micro_batches:
                    typical, high = typical_peak(real[n]), worst_peak(real[n])
                    error = (estimated[n] - typical) / typical
                    worst_error = max(worst_error, -error)
                    print(f"| {name} | {label} | {n} | {format_bytes(estimated[n])} | "
                          f"{format_bytes(typical)} | {error:+.2%} | {format_bytes(high)} | "
                          f"{(estimated[n] - high) / high:+.2%} |", flush=True)
    print(f"\nlargest miss below the typical real peak: {worst_error:.2%} "
          f"(tolerance {args.tolerance:.0%})")
    return 1 if worst_error > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
