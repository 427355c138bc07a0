"""FSDP2 per-rank peak: the one-process fake estimate against real gloo runs on the CPU.

For every bundled example and world sizes 2 and 4, estimates one rank's peak (fake tensors, fake
process group, gloo's collective buffers counted) and runs the same step under torchrun with
gloo, each rank measuring every micro-batch --repeats times with the CPU memory backend. Prints
the estimate, the smallest real peak (the largest rank's smallest over the repeats: every gloo
buffer released at once) and the largest (any rank, any repeat: a gloo worker thread released a
collective's buffers late), and the errors against both.

    python bench/fsdp_estimate_accuracy.py [--world-sizes 2 4] [--micro-batches 1 2 4] [--repeats 5]

Exit status 1 when an error against the largest real peak passes --tolerance (3%): the estimate
must cover the larger peak a real run shows, as the plan must.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from autotune.probing.estimate import estimate_peaks  # noqa: E402
from autotune.units import format_bytes  # noqa: E402
from fsdp_helpers import real_fsdp_peaks, steady_peak, worst_peak  # noqa: E402


def accuracy_cells(estimated: int, real: list[list[int]]) -> tuple[str, float]:
    """"estimate | real min | error | real max | error" for one micro-batch, and the error
    against the largest real peak (every rank's repeats in ``real``)."""
    low, high = steady_peak(real), worst_peak(real)
    error = (estimated - high) / high
    return (f"{format_bytes(estimated)} | {format_bytes(low)} | {(estimated - low) / low:+.2%} | "
            f"{format_bytes(high)} | {error:+.2%}"), error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--examples", nargs="+", default=None, help="example names (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    print("| example | world | n | estimate | real min | error | real max | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    paths = sorted((ROOT / "examples").glob("*.py"))
    if args.examples:
        paths = [p for p in paths if p.stem in args.examples]
    with tempfile.TemporaryDirectory() as out:
        for path in paths:
            for world in args.world_sizes:
                estimated = estimate_peaks(path, args.micro_batches, sharding="fsdp", world_size=world)
                real = real_fsdp_peaks(path, world, args.micro_batches, pathlib.Path(out),
                                       repeats=args.repeats)
                for n in args.micro_batches:
                    cells, error = accuracy_cells(estimated[n], real[n])
                    worst_error = max(worst_error, abs(error))
                    print(f"| {path.stem} | {world} | {n} | {cells} |", flush=True)
    print(f"\nlargest error against the largest real peak: {worst_error:.2%} "
          f"(tolerance {args.tolerance:.0%})")
    return 1 if worst_error > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
