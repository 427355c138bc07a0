"""FSDP2 per-rank peak: the one-process fake estimate against real gloo runs on the CPU.

For every bundled example and world sizes 2 and 4, estimates one rank's peak (fake tensors, fake
process group) and runs the same step under torchrun with gloo, each rank measuring with the CPU
memory backend three times per micro-batch. Prints the estimate, the real steady peak (the largest
rank's smallest of the three), the worst peak seen on any rank, and the errors.

    python bench/fsdp_estimate_accuracy.py [--world-sizes 2 4] [--micro-batches 1 2 4]

Exit status 1 when an error against the steady peak passes --tolerance (3%).
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    print("| example | world | n | estimate | real (steady) | error | real (worst seen) | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    with tempfile.TemporaryDirectory() as out:
        for path in sorted((ROOT / "examples").glob("*.py")):
            for world in args.world_sizes:
                estimated = estimate_peaks(path, args.micro_batches, sharding="fsdp", world_size=world)
                real = real_fsdp_peaks(path, world, args.micro_batches, pathlib.Path(out))
                for n in args.micro_batches:
                    steady, worst = steady_peak(real[n]), worst_peak(real[n])
                    error = (estimated[n] - steady) / steady
                    worst_error = max(worst_error, abs(error))
                    print(f"| {path.stem} | {world} | {n} | {format_bytes(estimated[n])} | "
                          f"{format_bytes(steady)} | {error:+.2%} | {format_bytes(worst)} | "
                          f"{(estimated[n] - worst) / worst:+.2%} |", flush=True)
    print(f"\nlargest error against the steady peak: {worst_error:.2%} (tolerance {args.tolerance:.0%})")
    return 1 if worst_error > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
