"""Per-op selective checkpointing (issue 15, optional): does saving the matmul outputs and
recomputing only the cheap ops pay against checkpointing whole blocks?

Times forward + backward of examples/tiny_lm.py with its 4 blocks: not checkpointed, each block
checkpointed whole, and each block checkpointed with
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (matmul and attention outputs
MUST_SAVE, everything else PREFER_RECOMPUTE). Three models side by side, steps interleaved,
median step; speeds relative to no checkpointing.

    python bench/per_op_checkpointing.py --micro-batches 4 8 16 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.cli.format import table  # noqa: E402
from autotune.workload.contract import load_workload  # noqa: E402

aten = torch.ops.aten
SAVED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
         aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._scaled_dot_product_attention_math.default}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_blocks(model, per_op: bool):
    context = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)} if per_op else {}
    for block in model.blocks:
        forward = type(block).forward
        block.forward = functools.partial(
            lambda x, block, forward: checkpoint(forward, block, x, use_reentrant=False, **context),
            block=block, forward=forward)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workload = load_workload(Path(__file__).resolve().parent.parent / "examples" / "tiny_lm.py")
    rows = []
    for n in args.micro_batches:
        ratios = {"whole blocks": [], "per op (matmuls saved)": []}
        for _ in range(args.repeats):
            models = {}
            for name in ("none", *ratios):
                torch.manual_seed(0)
                models[name] = workload.new_model()
                if name != "none":
                    _checkpoint_blocks(models[name], per_op=name.startswith("per op"))
            batch = workload.batch(n)
            times = {name: [] for name in models}
            for _ in range(args.steps):
                for name, model in models.items():
                    started = time.perf_counter()
                    workload.loss(model, batch)[0].backward()
                    times[name].append(time.perf_counter() - started)
            median = {name: statistics.median(found[2:]) for name, found in times.items()}
            for name in ratios:
                ratios[name].append(median["none"] / median[name])
        rows.append([n, *(f"{min(r):.2f}-{max(r):.2f}" for r in ratios.values())])
    print(f"tiny_lm, {torch.get_num_threads()} thread(s), {args.repeats} repeats; forward+backward "
          f"speed ÷ no checkpointing's (min-max)")
    print(table(["micro-batch", "whole blocks", "per op (matmuls saved)"], rows, align="rrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
