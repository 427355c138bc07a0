"""The ``Plan``: what the planner decided, as plain dataclasses (no torch devices needed).

The training loop relies on: ``micro_batches``, ``accumulation_steps``, ``world_size``,
``effective_batch``, ``precision``, ``checkpointing``, ``lr``, ``clip_grad_norm`` and ``workload``.
Everything else records how the decision was reached, so a saved plan can be audited and checked
against the workload and device it is used with (see ``autotune.planning.planfile``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..memory.base import DeviceInfo
from ..probing.result import ProbeResult
from ..sharding.settings import Sharding

SCHEMA_VERSION = 2
"""Version of the plan file layout; bump it when a field changes meaning or is removed.
Version 1 files (no sharding fields) still load: they were all replicated (DDP) plans."""

READABLE_SCHEMA_VERSIONS = (1, 2)


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
    optimizer: str | None = None
    """Class name of the optimizer ``build_optimizer`` returns (drives the "auto" LR rule)."""
    optimizer_lr: float | None = None
    """The optimizer's own learning rate (param group 0), kept when no base LR is given."""
    batchnorm: bool = False
    """Whether the model has BatchNorm layers (they see only the micro-batch)."""
    checkpointable: bool = True
    """Whether the model has repeated blocks that activation checkpointing can wrap."""


@dataclass(kw_only=True)
class SettingTried:
    """One precision/checkpointing setting the planner probed, and what it allowed."""

    precision: str
    checkpointing: bool
    probe: ProbeResult | None = None
    """None when nothing fitted (see ``error``)."""
    error: str | None = None
    """Why the probe found no micro-batch (the ProbeError message)."""
    allowed_micro_batch: int = 0
    """Largest micro-batch whose predicted peak stays within the budget minus the headroom."""
    sharding: Sharding = Sharding.DDP
    """How each rank held the model in this setting's probe (or estimate)."""
    shard_group: int | None = None
    """Ranks sharing one sharded copy (None for ddp)."""
    state_fits: bool = True
    """False when parameters, buffers and optimizer state alone passed the budget, which no
    checkpointing helps (a hint while planning; not written to plan files)."""

    def __post_init__(self):
        self.sharding = Sharding.parse(self.sharding, option="sharding")

    @property
    def raw_max_micro_batch(self) -> int:
        return self.probe.max_micro_batch if self.probe is not None else 0

    @property
    def layout(self) -> str:
        """"ddp", "fsdp" or, for hybrid sharding, "fsdp (groups of 2)"."""
        if self.sharding.sharded and self.shard_group is not None:
            return f"{self.sharding} (shard group {self.shard_group})"
        return str(self.sharding)

    def to_dict(self) -> dict:
        return {"precision": self.precision, "checkpointing": self.checkpointing,
                "probe": self.probe.to_dict() if self.probe is not None else None,
                "error": self.error, "allowed_micro_batch": self.allowed_micro_batch,
                "sharding": self.sharding.value, "shard_group": self.shard_group}

    @classmethod
    def from_dict(cls, data: dict) -> "SettingTried":
        data = dict(data)
        if data.get("probe") is not None:
            data["probe"] = ProbeResult.from_dict(data["probe"])
        return cls(**data)


class SplitArithmetic:
    """Numbers derived from a split; the class that mixes this in defines ``micro_batches``."""

    micro_batches: "list[int] | tuple[int, ...]"

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
    def is_even(self) -> bool:
        """Whether every accumulation step has the same micro-batch (what most runners need)."""
        return len(set(self.micro_batches)) == 1


@dataclass(kw_only=True)
class ConfigurationMeasured(SplitArithmetic):
    """One configuration the throughput search considered: measured, or pruned for memory."""

    precision: str
    checkpointing: bool
    micro_batches: list[int]
    """Samples per accumulation step on each rank (they sum to the per-device share)."""
    samples_per_s: float | None = None
    """From the fastest timed full window (all micro-steps and the optimizer step), or the median
    window when compared side by side (``compared``); None: not run."""
    peak_bytes: int | None = None
    """Measured peak of the warm-up window (None: not run)."""
    predicted_peak_bytes: int | None = None
    """The probe's memory model at the largest micro-batch, with DDP buckets."""
    fits: bool = True
    status: str = "measured"
    """"measured" or "pruned" (predicted not to fit, ran out of memory, or past the headroom)."""
    note: str = ""
    reused: bool = False
    """Measured by an earlier run of the same stored study, not re-measured."""
    compared: bool = False
    """Among the fastest, timed again side by side with the others (window by window); samples_per_s
    is then from that comparison, and the winner is the fastest of those compared."""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["micro_batches"] = list(self.micro_batches)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ConfigurationMeasured":
        return cls(**data)


