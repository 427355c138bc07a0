"""The interface every device memory backend implements, and what it reports about a device."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import asdict, dataclass

import torch


@dataclass(kw_only=True)
class DeviceInfo:
    """What a device is and how much memory a probe may use on it."""

    kind: str
    """"cpu" or "cuda"."""
    name: str
    """Human-readable device name (GPU model, or the CPU)."""
    index: int | None = None
    total_bytes: int | None = None
    """Physical memory of the device (RAM for the CPU)."""
    free_bytes: int | None = None
    """Free now, as the driver or OS sees it (other processes count)."""
    budget_bytes: int
    """What the probe may use: the memory limit, or what is free plus what torch already holds."""
    budget_source: str = ""
    """Where the budget came from, e.g. "--memory-limit" or "mem_get_info"."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceInfo":
        return cls(**data)


class MemoryBackend(abc.ABC):
    """Measures the memory of training steps on one device and enforces a budget."""

    kind: str
    device: torch.device

    @abc.abstractmethod
    def info(self) -> DeviceInfo:
        """The device and its budget."""

    @property
    def budget_bytes(self) -> int:
        return self.info().budget_bytes

    def tracking(self) -> contextlib.AbstractContextManager:
        """Context inside which allocations are measured and the budget enforced."""
        return contextlib.nullcontext()

    def adopt(self, tensors) -> None:
        """Count tensors that were allocated before tracking began (parameters, state)."""

    @abc.abstractmethod
    def current_bytes(self) -> int:
        """Bytes of tensor memory live now."""

    @abc.abstractmethod
    def reset_peak(self) -> None:
        """Start a new peak window at the current usage."""

    @abc.abstractmethod
    def peak_bytes(self) -> int:
        """Highest usage since the last ``reset_peak``."""

    def within_budget(self) -> bool:
        """Whether the last window stayed within the budget (beyond not raising an OOM)."""
        return True

    def on_host(self) -> contextlib.AbstractContextManager:
        """Inside: what the step allocates lives in host memory, not on the device measured
        (fsdp-offload's optimizer state and optimizer step). Only a backend that counts host
        and device apart (the fsdp-offload estimate) tells them apart; CUDA never sees host
        memory, and the CPU holds both."""
        return contextlib.nullcontext()

    def offloaded(self, tensors) -> None:
        """These tensors now live in host memory (fsdp-offload's shards and sharded gradients)."""

    def live_storages(self) -> frozenset:
        """The storages counted now (empty where the backend cannot tell them apart)."""
        return frozenset()

    def disown_since(self, before: frozenset) -> int:
        """Stop counting storages that were not live at ``before`` (returns their bytes)."""
        return 0

    def release(self) -> None:
        """Give cached memory back after a trial."""

    def release_cached(self) -> None:
        """Inside a trial: forget what a *modelled* CUDA allocator caches and no tensor holds (the
        estimate for CUDA). A window trial's first micro-step runs at micro-batch 1 in place of
        one at n: its cached segments would stay reserved beside the next micro-step's, where
        the real window's micro-steps reuse each other's. Real devices keep their cache."""

    def begin_trial(self) -> None:
        """Start the counters ``memory_picture`` reports for one trial."""

    def memory_picture(self) -> dict:
        """What the device saw beyond the tracked peak since ``begin_trial``: on CUDA the
        reserved peak, the allocator's retries and NVML's used memory (empty elsewhere)."""
        return {}
