"""The ``Plan``: what the planner decided, as plain dataclasses (no torch devices needed).

The training loop relies on: ``micro_batches``, ``accumulation_steps``, ``world_size``,
``effective_batch``, ``precision``, ``checkpointing``, ``lr``, ``clip_grad_norm`` and ``workload``.
Everything else records how the decision was reached, so a saved plan can be audited and checked
against the workload and device it is used with (see ``autotune.planning.planfile``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..memory.base import DeviceInfo
from ..precision import GradScalerSettings, Precision
from ..probing.result import ProbeResult, Trial, setting_label
from ..distributed.layout import Layout
from ..distributed.sharding.settings import Sharding
from ..timing.window import WindowTime
from ..units import format_bytes
from ..workload.checkpoint_count import Checkpointing

SCHEMA_VERSION = 3
"""Version of the plan file layout; bump it when a field changes meaning or is removed.
Version 1 files (no sharding fields) still load: they were all replicated (DDP) plans. Version 1
and 2 files write checkpointing as a bool beside ``checkpointed_blocks`` (None: every block);
version 3 writes one ``Checkpointing`` object, ``{"blocks": K, "total": N}``."""

READABLE_SCHEMA_VERSIONS = (1, 2, 3)

LISTED_STEPS = 64
"""Splits of up to this many accumulation steps are written as a list of sizes; longer ones as
``{"sizes": [...], "counts": [...]}`` (runs of equal sizes), so a plan file stays small."""


def split_runs(sizes) -> list[tuple[int, int]]:
    """``[13, 13, 13, 12]`` as ``[(13, 3), (12, 1)]``: consecutive equal sizes and their counts."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return [(size, count) for size, count in runs]


def encode_split(sizes) -> list[int] | dict:
    sizes = list(sizes)
    if len(sizes) <= LISTED_STEPS:
        return sizes
    runs = split_runs(sizes)
    return {"sizes": [s for s, _ in runs], "counts": [c for _, c in runs]}


def decode_split(value) -> list[int]:
    if isinstance(value, dict):
        return [size for size, count in zip(value["sizes"], value["counts"]) for _ in range(count)]
    return list(value)


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
    """Bytes of the trainable parameters (those with ``requires_grad``)."""
    trainable_param_count: int | None = None
    """Parameters that train (``requires_grad``); fewer than ``param_count`` with frozen ones
    (PEFT adapters on a frozen base). None: not recorded, older files."""
    optimizer: str | None = None
    """Class name of the optimizer ``build_optimizer`` returns (drives the "auto" LR rule)."""
    optimizer_lr: float | None = None
    """The optimizer's own learning rate (param group 0), kept when no base LR is given."""
    optimizer_settings: dict | None = None
    """The optimizer's other hyperparameters (param group 0: momentum, betas, eps, weight_decay,
    ...), for the exports to other runners (None: not recorded, older files)."""
    batchnorm: bool = False
    """Whether the model has BatchNorm layers (they see only the micro-batch)."""
    checkpointable: bool = True
    """Whether the model has repeated blocks that activation checkpointing can wrap, and can be
    trained with them recomputed."""
    checkpointing_refused: str | None = None
    """Why activation checkpointing cannot train a model that has blocks to wrap (peft's prefix
    tuning: ``activation_checkpointing.checkpointing_refusal``); None where it can, or where the
    model has no blocks (absent in older files)."""
    checkpointing_futile: str | None = None
    """Why checkpointing the model's blocks frees next to nothing (they are single layers:
    ``activation_checkpointing.checkpointing_futile``); None otherwise, and in older files."""
    repeated_blocks: int | None = None
    """How many repeated blocks checkpointing can wrap (None: not recorded, older files)."""
    has_dataset: bool | None = None
    """Whether the model file defines build_dataset() (None: not recorded, older files). Without
    one, ``autotune train`` trains make_batch's batches and needs --steps."""


