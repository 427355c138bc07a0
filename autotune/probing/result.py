"""What a probe found: plain dataclasses that round-trip through JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..memory.base import DeviceInfo
from ..precision import Precision
from ..units import format_bytes
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest, describe_blocks


def setting_label(precision, checkpointing) -> str:
    """How every report names a setting: "bf16, checkpointing on" (``checkpointing``: a
    ``Checkpointing``, a bool, a block count, "on"/"off", or a label such as "3 of 4 blocks")."""
    if isinstance(checkpointing, (Checkpointing, CheckpointingRequest)):
        checkpointing = checkpointing.label
    elif isinstance(checkpointing, bool) or checkpointing is None:
        checkpointing = "on" if checkpointing else "off"
    elif isinstance(checkpointing, int):
        checkpointing = describe_blocks(checkpointing, None)
    return f"{precision}, checkpointing {checkpointing}"


@dataclass(kw_only=True)
class Trial:
    """One steady-state training step at ``micro_batch`` samples."""

    micro_batch: int
    fits: bool
    peak_bytes: int
    """Peak of the step; for a step that ran out of memory, the usage when it failed (a lower bound)."""
    seconds: float
    activation_peak_bytes: int | None = None
    """Peak while building the batch, forward and backward."""
    step_peak_bytes: int | None = None
    """Peak during unscale, clip, optimizer.step and zero_grad."""
    baseline_bytes: int | None = None
    """Live before the step: parameters, buffers, optimizer state."""
    gradient_bytes: int | None = None
    """Bytes of the trainable parameters' gradients (all live at the end of backward)."""
    reserved_peak_bytes: int | None = None
    """CUDA: the caching allocator's reserved peak (``peak_bytes`` is what tensors held). A CUDA
    estimate (fake tensors, e.g. ``--gpu``): the modelled allocator's, and ``peak_bytes`` is it."""
    allocated_peak_bytes: int | None = None
    """A CUDA estimate: the tensors' own peak (``peak_bytes`` is the modelled reserved peak, what
    runs out on CUDA)."""
    alloc_retries: int | None = None
    """CUDA: cudaMalloc retries after freeing the cache during the trial (fragmentation)."""
    host_peak_bytes: int | None = None
    """fsdp-offload estimate: the host memory the rank's offloaded shards, sharded gradients,
    optimizer state and optimizer step need at most (``peak_bytes`` is the device's)."""
    nvml_used_bytes: int | None = None
    """CUDA: the device's used memory as NVML sees it after the trial (context and other
    processes included)."""
    micro_steps: list[int] | None = None
    """A window trial's micro-batches in the order they ran (the first one's gradients alive
    in the others, then one optimizer phase); None: one step. A window trial's
    ``baseline_bytes`` is what was live before its measured micro-steps, gradients included."""
    held_gradient_bytes: int | None = None
    """A window trial: the gradient bytes the first micro-step left alive for the others (this
    rank's local gradients; FSDP2's unsharded ones with sync off, sharded ones when it
    reduce-scatters every micro-step)."""
    past_limit: int | None = None
    """An estimate's trial ruled out by its tensors alone passing this limit (the caller's: a
    plan's budget less its headroom) before its last small build, where the budget itself may
    hold it: ``fits`` is False and ``peak_bytes`` the tensors' peak, a lower bound of the
    reserved peak (``FewBlocksSession._tensor_floor``); or a pipeline's trial stopped at the
    first rank past it (``WorstPipelineRankSession``: that rank's peak, a lower bound of the
    worst rank's). None: the trial ran to its answer."""
    first_in_session: bool | None = None
    """A CUDA estimate's trial that ran on a build and modelled allocator of its own, as a run's
    first step does (``TensorFloorSession``); None: its session's history is its place in the
    probe's trials."""

    @property
    def verdict(self) -> str:
        """"fits", "out of memory", or "past the limit" (``past_limit``)."""
        return "fits" if self.fits else "out of memory" if self.past_limit is None else "past the limit"

    @property
    def budgeted_peak_bytes(self) -> int:
        """The peak a budget is held against: the reserved peak where the trial has one (CUDA),
        else the tensors'."""
        return self.reserved_peak_bytes or self.peak_bytes

    @property
    def window(self) -> bool:
        """Whether this trial measured an accumulation window rather than one step."""
        return bool(self.micro_steps) and len(self.micro_steps) > 1

    @classmethod
    def from_dict(cls, data: dict) -> "Trial":
        return cls(**data)


