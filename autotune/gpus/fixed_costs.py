"""Device memory a CUDA training process uses outside torch's caching allocator, which
``torch.cuda.max_memory_reserved()`` therefore never shows: subtracted from the card's memory
before the modelled reserved peak is held to it (see docs/reserved-memory.md).

- The CUDA context (driver, kernels' code, the primary context's heaps): NVML counts it, torch
  does not. Per GPU profile (``cuda_context_bytes``), not a datasheet figure.
- NCCL's communication buffers, one set per communicator: NCCL allocates them itself (cudaMalloc
  or cuMem*), not through torch's allocator. Estimated here from NCCL's documented buffer sizes.

What is *inside* reserved (so modelled by ``memory.cuda_allocator`` instead): the cuBLAS and
cuBLASLt workspaces, which torch allocates through its caching allocator.
"""

from __future__ import annotations

import os

NCCL_BUFFSIZE = 4 * 1024 * 1024
"""The Simple protocol's buffer per connection: NCCL_BUFFSIZE, default 4194304 B (NCCL user guide,
"Environment Variables", NCCL_BUFFSIZE: "the size of the buffer used by NCCL when communicating
data between pairs of GPUs"; https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)."""
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
"""The LL protocol's buffer per connection: NCCL_LL_LINES_PER_THREAD (8) x NCCL_LL_MAX_NTHREADS
(512) x NCCL_STEPS (8) x 16 B lines (NVIDIA/nccl src/include/device.h), 512 KiB."""
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
"""The LL128 protocol's buffer per connection: NCCL_LL128_ELEMS_PER_THREAD (120) x
NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS (8) x 8 B (same header), 4.69 MiB."""
NCCL_CHANNELS = 32
"""Channels NCCL opens on an NVLink/NVSwitch node (NCCL_MAX_NCHANNELS overrides): NCCL chooses
per topology, so this is an assumption (MAXCHANNELS is 32 in older NCCL, 64 in newer), on the
high side for an 8-GPU H100 node."""


def nccl_buffer_bytes(world_size: int, environ=None) -> int:
    """One NCCL communicator's buffers on one rank: for each channel, the receive buffers of the
    ring connection from the previous rank, one per protocol (a send's buffer lives at the
    receiver). 0 for one rank (no communicator). Tree, NVLS and point-to-point connections that
    NCCL adds on some topologies are not counted."""
    if world_size <= 1:
        return 0
    environ = os.environ if environ is None else environ
    simple = _env_int(environ, "NCCL_BUFFSIZE", NCCL_BUFFSIZE)
    channels = _env_int(environ, "NCCL_MAX_NCHANNELS", NCCL_CHANNELS)
    return channels * (simple + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE)


def outside_torch_bytes(profile, world_size: int) -> int:
    """What one rank's CUDA process holds outside torch's allocator on a ``profile``'s card: the
    CUDA context and, for more than one rank, NCCL's buffers."""
    return profile.cuda_context_bytes + nccl_buffer_bytes(world_size)


def _env_int(environ, name: str, default: int) -> int:
    text = environ.get(name, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else default


__all__ = ["NCCL_BUFFSIZE", "NCCL_CHANNELS", "nccl_buffer_bytes", "outside_torch_bytes"]
