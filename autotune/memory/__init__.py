"""Device memory backends: one interface (``MemoryBackend``), one class per device kind."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import DeviceInfo, MemoryBackend
from .cpu import CPUMemoryBackend
from .cuda import CUDAMemoryBackend, cuda_available, describe_cuda_devices


def resolve_device(device=None) -> torch.device:
    """``None`` means CUDA when available, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda") if cuda_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")
    if resolved.type == "cuda" and not cuda_available():
        raise ConfigError(f"--device {device}: this torch sees no CUDA device "
                          f"(torch.cuda.is_available() is False, torch {torch.__version__}); "
                          f"use --device cpu, or run where a GPU is visible")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s); "
                          f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return resolved


def backend_for(device=None, memory_limit=None, *, offload: bool = False) -> MemoryBackend:
    """The memory backend of ``device``; ``offload`` (fsdp-offload): on the CPU, the host memory
    FSDP2 keeps is counted apart from the "device's", as on CUDA it is not the device's."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return CUDAMemoryBackend(resolved.index, memory_limit=memory_limit)
    return CPUMemoryBackend(memory_limit=memory_limit, offload=offload)


__all__ = [
    "CPUMemoryBackend", "CUDAMemoryBackend", "DeviceInfo", "MemoryBackend",
    "backend_for", "cuda_available", "describe_cuda_devices", "resolve_device",
]
