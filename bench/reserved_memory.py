"""Tensors vs modelled reserved memory for a Llama-3.1-8B shape on 8 H100s, next to a published run.

The configuration of torchtitan's docs/performance.md, Table 2 (pytorch/torchtitan): Llama 3.1 8B,
8 H100 GPUs, FSDP over the 8, local batch 1, sequence 32768, full activation checkpointing; its
"Memory(GiB)" column is 83.9 GiB (torchtitan logs the allocator's peak reserved memory,
``torch.cuda.max_memory_reserved``). torchtitan's run_train.sh runs with
``PYTORCH_ALLOC_CONF=expandable_segments:True``. That run also used torch.compile and Float8
linears, which bench/llama_like.py (a plain bf16 eager Llama shape without rotary embeddings)
does not model: the comparison is of magnitudes, not a fit.

For each allocator configuration, one step of one rank is estimated on fake tensors (bf16
autocast, AdamW, FSDP2 over a fake process group of 8) with the allocator modelled
(``autotune.estimate_cuda_peaks``): the tensors' peak, the modelled reserved peak, and the
reserved peak plus what lives outside torch's allocator on the card (the H100 profile's CUDA
context and NCCL's buffers, ``autotune.gpus.fixed_costs``).

    OMP_NUM_THREADS=1 python bench/reserved_memory.py [--seq 32768] [--shape 8b] [--world 8]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PUBLISHED_GIB = 83.9
"""torchtitan docs/performance.md, Table 2, "FSDP 8, CP 1", sequence 32768: Memory(GiB)."""
CONFIGS = {"default": "", "expandable_segments": "expandable_segments:True"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b", choices=["1b", "8b", "70b"])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args()
    os.environ["AUTOTUNE_LLAMA"], os.environ["AUTOTUNE_LLAMA_SEQ"] = args.shape, str(args.seq)

    import autotune
    from autotune.gpus.catalog import load_profile
    from autotune.gpus.fixed_costs import nccl_buffer_bytes

    profile = load_profile("h100-80gb")
    outside = profile.cuda_context_bytes + nccl_buffer_bytes(args.world)
    gib = 2**30
    print(f"Llama {args.shape}, sequence {args.seq}, micro-batch {args.micro_batch}, FSDP over "
          f"{args.world}, full checkpointing, bf16; outside torch's allocator: "
          f"{outside / gib:.2f} GiB (CUDA context {profile.cuda_context_bytes / gib:.2f} GiB + NCCL "
          f"{nccl_buffer_bytes(args.world) / gib:.2f} GiB)")
    print("| allocator | tensors GiB | reserved GiB | reserved/tensors | + outside GiB | "
          "published reserved GiB | reserved/published | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, conf in CONFIGS.items():
        os.environ["PYTORCH_ALLOC_CONF"] = conf
        started = time.perf_counter()
        tensors, reserved = autotune.estimate_cuda_peaks(
            ROOT / "bench" / "llama_like.py", [args.micro_batch], gpu_name=profile.name,
            precision="bf16", checkpointing="on", sharding="fsdp",
            world_size=args.world)[args.micro_batch]
        seconds = time.perf_counter() - started
        print(f"| {name} | {tensors / gib:.2f} | {reserved / gib:.2f} | {reserved / tensors:.3f} | "
              f"{(reserved + outside) / gib:.2f} | {PUBLISHED_GIB} | {reserved / gib / PUBLISHED_GIB:.3f} "
              f"| {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
