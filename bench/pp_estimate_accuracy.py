"""Pipeline parallel per-rank peak: the one-process fake estimate against real gloo runs on the CPU.

For examples/tiny_lm.py and examples/mlp.py, PP 2 under 1F1B, interleaved 1F1B (2 stages per
rank) and FSDP 2 × PP 2 (1F1B, 4 ranks), estimates each pipeline rank's peak of a window of
--window micro-batches (fake tensors, a fake process group in which this process is that rank)
and runs the same window under torchrun with gloo, each rank measuring it --repeats times with
the CPU memory backend. Prints the estimate, the real peak (the largest over the repeats and the
data-parallel ranks of that pipeline rank) and the error, per pipeline rank.

With --cp, the pipelines with context parallelism instead (each sequence sharded over 2 cp ranks
inside every stage, FSDP2 over the cp ranks and any data-parallel ones), on the models whose
attention rings (SDPA, causal, a summed loss): examples/real/llama.py and tests' causal_lm and
4-layer Llama (interleaved needs 4 blocks). There the real peak is the median of the repeats
(``typical_peak``: gloo's worker threads let go of a ring's buffers late in some repeats), and
the largest is printed beside it.

    python bench/pp_estimate_accuracy.py [--micro-batches 2 4] [--window 4] [--repeats 3] [--cp]
        [--examples tiny_lm mlp real/llama] [--layouts pp interleaved fsdp-pp]

Exit status 1 when an error passes --tolerance (3%).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's autotune, and the tests' helpers

from autotune.units import format_bytes  # noqa: E402
from pp_plans import estimated_rank_peaks, real_pipeline_peaks  # noqa: E402

LAYOUTS = {"pp": ("PP 2, 1f1b", "1f1b", "ddp", 2),
           "interleaved": ("PP 2, interleaved-1f1b ×2", "interleaved-1f1b", "ddp", 2),
           "fsdp-pp": ("FSDP 2 × PP 2, 1f1b", "1f1b", "fsdp", 4)}
CP_CASES = [  # (model file, layout label, schedule, world, tp)
    (ROOT / "examples" / "real" / "llama.py", "CP 2 × PP 2, 1f1b", "1f1b", 4, 1),
    (ROOT / "tests" / "cp_causal_lm_model.py", "CP 2 × PP 2, 1f1b", "1f1b", 4, 1),
    (ROOT / "tests" / "pp_hf_llama4_model.py", "CP 2 × PP 2, interleaved-1f1b ×2", "interleaved-1f1b", 4, 1),
    (ROOT / "tests" / "cp_causal_lm_model.py", "FSDP 2 × CP 2 × PP 2, 1f1b", "1f1b", 8, 1),
    (ROOT / "examples" / "real" / "llama.py", "TP 2 × CP 2 × PP 2, 1f1b", "1f1b", 8, 2),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--examples", nargs="+", default=["tiny_lm", "mlp"],
                        help="model files under examples/, without .py (real/llama: a Hugging Face Llama)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="interleaved needs 4 blocks (the real/ models have 2)")
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--cp", action="store_true", help="pipelines with context parallelism (CP_CASES)")
    args = parser.parse_args()
    if args.cp:
        return _context_parallel(args)
    print("| example | layout | n | pp rank | estimate | real | error |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    with tempfile.TemporaryDirectory() as out:
        for example in args.examples:
            model_file = ROOT / "examples" / f"{example}.py"
            for label, schedule, sharding, world in (LAYOUTS[name] for name in args.layouts):
                for n, rank, estimate, ranks in _pipeline_ranks(model_file, args, out, schedule=schedule,
                                                                 sharding=sharding, world=world):
                    peak = max(max(peaks) for peaks in ranks)
                    error = (estimate - peak) / peak
                    worst = max(worst, abs(error))
                    print(f"| {example} | {label} | {n} | {rank} | {format_bytes(estimate)} | "
                          f"{format_bytes(peak)} | {error:+.2%} |", flush=True)
    print(f"\nlargest error: {worst:.2%} (tolerance {args.tolerance:.0%})")
    return 1 if worst > args.tolerance else 0


def _context_parallel(args) -> int:
    from fsdp_helpers import typical_peak, worst_peak

    print("| model | layout | n | pp rank | estimate | real (median) | error | real (largest) | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    with tempfile.TemporaryDirectory() as out:
        for model_file, label, schedule, world, tp in CP_CASES:
            name = f"{model_file.parent.name}/{model_file.stem}"
            for n, rank, estimate, ranks in _pipeline_ranks(model_file, args, out, schedule=schedule,
                                                             sharding="fsdp", world=world, cp=2, tp=tp):
                typical, largest = typical_peak(ranks), worst_peak(ranks)
                error = (estimate - typical) / typical
                worst = max(worst, abs(error))
                print(f"| {name} | {label} | {n} | {rank} | {estimate:,} B | {typical:,} B | {error:+.2%} | "
                      f"{largest:,} B | {(estimate - largest) / largest:+.2%} |", flush=True)
    print(f"\nlargest error against the median: {worst:.2%} (tolerance {args.tolerance:.0%})")
    return 1 if worst > args.tolerance else 0


def _pipeline_ranks(model_file, args, out, *, schedule, sharding, world, cp=1, tp=1):
    """(n, pipeline rank, its estimate, the real peaks of its ranks: a list of repeats per rank)
    for every micro-batch of ``args``: one gloo run of pp 2 on ``world`` ranks, estimates per n."""
    real = real_pipeline_peaks(model_file, pathlib.Path(out), pp=2, cp=cp, tp=tp, schedule=schedule,
                               sharding=sharding, world=world, window=args.window,
                               sizes=args.micro_batches, repeats=args.repeats)
    per_stage = world // 2
    for n in args.micro_batches:
        estimated = estimated_rank_peaks(model_file, n, schedule=schedule, window=args.window,
                                         world_size=world, sharding=sharding, cp=cp, tp=tp)
        for rank, estimate in enumerate(estimated):
            yield n, rank, estimate, real[n][rank * per_stage:(rank + 1) * per_stage]


if __name__ == "__main__":
    sys.exit(main())