@dataclass(kw_only=True)
class MemoryModel:
    """Predicted peak of a step at n samples: max(activation(n), step(n)).

    activation(n) = a + b·n + c·n² and step(n) = d + e·n, fitted to the trials that fit.
    """

    activation: tuple[float, float, float] = (0.0, 0.0, 0.0)
    step: tuple[float, float] = (0.0, 0.0)
    kind: str = "linear"
    """"linear" or "quadratic" (the activation term)."""
    points: int = 0
    """How many fitting trials the model was fitted to."""

    def predict(self, n: float) -> float:
        a, b, c = self.activation
        d, e = self.step
        return max(a + b * n + c * n * n, d + e * n)

    def largest_within(self, budget: float, *, limit: int = 1 << 40) -> int | None:
        """The largest n ≥ 0 whose predicted peak is ≤ budget (None where it grows without bound)."""
        bounds = [_largest_root(self.activation, budget), _largest_root((*self.step, 0.0), budget)]
        finite = [b for b in bounds if b is not None]
        if not finite:
            return None
        return int(max(0, min(min(finite), limit)))

    def to_dict(self) -> dict:
        return {"activation": list(self.activation), "step": list(self.step), "kind": self.kind,
                "points": self.points}

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryModel":
        return cls(activation=tuple(data["activation"]), step=tuple(data["step"]), kind=data["kind"],
                   points=data.get("points", 0))


@dataclass(kw_only=True)
class BlockModel:
    """What checkpointing K of the model's N repeated blocks does to the activation peak at n
    samples, learned from steps on fake tensors at K = 0, 1 and N.

    Each checkpointed block keeps only its input, saving ``saving(n) = s0 + s1·n`` bytes.
    The blocks are spread evenly from the first, so only K = N includes the last block, whose
    forward is rerun at the start of backward while the rest is still held: that costs
    ``last_block(n) = r0 + r1·n`` back.
    """

    total_blocks: int
    saving: tuple[float, float] = (0.0, 0.0)
    last_block: tuple[float, float] = (0.0, 0.0)

    def activation_change(self, n: float, blocks: int) -> float:
        """Bytes the activation peak changes by (negative: saved) with ``blocks`` checkpointed."""
        change = -blocks * (self.saving[0] + self.saving[1] * n)
        if blocks >= self.total_blocks:
            change += self.last_block[0] + self.last_block[1] * n
        return change

    def for_blocks(self, model: MemoryModel, blocks: int, *, fitted_at: int = 0) -> MemoryModel:
        """``model``, fitted with ``fitted_at`` blocks checkpointed, moved to ``blocks`` blocks."""
        def change(n):
            return self.activation_change(n, blocks) - self.activation_change(n, fitted_at)

        a, b, c = model.activation
        return MemoryModel(activation=(a + change(0), b + change(1) - change(0), c), step=model.step,
                           kind=model.kind, points=model.points)

    def to_dict(self) -> dict:
        return {"total_blocks": self.total_blocks, "saving": list(self.saving),
                "last_block": list(self.last_block)}

    @classmethod
    def from_dict(cls, data: dict) -> "BlockModel":
        return cls(total_blocks=data["total_blocks"], saving=tuple(data["saving"]),
                   last_block=tuple(data["last_block"]))


def _largest_root(coeffs, budget) -> float | None:
    """Largest n with a + b·n + c·n² ≤ budget, for n ≥ 0 (None: unbounded)."""
    a, b, c = coeffs
    if c > 0:
        disc = b * b - 4 * c * (a - budget)
        if disc < 0:
            return -1.0
        return math.floor((-b + math.sqrt(disc)) / (2 * c) + 1e-9)
    if b > 0:
        return math.floor((budget - a) / b + 1e-9)
    return None if a <= budget else -1.0


UNESTIMATED = "no estimate, so real trials only"
"""How ``ProbeResult.notes`` begins the note of a probe the estimate could not seed."""


