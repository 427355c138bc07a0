"""The ``Plan``: what the planner decided, as plain dataclasses (no torch devices needed).

The planner (issue 3) owns this module and may add fields; the training loop relies on:
``micro_batches``, ``accumulation_steps``, ``world_size``, ``effective_batch``, ``precision``,
``checkpointing``, ``lr``, ``clip_grad_norm`` and ``workload``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class LRDecision:
    rule: str
    """"linear", "sqrt" or "none"."""
    base_lr: float | None = None
    base_batch: int | None = None
    scale: float = 1.0
    lr: float | None = None
    """The learning rate to train with (None: left as the optimizer's own)."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps (0: none advised)."""
    note: str = ""


@dataclass(kw_only=True)
class WorkloadFingerprint:
    source: str
    file_sha256: str | None
    param_count: int
    param_bytes: int


@dataclass(kw_only=True)
class Plan:
    target_batch: int
    world_size: int
    micro_batches: list[int]
    """Samples per accumulation step on each rank; sum(micro_batches) * world_size == target_batch."""
    precision: str
    checkpointing: bool
    lr: LRDecision
    workload: WorkloadFingerprint
    clip_grad_norm: float | None = 1.0
    warnings: list[str] = field(default_factory=list)

    @property
    def accumulation_steps(self) -> int:
        return len(self.micro_batches)

    @property
    def micro_batch(self) -> int:
        return max(self.micro_batches)

    @property
    def per_device_batch(self) -> int:
        return sum(self.micro_batches)

    @property
    def effective_batch(self) -> int:
        return self.per_device_batch * self.world_size