@dataclass(kw_only=True)
class Plan(SplitArithmetic):
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
    schema_version: int = SCHEMA_VERSION
    versions: dict = field(default_factory=dict)
    """{"autotune": ..., "torch": ..., "cuda": ... or None}."""
    device: DeviceInfo | None = None
    headroom: float = 0.1
    """Fraction of the budget kept free (the safety margin)."""
    ddp_bucket_bytes: int = 0
    """Memory added to every prediction for DDP's gradient buckets (world size > 1)."""
    predicted_peak_bytes: int | None = None
    """Predicted (or measured) peak of the planned micro-batch, including ddp_bucket_bytes."""
    settings: list[SettingTried] = field(default_factory=list)
    reasons: dict = field(default_factory=dict)
    """Why each decision was made: {"precision": ..., "checkpointing": ..., "split": ..., ...}."""
    distributed: bool = False
    """Planned under torchrun, every rank probing (the ranks agreed on the smallest answer)."""
    created_at: str = ""
    """ISO 8601 time (UTC) the plan was made."""
    optimize: str = "memory"
    """"memory" (the largest micro-batch that fits) or "throughput" (the fastest measured)."""
    throughput: list[ConfigurationMeasured] = field(default_factory=list)
    """Every configuration the throughput search considered (empty for "memory")."""
    estimated: bool = False
    """Memory estimated on fake tensors for a GPU profile (``--gpu``), not measured on the device;
    ``autotune verify`` checks it there."""
    sharding: Sharding = Sharding.DDP
    """How each rank holds the model: a DDP replica, or FSDP2 shards (``autotune.sharding``)."""
    shard_group: int | None = None
    """Ranks that share one sharded copy (hybrid sharding replicates across groups); None for DDP
    plans, the world size for plain FSDP."""

    def __post_init__(self):
        self.sharding = Sharding.parse(self.sharding, option="sharding")

    @property
    def effective_batch(self) -> int:
        return self.per_device_batch * self.world_size

    @property
    def budget_bytes(self) -> int | None:
        return self.device.budget_bytes if self.device is not None else None

    @property
    def headroom_bytes(self) -> int | None:
        return int(self.budget_bytes * self.headroom) if self.device is not None else None

    @property
    def chosen_setting(self) -> SettingTried | None:
        for setting in self.settings:
            if (setting.precision == self.precision and setting.checkpointing == self.checkpointing
                    and setting.sharding == self.sharding
                    and (setting.shard_group == self.shard_group or not self.sharding.sharded)):
                return setting
        return None

    @property
    def raw_max_micro_batch(self) -> int | None:
        """What the probe of the chosen setting found, before the headroom."""
        chosen = self.chosen_setting
        return chosen.raw_max_micro_batch if chosen is not None else None

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["lr"] = asdict(self.lr)
        data["workload"] = asdict(self.workload)
        data["device"] = self.device.to_dict() if self.device is not None else None
        data["settings"] = [s.to_dict() for s in self.settings]
        data["throughput"] = [c.to_dict() for c in self.throughput]
        data["micro_batches"] = list(self.micro_batches)
        data["warnings"] = list(self.warnings)
        data["versions"] = dict(self.versions)
        data["reasons"] = dict(self.reasons)
        # Derived numbers, written for readers and other tools; ignored when read back.
        data["derived"] = {"accumulation_steps": self.accumulation_steps,
                           "micro_batch": self.micro_batch, "effective_batch": self.effective_batch,
                           "budget_bytes": self.budget_bytes, "headroom_bytes": self.headroom_bytes}
        return {"schema_version": data.pop("schema_version"), **data}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        data["lr"] = LRDecision(**data["lr"])
        data["workload"] = WorkloadFingerprint(**data["workload"])
        if data.get("device") is not None:
            data["device"] = DeviceInfo.from_dict(data["device"])
        data["settings"] = [SettingTried.from_dict(s) for s in data.get("settings", [])]
        data["throughput"] = [ConfigurationMeasured.from_dict(c) for c in data.get("throughput", [])]
        return cls(**data)