@dataclass(kw_only=True)
class ProbeResult:
    """The exact largest micro-batch that fits, and how it was found."""

    max_micro_batch: int
    upper_bound: int | None
    """The largest micro-batch the probe was asked to consider (None: unbounded)."""
    capped: bool
    """True when max_micro_batch equals the upper bound: more might fit, but none was needed."""
    trials: list[Trial]
    memory_model: MemoryModel
    device: DeviceInfo
    precision: Precision
    checkpointing: Checkpointing
    """Which repeated blocks were checkpointed (off, every one, or K of ``total_blocks``)."""
    seconds: float
    total_blocks: int | None = None
    """How many repeated blocks the model has (None: not recorded)."""
    block_model: BlockModel | None = None
    """What checkpointing K blocks would change (learned on fake tensors when the planner needed
    it; None otherwise)."""
    oom_count: int = 0
    notes: list[str] = field(default_factory=list)
    estimate_steps: int = 0
    """Steps run on fake tensors to find where to start (not in ``trials``, which are all real,
    except on the estimate backend itself, where ``notes`` says every trial was estimated)."""
    estimated_max_micro_batch: int | None = None
    """What the estimate said the answer was (None: the probe did not use one)."""
    share: int | None = None
    """The samples per rank and optimizer step the probe planned for: trials below it measured
    accumulation windows, and ``memory_model`` was fitted to them (None: every trial is one
    step, as in files written before windows were measured)."""
    compiled: bool = False
    """The real trials ran the torch.compile'd step (``--compile``, or build_model compiled)."""
    compile_backend: str | None = None
    """The backend ``compile=`` asked for (None: build_model compiled the model, or eager)."""
    graphs_compiled: int | None = None
    """Compiled trials: the graphs torch.compile compiled over all of them (one per graph break,
    and one more for every recompilation; a new micro-batch compiles none, except that torch
    specialises micro-batch 1). None: not compiled."""

    def __post_init__(self):
        self.precision = Precision.parse(self.precision, option="precision")
        if not isinstance(self.checkpointing, Checkpointing):
            self.checkpointing = Checkpointing.parse(self.checkpointing, total=self.total_blocks,
                                                     option="checkpointing")

    @property
    def budget_bytes(self) -> int:
        return self.device.budget_bytes

    def __repr__(self) -> str:
        capped = ", capped" if self.capped else ""
        return (f"ProbeResult(max_micro_batch={self.max_micro_batch}{capped}, "
                f"{setting_label(self.precision, self.checkpointing_label)}, {self.steps} trials, "
                f"budget {format_bytes(self.budget_bytes)})")

    @property
    def checkpointing_label(self) -> str:
        """"off", "on" or "K of N blocks"."""
        return self.checkpointing.label

    @property
    def checkpointed_blocks(self) -> int | None:
        """How many repeated blocks were checkpointed (0: off; None: every one of a count not
        recorded)."""
        return self.checkpointing.count

    @property
    def steps(self) -> int:
        """Training steps executed (one forward pass each)."""
        return len(self.trials)

    @property
    def unestimated(self) -> str | None:
        """The note saying why the fake-tensor estimate could not seed this probe (None: it did,
        or was not asked to)."""
        return next((n for n in self.notes if n.startswith(UNESTIMATED)), None)

    def windowed(self, micro_batch: int) -> bool:
        """Whether a plan whose largest micro-batch is ``micro_batch`` accumulates (micro-batches
        below the share), so that its peak is a window's. A pipeline's probe ran windows only
        (its schedule's micro-batches, at least pp): every plan of it is one."""
        if self.trials and all(t.window for t in self.trials):
            return True
        return self.share is not None and micro_batch < self.share

    def peak_at(self, micro_batch: int) -> int | None:
        """Measured peak at ``micro_batch`` when a fitting trial of the kind a plan at that
        micro-batch runs (a window below the share, else one step) ran there."""
        trial = self.trial_at(micro_batch)
        return trial.peak_bytes if trial is not None else None

    def trial_at(self, micro_batch: int) -> Trial | None:
        """The fitting trial of that kind at ``micro_batch`` (see ``peak_at``), if one ran."""
        window = self.windowed(micro_batch)
        return next((t for t in self.trials
                     if t.micro_batch == micro_batch and t.fits and t.window == window), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["memory_model"] = self.memory_model.to_dict()
        data["device"] = self.device.to_dict()
        data["block_model"] = self.block_model.to_dict() if self.block_model is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ProbeResult":
        data = dict(data)
        data["checkpointing"] = Checkpointing.from_file(data["checkpointing"],
                                                        data.pop("checkpointed_blocks", None),
                                                        data.get("total_blocks"))
        data["trials"] = [Trial.from_dict(t) for t in data["trials"]]
        data["memory_model"] = MemoryModel.from_dict(data["memory_model"])
        data["device"] = DeviceInfo.from_dict(data["device"])
        if data.get("block_model") is not None:
            data["block_model"] = BlockModel.from_dict(data["block_model"])
        return cls(**data)
