"""The CUDA memory backend: torch's allocator counters, the driver's free memory and NVML.

Every CUDA call is guarded: on a CPU-only torch build the counters return 0 or raise.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError
from ..units import format_bytes, parse_bytes
from .base import DeviceInfo, MemoryBackend


class CUDAMemoryBackend(MemoryBackend):
    kind = "cuda"

    def __init__(self, index: int | None = None, memory_limit=None):
        if not cuda_available():
            raise ConfigError(
                "--device cuda was asked for, but torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if not 0 <= index < count:
            raise ConfigError(f"--device cuda:{index} does not exist; this machine has cuda:0..cuda:{count - 1}")
        self.device = torch.device("cuda", index)
        self.index = index
        self._limit = parse_bytes(memory_limit) if memory_limit is not None else None
        self._reserved_peak = 0
        self._retries_at_start = 0
        # Read once: the budget must not move while the probe's own allocations change "free".
        self._info = self._read_info()

    def info(self) -> DeviceInfo:
        return self._info

    def _read_info(self) -> DeviceInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        held = torch.cuda.memory_reserved(self.device)
        available = free + held  # what torch already caches is ours to reuse
        if self._limit is not None:
            budget, source = min(self._limit, available), "--memory-limit"
        else:
            budget, source = available, "mem_get_info free + torch reserved"
        nvml = nvml_device(self.index)
        return DeviceInfo(
            kind="cuda",
            index=self.index,
            name=nvml.get("name") or torch.cuda.get_device_name(self.device),
            total_bytes=int(nvml.get("total") or total),
            free_bytes=int(free),
            budget_bytes=int(budget),
            budget_source=source,
        )

    @contextlib.contextmanager
    def tracking(self):
        """Cap the caching allocator at the budget so a trial OOMs where a smaller card would."""
        budget = self.budget_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = getter(self.device) if getter else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.device)

    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        # Resetting clears the reserved peak too; a trial's reserved peak spans its phases.
        self._reserved_peak = max(self._reserved_peak, self.peak_reserved_bytes())
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_reserved_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def within_budget(self) -> bool:
        return self.peak_reserved_bytes() <= self.budget_bytes

    def alloc_retries(self) -> int:
        """cudaMalloc retries after freeing the cache: a sign the allocator is thrashing."""
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def release(self) -> None:
        torch.cuda.empty_cache()

    def begin_trial(self) -> None:
        # Torch's peaks reset too: reset_peak folds max_memory_reserved into the trial's peak,
        # and unreset it still held the trial before's (on the H200 a trial at micro-batch 1
        # after a failed one at 256512 reported 13708 MiB reserved, one under a 16 GiB cap 21384).
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._reserved_peak = 0
        self._retries_at_start = self.alloc_retries()

    def memory_picture(self) -> dict:
        """Reserved peak and allocator retries of the trial, and NVML's used memory now (which
        includes the CUDA context and other processes, unlike torch's counters)."""
        return {"reserved_peak_bytes": max(self._reserved_peak, self.peak_reserved_bytes()),
                "alloc_retries": self.alloc_retries() - self._retries_at_start,
                "nvml_used_bytes": nvml_device(self.index).get("used")}


def cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except (RuntimeError, AssertionError):
        return False


def nvml_device(index: int) -> dict:
    """Name, total and used memory from NVML, or {} where NVML is missing or fails."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return {
                "name": name.decode() if isinstance(name, bytes) else name,
                "total": int(mem.total),
                "used": int(mem.used),
            }
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return {}


def describe_cuda_devices() -> list[dict]:
    """Every CUDA device: name, total, free, NVML's used (all processes and contexts) and this
    process's allocated and reserved bytes (now and peak) and allocator retries (empty without
    CUDA)."""
    if not cuda_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        nvml = nvml_device(index)
        stats = torch.cuda.memory_stats(index)
        devices.append({
            "index": index,
            "name": nvml.get("name") or torch.cuda.get_device_name(index),
            "total_bytes": int(total),
            "free_bytes": int(free),
            "used_bytes_nvml": nvml.get("used"),
            # This process's allocator: what tensors hold, what the cache holds, and retries
            # (cudaMalloc failed, the cache was freed and the call retried: fragmentation).
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "allocated_peak_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "reserved_peak_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "bf16": bool(torch.cuda.is_bf16_supported()) if index == torch.cuda.current_device() else None,
        })
    return devices


__all__ = ["CUDAMemoryBackend", "cuda_available", "describe_cuda_devices", "format_bytes"]
