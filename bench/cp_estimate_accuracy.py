"""Context parallelism's per-rank peak: the one-process fake estimate against real gloo runs.

For each model, estimates one rank's peak under cp 2 on 2 ranks (fake process group, fake
tensors, torch's ring attention on the CPU flash kernel) and runs the same step under torchrun
with gloo (tests/fsdp_peak_script.py), each rank measuring every micro-batch --repeats times with
the CPU memory backend. Prints the estimate, the smallest real peak (the largest rank's smallest
over the repeats) and the largest (any rank, any repeat), the errors against both, and the
estimate's own time.

    python bench/cp_estimate_accuracy.py [--micro-batches 1 2 4] [--repeats 3]

Exit status 1 when an error against the largest real peak passes --tolerance (3%).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from autotune.distributed.layout import Layout  # noqa: E402
from autotune.probing.estimate import estimate_peaks  # noqa: E402
from fsdp_estimate_accuracy import accuracy_cells  # noqa: E402
from fsdp_helpers import real_fsdp_peaks  # noqa: E402

MODELS = {
    "llama (examples/real)": ROOT / "examples" / "real" / "llama.py",
    "gpt2, no dropout (tests)": ROOT / "tests" / "cp_hf_gpt2_model.py",
    "llama, 2 layers (tests)": ROOT / "tests" / "cp_hf_llama_model.py",
    "causal_lm, SDPA (tests)": ROOT / "tests" / "cp_causal_lm_model.py",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    print(f"cp {args.cp} on {args.cp} ranks (FSDP2 over them), fp32\n")
    print("| model | n | estimate | real min | error | real max | error | estimate s |")
    print("|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    with tempfile.TemporaryDirectory() as out:
        for label, path in MODELS.items():
            start = time.process_time()
            estimated = estimate_peaks(path, args.micro_batches, sharding="fsdp", world_size=args.cp,
                                       parallel=Layout(cp=args.cp))
            seconds = time.process_time() - start
            real = real_fsdp_peaks(path, args.cp, args.micro_batches, pathlib.Path(out),
                                   repeats=args.repeats, cp=args.cp)
            for n in args.micro_batches:
                cells, error = accuracy_cells(estimated[n], real[n])
                worst_error = max(worst_error, abs(error))
                print(f"| {label} | {n} | {cells} | {seconds:.1f} |", flush=True)
    print(f"\nlargest error against the largest real peak: {worst_error:.2%} "
          f"(tolerance {args.tolerance:.0%})")
    return 1 if worst_error > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