@dataclass(kw_only=True)
class SettingTried:
    """One precision/checkpointing setting the planner probed, and what it allowed."""

    precision: Precision
    checkpointing: Checkpointing
    """Which repeated blocks were checkpointed (off, every one, or K of N)."""
    probe: ProbeResult | None = None
    """None when nothing fitted (see ``error``)."""
    error: str | None = None
    """Why the probe found no micro-batch (the ProbeError message)."""
    allowed_micro_batch: int = 0
    """Largest micro-batch whose predicted peak stays within the budget minus the headroom."""
    fewer_blocks_trial: Trial | None = None
    """The real trial at this setting's micro-batch with one checkpointed block fewer: the proof
    that fewer blocks do not do (None: not run)."""
    sharding: Sharding = Sharding.DDP
    """How each rank held the model in this setting's probe (or estimate)."""
    shard_group: int | None = None
    """Ranks sharing one sharded copy (None for ddp); data-parallel ranks under a ``parallel``
    layout."""
    parallel: Layout = Layout()
    """The tensor/context/pipeline split the probe ran (all 1: data parallel only)."""
    state_fits: bool = True
    """False when parameters, buffers and optimizer state alone passed the budget, which no
    checkpointing helps (a hint while planning; not written to plan files)."""
    only_micro_batch: int | None = None
    """Probed at this micro-batch alone (the one a checkpointed setting reached, which this one
    could at best tie), not below it (a hint while planning; not written to plan files)."""

    def __post_init__(self):
        self.precision = Precision.parse(self.precision, option="precision")
        self.sharding = Sharding.parse(self.sharding, option="sharding")
        if not isinstance(self.checkpointing, Checkpointing):
            self.checkpointing = Checkpointing.parse(
                self.checkpointing, total=self.probe.total_blocks if self.probe is not None else None,
                option="checkpointing")

    @property
    def raw_max_micro_batch(self) -> int:
        return self.probe.max_micro_batch if self.probe is not None else 0

    @property
    def blocks(self) -> int | None:
        """Checkpointed blocks: 0 when off, None for "every block" of an unknown count."""
        return self.checkpointing.count

    @property
    def checkpointing_label(self) -> str:
        """"off", "on" or "K of N blocks"."""
        return self.checkpointing.label

    @property
    def layout(self) -> str:
        """"ddp", "fsdp" or, for hybrid sharding, "fsdp (shard group 2)"; with a model-parallel
        split, "fsdp × tp 2"."""
        text = str(self.sharding)
        if self.sharding.sharded and self.shard_group is not None:
            text = f"{self.sharding} (shard group {self.shard_group})"
        if not self.parallel.trivial:
            text += f" × {self.parallel.describe_degrees()}"
        return text

    def to_dict(self) -> dict:
        return {"precision": self.precision, "checkpointing": self.checkpointing.to_dict(),
                "probe": self.probe.to_dict() if self.probe is not None else None,
                "error": self.error, "allowed_micro_batch": self.allowed_micro_batch,
                "fewer_blocks_trial": (asdict(self.fewer_blocks_trial)
                                       if self.fewer_blocks_trial is not None else None),
                "sharding": self.sharding.value, "shard_group": self.shard_group,
                "parallel": self.parallel.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "SettingTried":
        data = dict(data)
        data["parallel"] = Layout.from_dict(data.get("parallel"))
        if data.get("probe") is not None:
            data["probe"] = ProbeResult.from_dict(data["probe"])
        if data.get("fewer_blocks_trial") is not None:
            data["fewer_blocks_trial"] = Trial.from_dict(data["fewer_blocks_trial"])
        total = data["probe"].total_blocks if data.get("probe") is not None else None
        data["checkpointing"] = Checkpointing.from_file(data["checkpointing"],
                                                        data.pop("checkpointed_blocks", None), total)
        return cls(**data)


class SplitArithmetic:
    """Numbers derived from a split, and the one name of a configuration; the class that mixes
    this in defines ``micro_batches``, ``precision`` and ``checkpointing`` (a ``Checkpointing``)."""

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

    def label(self) -> str:
        """"bf16, checkpointing 3 of 4 blocks, 32 x 4" (uneven splits say so, with the per-device
        share)."""
        split = f"{self.micro_batch} x {self.accumulation_steps}"
        if not self.is_even:
            split += f" (uneven, {self.per_device_batch})"
        return f"{setting_label(self.precision, self.checkpointing.label)}, {split}"
    @property
    def split_text(self) -> str:
        """The per-rank split for people: "13 + 13 + 12", or runs ("13 × 400 + 12") past
        ``LISTED_STEPS`` steps (never millions of numbers)."""
        if len(self.micro_batches) <= LISTED_STEPS:
            return " + ".join(map(str, self.micro_batches))
        return " + ".join(f"{size} × {count}" if count > 1 else str(size)
                          for size, count in split_runs(self.micro_batches))


@dataclass(kw_only=True)
class ConfigurationMeasured(SplitArithmetic):
    """One configuration the throughput search considered: measured, or pruned for memory."""

    precision: Precision
    checkpointing: Checkpointing
    micro_batches: list[int]
    """Samples per accumulation step on each rank (they sum to the per-device share)."""
    samples_per_s: float | None = None
    """From the fastest timed full window (all micro-steps and the optimizer step), or the median
    window when compared side by side (``compared``); None: not run."""
    peak_bytes: int | None = None
    """Measured peak of the warm-up window (None: not run)."""
    predicted_peak_bytes: int | None = None
    """The probe's memory model at the largest micro-batch, with DDP buckets; the plan's own
    configuration: the plan's peak (its micro-batch measured where the model drew it)."""
    fits: bool = True
    status: str = "measured"
    """"measured", "pruned" (predicted not to fit, ran out of memory, or past the headroom) or
    "skipped" (not measured: its warm-up window alone would have ended past the budget)."""
    note: str = ""
    reused: bool = False
    """Measured by an earlier run of the same stored study, not re-measured."""
    warm_up_only: bool = False
    """samples_per_s is the warm-up window's: the budget left no timed window (slower than the
    configuration runs: the first window does one-time work)."""
    compared: bool = False
    """Among the fastest, timed again side by side with the others (window by window); samples_per_s
    is then from that comparison, and the winner is the fastest of those compared."""

    def __post_init__(self):
        self.precision = Precision.parse(self.precision, option="precision")
        self.checkpointing = Checkpointing.parse(self.checkpointing, option="checkpointing")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["micro_batches"] = list(self.micro_batches)
        return data

    @classmethod
    def from_dict(cls, data: dict, *, total_blocks: int | None = None) -> "ConfigurationMeasured":
        """``total_blocks``: the plan's, for older files' pair (a bool and checkpointed_blocks)."""
        data = dict(data)
        data["checkpointing"] = Checkpointing.from_file(data["checkpointing"],
                                                        data.pop("checkpointed_blocks", None), total_blocks)
        return cls(**data)


@dataclass(kw_only=True)
class ThroughputOutcome:
    """What the throughput search contributes to a plan (``build_plan(throughput=...)``)."""

    records: list[ConfigurationMeasured]
    """Every configuration considered, fastest first."""
    reason: str
    """Why the winner won (``tuning.search.why_fastest``)."""


@dataclass(kw_only=True)
class ConfigurationPredicted(SplitArithmetic):
    """One configuration ``--optimize throughput --gpu`` ranked by its predicted window time."""

    precision: Precision
    checkpointing: Checkpointing
    micro_batches: list[int]
    sharding: Sharding = Sharding.DDP
    shard_group: int | None = None
    parallel: Layout = Layout()
    step_time: WindowTime

    def __post_init__(self):
        self.precision = Precision.parse(self.precision, option="precision")
        self.checkpointing = Checkpointing.parse(self.checkpointing, option="checkpointing")
        self.sharding = Sharding.parse(self.sharding, option="sharding")

    @property
    def layout(self) -> str:
        """"ddp", "fsdp" or "fsdp (shard group 2)" (hybrid sharding)."""
        return SettingTried(precision=self.precision, checkpointing=self.checkpointing,
                            sharding=self.sharding, shard_group=self.shard_group,
                            parallel=self.parallel).layout

    @property
    def key(self) -> tuple:
        """The setting, whatever the split."""
        return (self.layout, self.precision, self.checkpointing.label)

    def label(self) -> str:
        return f"{self.layout}, {super().label()}"

    def to_dict(self) -> dict:
        return {"precision": self.precision, "checkpointing": self.checkpointing.to_dict(),
                "micro_batches": encode_split(self.micro_batches), "sharding": str(self.sharding),
                "shard_group": self.shard_group, "parallel": self.parallel.to_dict(),
                "step_time": self.step_time.to_dict()}

    @classmethod
    def from_dict(cls, data: dict, *, total_blocks: int | None = None) -> "ConfigurationPredicted":
        return cls(precision=data["precision"],
                   checkpointing=Checkpointing.from_file(data["checkpointing"], None, total_blocks),
                   micro_batches=decode_split(data["micro_batches"]), sharding=data.get("sharding", "ddp"),
                   shard_group=data.get("shard_group"), parallel=Layout.from_dict(data.get("parallel")),
                   step_time=WindowTime.from_dict(data["step_time"]))


@dataclass(kw_only=True)
class Plan(SplitArithmetic):
    target_batch: int
    world_size: int
    micro_batches: list[int]
    """Samples per accumulation step on each data-parallel rank;
    sum(micro_batches) * data_parallel == target_batch (data_parallel is world_size without a
    model-parallel ``parallel`` layout)."""
    precision: Precision
    checkpointing: Checkpointing
    """Which of the model's repeated blocks are checkpointed, spread evenly: off, every one, or K
    of N (truthy when any is)."""
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
    predicted_allocated_bytes: int | None = None
    """Where the peak is a CUDA estimate's modelled reserved memory: the tensors' peak of the
    planned window (with gradient sync on the last micro-step, of that window, not the probe's),
    including ddp_bucket_bytes. None for any other plan (and plans made before it was stated)."""
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
    reduce_every_micro_step: bool = False
    """FSDP2 only: reduce-scatter the gradients after every micro-step (they then accumulate
    sharded) instead of holding this rank's unsharded gradients until a window's last micro-step;
    for plans whose unsharded gradients would not fit. One reduce-scatter per micro-step."""
    step_time: WindowTime | None = None
    """The predicted time of one optimizer step on one GPU (``--gpu`` with ``--optimize
    throughput``): compute, exposed communication, bubble, rates and MFU. None: not predicted."""
    predicted: list[ConfigurationPredicted] = field(default_factory=list)
    """Every configuration ranked by predicted throughput, fastest first (empty unless ranked)."""
    grad_scaler: GradScalerSettings = field(default_factory=GradScalerSettings)
    """The fp16 GradScaler's knobs (init_scale, growth_factor, backoff_factor, growth_interval);
    recorded for every plan, used where the precision is fp16. Absent in older files: torch's
    defaults."""
    seq_len: int | None = None
    """Positions per sample every batch is made at (``make_batch(n, seq_len)``), probed and
    trained at; None: the model file's own batches."""
    target_tokens: int | None = None
    """Tokens per optimizer step asked for (``--target-tokens``): micro-batches × ``seq_len`` ×
    world size, exactly; None where a batch in samples was asked for."""
    eval_micro_batch: int | None = None
    """The largest evaluation micro-batch per rank: the forward alone under ``torch.no_grad``,
    model in ``eval()``, with the optimizer state alive, within the budget less the headroom
    (``reasons["eval"]`` says how it was proved); None: not planned (older files, or skipped)."""
    compile: bool = False
    """The training step runs torch.compile'd (``--compile``, or ``build_model()`` returns a
    compiled module): ``predicted_peak_bytes`` is the compiled step's, measured by compiled real
    trials, and ``autotune train`` trains compiled. Absent in older files: false."""
    compile_backend: str | None = None
    """The torch.compile backend ``--compile`` asked for (None: the model file compiles, or eager)."""
    parallel: Layout = Layout()
    """The tensor/context/pipeline split of the world (``autotune.Layout``; all 1, the default
    and what older files mean: data parallel only). Ranks of one data-parallel group see the same
    samples; with a pipeline, ``micro_batches`` are the pipeline's micro-batches."""

    def __post_init__(self):
        self.precision = Precision.parse(self.precision, option="precision")
        self.sharding = Sharding.parse(self.sharding, option="sharding")
        if not isinstance(self.checkpointing, Checkpointing):
            self.checkpointing = Checkpointing.parse(self.checkpointing, total=self.total_blocks,
                                                     option="checkpointing")
        if not isinstance(self.parallel, Layout):
            self.parallel = Layout.from_dict(self.parallel)
        self.parallel.check_world(self.world_size)

    def __repr__(self) -> str:
        split = " + ".join(map(str, self.micro_batches))
        peak = (f", peak {format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.budget_bytes)}"
                if self.predicted_peak_bytes is not None and self.device is not None else "")
        lr = f", lr {self.lr.lr:.4g}" if self.lr.lr is not None else ""
        ranks = (f"{self.world_size} rank(s)" if self.parallel.trivial else
                 f"{self.data_parallel} data-parallel rank(s) of {self.world_size}")
        return (f"Plan({split} × {ranks} = {self.effective_batch}, "
                f"{setting_label(self.precision, self.checkpointing_label)}{peak}{lr})")

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: the world size over tp × cp × pp."""
        return self.parallel.data_parallel(self.world_size)

    @property
    def effective_batch(self) -> int:
        return self.per_device_batch * self.data_parallel

    @property
    def budget_bytes(self) -> int | None:
        return self.device.budget_bytes if self.device is not None else None

    @property
    def tokens_per_step(self) -> int | None:
        """Positions per optimizer step over every rank (effective batch × ``seq_len``); None
        without a planned sequence length."""
        return self.effective_batch * self.seq_len if self.seq_len is not None else None

    @property
    def total_blocks(self) -> int | None:
        """The model's repeated blocks (None: not recorded)."""
        return self.workload.repeated_blocks

    @property
    def blocks(self) -> int | None:
        """Checkpointed blocks: 0 when off, None for "every block" of an unknown count."""
        return self.checkpointing.count

    @property
    def checkpointed_blocks(self) -> int | None:
        """How many of the model's repeated blocks are checkpointed (as ``blocks``)."""
        return self.checkpointing.count

    @property
    def checkpointing_label(self) -> str:
        """"off", "on" or "K of N blocks"."""
        return self.checkpointing.label

    @property
    def headroom_bytes(self) -> int | None:
        return int(self.budget_bytes * self.headroom) if self.device is not None else None

    @property
    def chosen_setting(self) -> SettingTried | None:
        for setting in self.settings:
            if (setting.precision == self.precision
                    and (setting.checkpointing == self.checkpointing
                         or (self.checkpointing and setting.blocks is None))
                    and setting.sharding == self.sharding
                    and setting.parallel == self.parallel
                    and (setting.shard_group == self.shard_group or not self.sharding.sharded)):
                return setting
        return None

    @property
    def chosen_layout(self) -> str:
        """"ddp", "fsdp" or "fsdp (shard group 2)", as ``SettingTried.layout``."""
        return SettingTried(precision=self.precision, checkpointing=self.checkpointing,
                            sharding=self.sharding, shard_group=self.shard_group,
                            parallel=self.parallel).layout

    @property
    def planned_trial(self):
        """The chosen setting's fitting trial at the planned micro-batch, where the probe (or the
        planner's own check) ran one (its window reduce-scattered every micro-step)."""
        setting = self.chosen_setting
        return setting.probe.trial_at(self.micro_batch) if setting and setting.probe else None

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
        data["step_time"] = self.step_time.to_dict() if self.step_time is not None else None
        data["predicted"] = [c.to_dict() for c in self.predicted]
        data["micro_batches"] = encode_split(self.micro_batches)
        data["warnings"] = list(self.warnings)
        data["versions"] = dict(self.versions)
        data["reasons"] = dict(self.reasons)
        data["grad_scaler"] = self.grad_scaler.to_dict()
        data["checkpointing"] = self.checkpointing.to_dict()
        data["parallel"] = self.parallel.to_dict()
        # Derived numbers, written for readers and other tools; ignored when read back.
        data["derived"] = {"accumulation_steps": self.accumulation_steps, "tokens_per_step": self.tokens_per_step,
                           "micro_batch": self.micro_batch, "effective_batch": self.effective_batch,
                           "budget_bytes": self.budget_bytes, "headroom_bytes": self.headroom_bytes,
                           "checkpointed_blocks": self.blocks, "total_blocks": self.total_blocks,
                           "data_parallel": self.data_parallel}
        return {"schema_version": data.pop("schema_version"), **data}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        blocks = data.get("checkpointed_blocks")  # schema 1 and 2: beside a bool checkpointing
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        data["micro_batches"] = decode_split(data["micro_batches"])
        data["lr"] = LRDecision(**data["lr"])
        data["workload"] = WorkloadFingerprint(**data["workload"])
        if data.get("device") is not None:
            data["device"] = DeviceInfo.from_dict(data["device"])
        data["settings"] = [SettingTried.from_dict(s) for s in data.get("settings", [])]
        total = data["workload"].repeated_blocks
        data["checkpointing"] = Checkpointing.from_file(data["checkpointing"], blocks, total)
        data["throughput"] = [ConfigurationMeasured.from_dict(c, total_blocks=total)
                              for c in data.get("throughput", [])]
        if data.get("grad_scaler") is not None:
            data["grad_scaler"] = GradScalerSettings.from_dict(data["grad_scaler"])
        if data.get("step_time") is not None:
            data["step_time"] = WindowTime.from_dict(data["step_time"])
        data["predicted"] = [ConfigurationPredicted.from_dict(c, total_blocks=total)
                             for c in data.get("predicted", [])]
        data["parallel"] = Layout.from_dict(data.get("parallel"))
        return cls(**data)
