"""The planner: pure functions from probe results and a request to a ``Plan`` (no torch devices).

The split policy: a target batch is first divided over the world size (exactly, or an error that
names the nearest targets that divide). Each rank's share is then cut into the fewest
accumulation steps whose micro-batch keeps the predicted peak within the budget minus the
headroom; the micro-batches are as even as possible (they differ by at most one sample), so they
always sum exactly to the share: 127 with at most 50 per step is 43 + 42 + 42.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError, PlanError, given, option
from .lr import decide_lr, lr_warnings
from ..distributed.layout import Layout
from ..memory.base import DeviceInfo
from ..precision import GradScalerSettings, Precision
from .types import Plan, SettingTried, ThroughputOutcome, WorkloadFingerprint
from ..probing.result import BlockModel, ProbeResult, setting_label
from ..units import format_bytes
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest

BATCHNORM_MIN_MICRO_BATCH = 16
"""Below this, BatchNorm statistics over one micro-batch are noisy enough to hurt training."""

MAX_BATCH = 2**24
"""Largest target batch (samples per optimizer step) accepted: 16.7 million, far past any batch
a training recipe uses; a larger number is a typo, and would only make huge plans."""

MAX_WORLD_SIZE = 2**20

MAX_QUIET_ACCUMULATION = 32
"""More accumulation steps than this are worth a warning (slow, and often a sign of a misfit)."""


@dataclass(kw_only=True)
class PlanRequest:
    """What the user asked for, with every "auto"/default already resolved except checkpointing."""

    target_batch: int
    world_size: int = 1
    precision: Precision = Precision.FP32
    precision_reason: str = ""
    checkpointing: CheckpointingRequest = CheckpointingRequest("auto")
    """"auto", "on", "off" or a count K of the model's repeated blocks (a fraction resolved on the
    model); any form ``CheckpointingRequest.parse`` takes."""
    headroom: float = 0.1
    micro_batch: int | None = None
    """A pinned micro-batch (None: the planner chooses)."""
    lr_rule: str = "auto"
    base_lr: float | None = None
    base_batch: int | None = None
    dataset_size: int | None = None
    distributed: bool = False
    """Planned under torchrun with every rank probing."""
    grad_scaler: GradScalerSettings = field(default_factory=GradScalerSettings)
    """The fp16 GradScaler's knobs, recorded in the plan."""
    even: bool = False
    """Every micro-batch the same size, for runners that take one (HF Trainer, DeepSpeed, ...)."""
    sharding: str = "ddp"
    """"auto" or a ``Sharding`` value: what the user asked for (the reason quotes it)."""
    parallel: Layout = Layout()
    """The tensor/context/pipeline split asked for (all 1: data parallel only); the target
    divides over its data-parallel ranks."""

    def __post_init__(self):
        self.precision = Precision.parse(self.precision)
        _check_positive_int(self.target_batch, "target_batch", MAX_BATCH)
        _check_positive_int(self.world_size, "world_size", MAX_WORLD_SIZE)
        self.parallel.check_world(self.world_size)
        if self.micro_batch is not None:
            _check_positive_int(self.micro_batch, "micro_batch")
        if not (isinstance(self.headroom, (int, float)) and 0 <= self.headroom < 1):
            raise ConfigError(f"{given('headroom', self.headroom)} must be a fraction in [0, 1), e.g. 0.1 "
                              f"for 10%")
        if self.base_lr is not None and not (isinstance(self.base_lr, (int, float))
                                             and math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ConfigError(f"{given('base_lr', self.base_lr)} must be a finite number more than 0, "
                              f"e.g. {given('base_lr', 3e-4)}")
        self.checkpointing = CheckpointingRequest.parse(self.checkpointing)
        if self.micro_batch is not None:
            split_pinned(self.share, self.micro_batch)  # raises when it exceeds the share

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples (the world size without model parallelism)."""
        return self.parallel.data_parallel(self.world_size)

    @property
    def share(self) -> int:
        if self.parallel.trivial:
            return per_device_share(self.target_batch, self.world_size)
        return per_device_share(self.target_batch, self.data_parallel,
                                ranks=f"the {self.data_parallel} data-parallel rank(s) of "
                                      f"{given('world_size', self.world_size)} under "
                                      f"{self.parallel.describe_degrees()}")

    @property
    def wanted_micro_batch(self) -> int:
        """The largest micro-batch worth probing for: the pinned one, else the whole share; a
        pipeline's share over pp micro-batches, the fewest its schedule runs (a trial at the share
        would run pp micro-batches of it: pp times the samples a plan takes)."""
        if self.micro_batch is not None:
            return self.micro_batch
        return max(1, self.share // self.parallel.pp)


def _check_positive_int(value, name: str, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option(name)} must be a positive int, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{given(name, value)} is more than {maximum}, the largest autotune plans for; "
                          f"check the number")


# --- the split -----------------------------------------------------------------------------------

def per_device_share(target_batch: int, world_size: int, *, ranks: str | None = None) -> int:
    """Samples each (data-parallel) rank contributes per optimizer step; the target must divide
    exactly. ``ranks``: how the message names the ranks (default: the world size)."""
    if target_batch % world_size:
        lower = target_batch - target_batch % world_size
        upper = lower + world_size
        options = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise PlanError(f"{given('target_batch', target_batch)} is not divisible by "
                        f"{ranks or given('world_size', world_size)}; "
                        f"use {options} (every rank must take the same number of samples per step)")
    return target_batch // world_size


def even_split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal non-negative sizes, smallest first."""
    base, extra = divmod(total, parts)
    return [base] * (parts - extra) + [base + 1] * extra


def split_share(share: int, max_micro_batch: int) -> list[int]:
    """The fewest micro-batches of at most ``max_micro_batch`` that sum to ``share``, as even as
    possible (larger ones first)."""
    if max_micro_batch < 1:
        raise PlanError(f"cannot split {share} samples into micro-batches of at most {max_micro_batch}")
    return even_split(share, math.ceil(share / max_micro_batch))[::-1]


def largest_divisor_at_most(share: int, limit: int) -> int:
    """The largest micro-batch of at most ``limit`` that divides ``share`` (1 always does)."""
    return next(d for d in range(min(limit, share), 0, -1) if share % d == 0)


def split_evenly(share: int, max_micro_batch: int) -> list[int]:
    """The fewest equal micro-batches of at most ``max_micro_batch`` that sum to ``share``."""
    if max_micro_batch < 1:
        raise PlanError(f"cannot split {share} samples into micro-batches of at most {max_micro_batch}")
    micro = largest_divisor_at_most(share, max_micro_batch)
    return [micro] * (share // micro)


def split_pinned(share: int, micro_batch: int) -> list[int]:
    """Micro-batches of exactly ``micro_batch``, the last one taking the remainder."""
    if micro_batch > share:
        raise PlanError(f"{given('micro_batch', micro_batch)} is larger than the per-device share {share} of "
                        f"the target batch; use {given('micro_batch', share)} or less")
    full, rest = divmod(share, micro_batch)
    return [micro_batch] * full + ([rest] if rest else [])


# --- memory ----------------------------------------------------------------------------------------

def predicted_peak(probe: ProbeResult, micro_batch: int, extra_bytes: int = 0) -> float:
    """The peak of an optimizer step whose largest micro-batch is ``micro_batch``: one step at
    the probe's share, an accumulation window below it (``ProbeResult.windowed``). Measured where
    a fitting trial of that kind ran there, otherwise the memory model's prediction, never below
    a measured peak of the same kind at a smaller micro-batch.

    The memory model is the window trials' where there are any. Where the probe ran none (one
    step at the share fitted), a window is predicted as one step plus the gradients held
    through it, which bounds it from above (at any moment a window's micro-step holds what one
    step holds, with every gradient instead of those computed so far: AccumulateGrad adds each
    new gradient, which one step would keep, in place)."""
    measured = probe.peak_at(micro_batch)
    if measured is not None:
        return measured + extra_bytes
    window = probe.windowed(micro_batch)
    same = [t for t in probe.trials if t.fits and t.window == window]
    below = [t.peak_bytes for t in same if t.micro_batch < micro_batch]
    model = probe.memory_model.predict(micro_batch)
    if window and not any(t.window for t in probe.trials):
        model += _held_gradients_bound(probe)
    return max([model, *below]) + extra_bytes


def _held_gradients_bound(probe: ProbeResult) -> int:
    return max((t.gradient_bytes or 0 for t in probe.trials), default=0)


def usable_bytes(budget_bytes: int, headroom: float) -> int:
    return int(budget_bytes * (1 - headroom))


def allowed_micro_batch(probe: ProbeResult, usable: int, extra_bytes: int = 0) -> int:
    """Largest micro-batch, up to what the probe proved fits, predicted to stay within ``usable``."""
    for n in range(probe.max_micro_batch, 0, -1):
        if predicted_peak(probe, n, extra_bytes) <= usable:
            return n
    return 0


def evaluate_setting(setting: SettingTried, *, usable: int, extra_bytes: int,
                     agree: Callable[[int], int] | None = None) -> SettingTried:
    """Fill in ``setting.allowed_micro_batch``. ``agree`` combines the answer across ranks (the
    minimum under torchrun); every rank must call this for the same settings in the same order."""
    allowed = allowed_micro_batch(setting.probe, usable, extra_bytes) if setting.probe else 0
    setting.allowed_micro_batch = agree(allowed) if agree is not None else allowed
    return setting


def ddp_bucket_bytes(world_size: int, param_bytes: int) -> int:
    # DDP copies gradients into flat all-reduce buckets about as large as the gradients.
    return param_bytes if world_size > 1 else 0


def setting_extra_bytes(setting: SettingTried, world_size: int, param_bytes: int) -> int:
    """Memory a setting's probe did not see: DDP's buckets (a sharded step counted its own
    reduce-scatter buffers)."""
    return 0 if setting.sharding.sharded else ddp_bucket_bytes(world_size, param_bytes)


# --- decisions -------------------------------------------------------------------------------------

def choose_precision(requested: str, *, device_kind: str, bf16_supported: bool) -> tuple[Precision, str]:
    """Resolve "auto": bf16 where supported, fp16 with GradScaler on CUDA without bf16, else fp32.

    On the CPU "auto" starts at fp32: bf16 autocast trained 10x slower there (T5: 11 against 123
    samples/s) on a CPU that reports avx512_bf16; ``cpu_precision`` takes bf16 only where it buys
    fewer accumulation steps.
    """
    if requested != "auto":
        chosen = Precision.parse(requested)
        return chosen, f"{chosen} as requested"
    if device_kind == "cpu":
        return Precision.FP32, (f"auto: fp32 on the CPU, where bf16 autocast is usually much slower"
                                f"{'' if bf16_supported else ' (and this CPU lacks bf16)'}")
    if bf16_supported:
        return Precision.BF16, f"auto: the {device_kind} device supports bf16 (no loss scaling needed)"
    if device_kind == "cuda":
        return Precision.FP16, "auto: this CUDA device lacks bf16, so fp16 autocast with a GradScaler"
    return Precision.FP32, f"auto: the {device_kind} device supports neither bf16 nor fp16 training well"


def cpu_precision(fp32_steps: int | None, bf16_steps: int | None, *,
                  bf16_short_of: int | None = None) -> tuple[str, str]:
    """Under "auto" on the CPU: fp32 unless bf16 plans fewer accumulation steps (None: the
    precision does not fit at all), and why. ``bf16_short_of``: bf16 was not searched, only
    tried at the micro-batch one step fewer than fp32's needs, where it did not fit."""
    slow = "bf16 autocast is usually much slower on the CPU"
    no_fewer = f"auto: fp32 on the CPU ({slow}, and bf16 buys no fewer than fp32's {fp32_steps} accumulation steps"
    if bf16_short_of is not None:
        return "fp32", (f"{no_fewer}: in bf16, micro-batch {bf16_short_of} ({fp32_steps - 1} "
                        f"step{'s' if fp32_steps > 2 else ''}) does not fit the budget less headroom)")
    if bf16_steps is not None and (fp32_steps is None or bf16_steps < fp32_steps):
        fp32_text = "does not fit" if fp32_steps is None else f"needs {fp32_steps} accumulation steps"
        return "bf16", (f"auto: bf16, although {slow}, because fp32 {fp32_text} and bf16 needs "
                        f"{bf16_steps}; compare speeds with --optimize throughput")
    if bf16_steps is None and fp32_steps is not None and fp32_steps > 1:
        return "fp32", f"auto: fp32 on the CPU ({slow}, and bf16 fits no better)"
    if bf16_steps is not None:
        return "fp32", f"{no_fewer})"
    return "fp32", f"auto: fp32 on the CPU ({slow}; fp32 needs no accumulation)"


def checkpointing_worth_probing(off: SettingTried, request: PlanRequest,
                                workload: WorkloadFingerprint, *, upper: int | None = None) -> bool:
    """Under "auto": probe with checkpointing only where it might buy what the plan needs (up to
    ``upper`` samples per micro-batch; default: the share or the pinned micro-batch)."""
    if (not request.checkpointing.auto or not workload.checkpointable or not off.state_fits
            or workload.checkpointing_futile):
        return False
    if request.even and request.micro_batch is None:
        return largest_divisor_at_most(request.share, off.allowed_micro_batch) < request.share
    return off.allowed_micro_batch < (upper or request.wanted_micro_batch)


def sharding_worth_estimating(settings: list[SettingTried], request: PlanRequest) -> bool:
    """Under "auto": estimate sharded layouts only where replicas leave steps to save."""
    if request.sharding != "auto" or request.data_parallel == 1:
        return False
    return max((s.allowed_micro_batch for s in settings), default=0) < request.wanted_micro_batch


def predicted_group_peak(probe: ProbeResult, micro_batch: int, *, world_size: int, group: int) -> float:
    """One rank's peak on shard groups of ``group`` ranks, predicted from a probe on groups of
    ``world_size``: what a rank holds of the sharded state grows by world_size / group (the
    parameters and optimizer state of the steps' baseline everywhere, the sharded gradients in
    the optimizer step too); gathered blocks and activations do not depend on the group. A guess
    for where to look, never a proof."""
    last = probe.trials[-1] if probe.trials else None
    base = (last.baseline_bytes or 0) if last else 0
    grads = (last.gradient_bytes or 0) if last else 0
    more = world_size / group - 1
    (a, b, c), (d, e) = probe.memory_model.activation, probe.memory_model.step
    n = micro_batch
    return max(a + b * n + c * n * n + base * more, d + e * n + (base + grads) * more)


def predicted_group_max(probe: ProbeResult | None, *, world_size: int, group: int,
                        upper: int) -> int | None:
    """The largest micro-batch up to ``upper`` predicted to fit the probe's budget on shard
    groups of ``group`` (0: not even 1); None without a probe to predict from."""
    if probe is None or probe.max_micro_batch < 1:
        return None
    return next((n for n in range(upper, 0, -1)
                 if predicted_group_peak(probe, n, world_size=world_size, group=group)
                 <= probe.budget_bytes), 0)


def first_shard_group(settings: list[SettingTried], groups: list[int], *, micro_batch: int,
                      usable: int, world_size: int) -> int:
    """Index into ``groups`` (ascending, all smaller than the world) of the smallest group
    predicted to reach ``micro_batch`` within ``usable`` from ``settings`` probed on the whole
    world (the largest group where none is)."""
    probes = [s.probe for s in settings if s.probe is not None and s.allowed_micro_batch >= micro_batch]
    for i, group in enumerate(groups):
        if any(predicted_group_peak(p, micro_batch, world_size=world_size, group=group) <= usable
               for p in probes):
            return i
    return len(groups) - 1


def micro_batch_for_steps(request: PlanRequest, steps: int) -> int:
    """The micro-batch that takes the share in ``steps``, no larger than the request wants: where
    a smaller shard group is probed (at the whole world's fewest steps), and where CPU auto
    precision asks whether bf16 reaches one step fewer than fp32."""
    return min(request.wanted_micro_batch, math.ceil(request.share / steps))


def fewest_steps(settings: list[SettingTried], request: PlanRequest) -> int | None:
    """The fewest accumulation steps any of ``settings`` allows (None: none fits)."""
    splits = [split_for(s.allowed_micro_batch, request) for s in settings]
    return min((len(split) for split in splits if split is not None), default=None)


def split_for(allowed: int, request: PlanRequest) -> list[int] | None:
    """The split a setting that allows ``allowed`` gives (None: none fits the request)."""
    if request.micro_batch is not None:
        return split_pinned(request.share, request.micro_batch) if allowed >= request.micro_batch else None
    if allowed < 1:
        return None
    if request.parallel.pp > 1:
        # A pipeline's window is one schedule run: at least pp micro-batches, all of one shape.
        allowed = min(allowed, request.share // request.parallel.pp)
        return split_evenly(request.share, allowed) if allowed >= 1 else None
    return split_evenly(request.share, allowed) if request.even else split_share(request.share, allowed)


def predicted_blocks(probe: ProbeResult, model: BlockModel, micro_batch: int, usable: int,
                     extra_bytes: int = 0) -> int | None:
    """The fewest checkpointed blocks predicted to keep ``micro_batch`` within ``usable``, from
    ``probe``'s memory model moved by the per-block saving (None: not even every block)."""
    fitted_at = probe.checkpointed_blocks or 0
    for blocks in range(model.total_blocks + 1):
        peak = model.for_blocks(probe.memory_model, blocks, fitted_at=fitted_at).predict(micro_batch)
        if peak + extra_bytes <= usable:
            return blocks
    return None


def settings_below_fewest(fewest: SettingTried, fewer: list[SettingTried], *, usable: int,
                          extra_bytes: int = 0) -> list[SettingTried]:
    """For the throughput search: each K below the fewest blocks ``fewest`` proved whose
    micro-batch, predicted from the per-block saving, is larger than any setting with fewer
    blocks (``fewer``, and the smaller K) allows. Such a K buys fewer steps than those at less
    recomputation than ``fewest``; Ks above ``fewest`` buy no fewer steps than it, only more
    recomputation. Predictions only: the search measures each configuration's real peak."""
    probe = fewest.probe
    model = probe.block_model if probe is not None else None
    if model is None or not fewest.blocks:
        return []
    found, best = [], max((s.allowed_micro_batch for s in fewer), default=0)
    for blocks in range(1, fewest.blocks):
        memory_model = model.for_blocks(probe.memory_model, blocks, fitted_at=fewest.blocks)
        setting = SettingTried(
            precision=fewest.precision, checkpointing=Checkpointing.of(blocks, model.total_blocks),
            sharding=fewest.sharding, shard_group=fewest.shard_group,
            probe=dataclasses.replace(
                probe, trials=[], memory_model=memory_model,
                checkpointing=Checkpointing.of(blocks, model.total_blocks), oom_count=0,
                notes=[f"{Checkpointing.of(blocks, model.total_blocks).label}: predicted from the per-block "
                       f"saving learned on fake tensors, for the throughput search to measure"]))
        setting.allowed_micro_batch = allowed_micro_batch(setting.probe, usable, extra_bytes)
        if setting.allowed_micro_batch > best:
            found.append(setting)
            best = setting.allowed_micro_batch
    return found


def _blocks_key(setting: SettingTried) -> float:
    blocks = setting.blocks
    return math.inf if blocks is None else blocks


def _choose_setting(settings: list[SettingTried], request: PlanRequest,
                    workload: WorkloadFingerprint) -> tuple[SettingTried, list[int], str, str]:
    """The setting to train with, its split, and why (checkpointing, sharding).

    Settings are grouped by sharding layout in the order they were probed (ddp, then fsdp on
    growing shard groups): each layout chooses its checkpointing, then the layout with the fewest
    accumulation steps wins, the earliest (least communication) among equals.
    """
    layouts: dict = {}
    for s in settings:
        layouts.setdefault((s.sharding, s.shard_group), []).append(s)
    chosen = []
    for group in layouts.values():
        try:
            chosen.append(_choose_checkpointing(group, request, workload))
        except PlanError:
            continue
    if not chosen:
        raise PlanError(_nothing_fits_message(settings, request, workload))
    best = min(range(len(chosen)), key=lambda i: (len(chosen[i][1]), i))
    setting, split, why = chosen[best]
    return setting, split, why, _sharding_reason(setting, split, chosen, layouts, request)


def _sharding_reason(setting: SettingTried, split: list[int], chosen: list, layouts: dict,
                     request: PlanRequest) -> str:
    if request.sharding != "auto":
        return f"{setting.layout} as requested"
    if not request.parallel.trivial:
        return (f"auto: fsdp over the {request.data_parallel} data-parallel rank(s); model-parallel "
                f"layouts hold their data-parallel copies with FSDP2 "
                f"({request.parallel.describe(request.world_size, 'FSDP')})")
    if len(layouts) == 1:
        if request.world_size == 1:
            return "auto: ddp; one rank has nothing to shard over"
        return (f"auto: ddp; a replica already fits the share in {len(split)} accumulation "
                f"step(s), so sharding would only add communication")
    replicated = next((c for c in chosen if not c[0].sharding.sharded), None)
    if setting.sharding.offload:
        on_device = [c for c in chosen if c[0].sharding.sharded and not c[0].sharding.offload]
        why = (f"it cuts accumulation steps from {min(len(c[1]) for c in on_device)} (fsdp) to "
               f"{len(split)}" if on_device else "nothing fits sharded (fsdp) with the shards on the device")
        return (f"auto: {setting.layout}, because {why}: parameter shards, gradients and optimizer "
                f"state live in host memory, and the optimizer steps on the CPU")
    if setting.sharding.sharded:
        if replicated is None:
            why = "nothing fits replicated (ddp) on one rank"
        else:
            why = f"it cuts accumulation steps from {len(replicated[1])} (ddp) to {len(split)}"
        tried = sorted({s.shard_group for (sh, _), group in layouts.items() if sh.sharded
                        for s in group if s.shard_group is not None})
        return (f"auto: {setting.layout}, because {why}; the smallest shard group that reaches "
                f"{len(split)} step(s) among those tried ({', '.join(map(str, tried))}); "
                f"fsdp-offload is tried only where nothing fits on the device (it copies every "
                f"shard to the device in each forward and backward and steps the optimizer on "
                f"the CPU, which fewer accumulation steps rarely pay for; --sharding fsdp-offload "
                f"plans it)")
    return (f"auto: ddp; sharding was estimated and needs as many accumulation steps "
            f"({len(split)}), with more communication")


def _choose_checkpointing(settings: list[SettingTried], request: PlanRequest,
                          workload: WorkloadFingerprint) -> tuple[SettingTried, list[int], str]:
    """The checkpointing setting of one sharding layout, its split, and why: the fewest
    accumulation steps, then the fewest checkpointed blocks."""
    splits = [(s, split_for(s.allowed_micro_batch, request)) for s in settings]
    usable = [(s, split) for s, split in splits if split is not None]
    if not usable:
        raise PlanError(_nothing_fits_message(settings, request, workload))
    off = next(((s, sp) for s, sp in splits if not s.checkpointing), None)
    checkpointed = [(s, sp) for s, sp in usable if s.checkpointing]
    if not checkpointed:
        setting, split = usable[0]
        on = next(((s, sp) for s, sp in splits if s.checkpointing), None)
        return setting, split, _why_single(setting, request, workload, on)
    if off is None:
        setting, split = min(checkpointed, key=lambda p: (len(p[1]), _blocks_key(p[0])))
        return setting, split, f"{setting.checkpointing_label} as requested"
    best, split = min(checkpointed, key=lambda p: (len(p[1]), _blocks_key(p[0])))
    if off[1] is not None and len(off[1]) <= len(split):
        return off[0], off[1], (f"auto: off; checkpointing was probed but keeps {len(split)} "
                                f"accumulation steps either way, and it costs ~20-35% more step time")
    if off[1] is None:
        only = off[0].only_micro_batch
        need = (f"the pinned micro-batch {request.micro_batch}" if request.micro_batch
                else f"micro-batch {only} within the budget minus the headroom (the one checkpointing "
                     f"reaches; smaller ones take more accumulation steps and were not tried)"
                if only is not None and only > 1
                else "even micro-batch 1 within the budget minus the headroom")
        without = f"without it {need} does not fit"
        why = f"auto: {best.checkpointing_label}, because {without}"
    else:
        without = f"without it: {len(off[1])} steps"
        why = (f"auto: {best.checkpointing_label}, because it cuts accumulation steps from {len(off[1])} "
               f"to {len(split)}")
    proof = _fewest_blocks_reason(best, split, request)
    if proof:
        why = f"auto: {proof[0]} ({without}); {proof[1]}"
    elif (request.checkpointing.auto and (workload.repeated_blocks or 0) > 1
          and best.blocks == workload.repeated_blocks):
        why += _fewest_not_searched(best, request, workload.repeated_blocks)
    if off[1] is not None and workload.batchnorm and min(off[1]) < BATCHNORM_MIN_MICRO_BATCH <= min(split):
        why += (f" and lifts the BatchNorm micro-batch from {min(off[1])} to {min(split)} "
                f"(>= {BATCHNORM_MIN_MICRO_BATCH})")
    return best, split, why + " (at ~20-35% more step time)"


def _fewest_not_searched(setting: SettingTried, request: PlanRequest, total: int) -> str:
    """Why every block, unproved, where the fewest blocks are not searched."""
    if request.distributed:
        where = ("under torchrun, where each rank would prove them with trials of its own: plan "
                 "without torchrun (the plan is the same on identical devices) to search them")
    elif setting.sharding.sharded:
        where = f"for a sharded layout ({setting.layout}): not supported yet"
    else:
        return ""
    return f"; fewer blocks were not searched {where}, or pass --checkpointing K (K of {total})"


def _fewest_blocks_reason(setting: SettingTried, split: list[int],
                          request: PlanRequest) -> tuple[str, str] | None:
    """What the blocks reach, and why no fewer (the real trial with one block fewer)."""
    fewer, probe = setting.fewer_blocks_trial, setting.probe
    if fewer is None or probe is None or setting.blocks is None or probe.total_blocks is None:
        return None
    blocks, total = setting.blocks, probe.total_blocks
    steps = "one step" if len(split) == 1 else f"{len(split)} steps"
    usable = format_bytes(usable_bytes(probe.budget_bytes, request.headroom))
    found = (f"held at least {format_bytes(fewer.peak_bytes)} of tensors, past the {usable} the "
             f"headroom leaves" if fewer.past_limit is not None else
             "ran out of memory" if not fewer.fits else
             f"peaked at {format_bytes(fewer.peak_bytes)}, past the {usable} the headroom leaves")
    reach = f"checkpointing {blocks} of {total} blocks reaches micro-batch {max(split)} in {steps}"
    needed = f"all {total} were not needed" if blocks < total else f"all {total} are needed"
    return reach, f"{needed}: a trial with {blocks - 1} {found}"


def _why_single(setting, request, workload, on) -> str:
    if request.checkpointing.value == "on":
        return "on as requested"
    if request.checkpointing.value == "off":
        return "off as requested"
    if not request.checkpointing.auto:
        return f"{setting.checkpointing_label} as requested"
    if workload.checkpointing_refused:
        return f"auto: off; {workload.checkpointing_refused}"
    if not workload.checkpointable:
        return "auto: off; the model has no repeated blocks (ModuleList/Sequential) to checkpoint"
    if workload.checkpointing_futile and on is None and setting.allowed_micro_batch < request.wanted_micro_batch:
        return f"auto: off, not probed: {workload.checkpointing_futile}"
    if on is not None:
        return "auto: off; checkpointing was probed and allowed no larger micro-batch"
    return (f"auto: off; micro-batch {setting.allowed_micro_batch} already fits without it, "
            f"so it would buy nothing")


def _nothing_fits_message(settings: list[SettingTried], request: PlanRequest,
                          workload: WorkloadFingerprint) -> str:
    parts = []
    buckets_counted = False
    for s in settings:
        label = setting_label(s.precision, s.checkpointing_label)
        if s.sharding.sharded:
            label += f", {s.layout}"
        if s.probe is None:
            parts.append(f"{label}: {s.error}")
        elif request.micro_batch is not None and s.allowed_micro_batch < request.micro_batch:
            parts.append(f"{label}: --micro-batch {request.micro_batch} does not fit; at most "
                         f"{s.allowed_micro_batch} fits within the budget minus --headroom "
                         f"{request.headroom:g} (the probe's raw maximum is {s.raw_max_micro_batch})")
        else:
            # The comparison that failed is the one evaluate_setting made: the probe's peak plus
            # what it could not see (DDP's gradient buckets on more than one rank).
            extra = setting_extra_bytes(s, request.world_size, workload.param_bytes)
            buckets_counted = buckets_counted or extra > 0
            peak = predicted_peak(s.probe, 1)
            plus = f" plus {format_bytes(extra)} of DDP gradient buckets" if extra else ""
            parts.append(f"{label}: micro-batch 1 fits the budget but not the budget minus "
                         f"--headroom {request.headroom:g} (peak {format_bytes(peak)}{plus} against "
                         f"{format_bytes(s.probe.budget_bytes * (1 - request.headroom))}); "
                         f"lower --headroom or give it more memory")
    head = (f"--micro-batch {request.micro_batch} cannot be planned" if request.micro_batch is not None
            else f"no micro-batch fits for --target-batch {request.target_batch}")
    fix = (" Use a smaller --micro-batch (or none, to let autotune choose)."
           if request.micro_batch is not None else "")
    if buckets_counted and request.sharding == "ddp":
        fix += (f" A replica does not fit on one of {request.world_size} ranks; --sharding auto "
                f"(or fsdp) shards the model instead.")
    return f"{head}. " + "; ".join(parts) + "." + fix


def _split_reason(split: list[int], request: PlanRequest, allowed: int) -> str:
    share = request.share
    shape = (f"{split[0]} × {len(split)}" if len(set(split)) == 1
             else f"{' + '.join(map(str, split))} (uneven: {share} has no even split into "
                  f"{len(split)} steps of at most {max(split)})")
    if request.micro_batch is not None:
        source = f"--micro-batch {request.micro_batch} pinned; it fits (at most {allowed} would)"
    elif request.even:
        source = (f"--even: the fewest equal micro-batches of at most {allowed} (the fewest "
                  f"uneven ones would be {len(split_share(share, allowed))})")
    else:
        source = f"the fewest accumulation steps whose micro-batch is at most {allowed}"
    ranks = (f"{request.world_size} rank(s)" if request.parallel.trivial else
             f"{request.data_parallel} data-parallel rank(s) of {request.world_size}")
    return (f"{request.target_batch} = {ranks} × {share}; {share} = {shape}; "
            f"{source}")


def plan_warnings(plan: Plan, request: PlanRequest) -> list[str]:
    found = []
    smallest = min(plan.micro_batches)
    if plan.workload.batchnorm and smallest < BATCHNORM_MIN_MICRO_BATCH:
        found.append(f"the model has BatchNorm and its micro-batch is {smallest} (< "
                     f"{BATCHNORM_MIN_MICRO_BATCH}): statistics over so few samples are noisy; "
                     f"consider SyncBatchNorm (across ranks) or GroupNorm")
    if plan.accumulation_steps > MAX_QUIET_ACCUMULATION:
        found.append(f"{plan.accumulation_steps} accumulation steps (> {MAX_QUIET_ACCUMULATION}): "
                     f"each optimizer step runs {plan.accumulation_steps} forward/backward passes; "
                     f"consider bf16, checkpointing, a smaller --target-batch or more devices")
    if plan.world_size > 1 and not request.distributed:
        found.append(f"--world-size {plan.world_size} was planned from one process: every rank is "
                     f"assumed to match this device and its free memory; run the plan under torchrun "
                     f"to probe each rank")
    found += lr_warnings(plan.lr, plan.target_batch)
    found += allocator_warnings(plan.chosen_setting)
    return found


RESERVED_OVER_ALLOCATED = 1.25
"""CUDA: a reserved peak this many times the allocated peak is a fragmented cache."""


def allocator_warnings(setting: SettingTried | None) -> list[str]:
    """CUDA's caching allocator reserving well above what tensors use, or retrying cudaMalloc, in
    the probe of the planned setting: a step that fits by its tensors can still fail there."""
    if setting is None or setting.probe is None:
        return []
    found = []
    fitting = [t for t in setting.probe.trials if t.fits and t.reserved_peak_bytes is not None]
    worst = max(fitting, key=lambda t: t.reserved_peak_bytes / max(t.peak_bytes, 1), default=None)
    if worst is not None and worst.reserved_peak_bytes > RESERVED_OVER_ALLOCATED * worst.peak_bytes:
        found.append(
            f"at micro-batch {worst.micro_batch} torch reserved {format_bytes(worst.reserved_peak_bytes)} "
            f"for {format_bytes(worst.peak_bytes)} of tensors ({worst.reserved_peak_bytes / max(worst.peak_bytes, 1):.2f}x): "
            f"the caching allocator is fragmented and may fail where the tensors would fit; set "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or plan with more --headroom")
    retries = sum(t.alloc_retries or 0 for t in setting.probe.trials)
    if retries:
        found.append(
            f"the allocator retried cudaMalloc {retries} time(s) during the probe (it freed its cache "
            f"to find room, which is slow and a sign of fragmentation); set "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or plan with more --headroom")
    return found


@dataclass(kw_only=True)
class SyncOnLast:
    """A sharded plan's window estimated with this rank's unsharded gradients held until the last
    micro-step (the probe reduce-scattered every micro-step): the planner's other option."""

    micro_batch: int
    """The largest micro-batch of the split it was estimated for."""
    steps: int
    """The accumulation steps it was estimated for."""
    peak_bytes: int | None
    """The window's peak (None: it ran out of memory, or passed ``at_least_bytes``)."""
    at_least_bytes: int | None = None
    """Where its tensors alone passed the budget less the headroom, what they held (the estimate
    stopped there: ``Trial.past_limit``)."""
    held_gradient_bytes: int | None = None
    """The unsharded gradients held between micro-steps."""
    allocated_peak_bytes: int | None = None
    """For a CUDA estimate (peak_bytes is modelled reserved memory): the tensors' peak."""


def held_gradient_bytes(probe: ProbeResult | None) -> int | None:
    """The gradients a probe's window trials held between micro-steps (None: no window ran)."""
    held = [t.held_gradient_bytes for t in (probe.trials if probe else []) if t.held_gradient_bytes]
    return max(held) if held else None


def build_plan(
    request: PlanRequest,
    *,
    workload: WorkloadFingerprint,
    settings: list[SettingTried],
    device: DeviceInfo,
    versions: dict | None = None,
    created_at: str = "",
    considered: list[SettingTried] | None = None,
    throughput: ThroughputOutcome | None = None,
    estimated_for: str | None = None,
    sync_on_last: SyncOnLast | None = None,
) -> Plan:
    """The plan, from settings whose ``allowed_micro_batch`` ``evaluate_setting`` filled in.

    This is the one place a ``Plan`` is made. ``considered``: every setting probed, recorded in
    the plan when ``settings`` is only the one the throughput search chose. ``throughput``: the
    search's records and reason (the plan is then "optimize: throughput"). ``estimated_for``: the
    GPU profile whose memory was estimated on fake tensors rather than measured.
    ``sync_on_last``: for a sharded plan with accumulation, its window estimated holding the
    unsharded gradients until the last micro-step; the plan takes it (less communication) where
    it fits the budget less the headroom, else reduce-scatters every micro-step as probed.
    """
    if not settings:
        raise PlanError("no setting was probed; nothing to plan from")
    setting, split, checkpoint_reason, sharding_reason = _choose_setting(settings, request, workload)
    if throughput is not None:
        how = "predicted" if estimated_for is not None else "measured"
        checkpoint_reason = f"{setting.checkpointing_label}: the fastest {how} (see throughput)"
    extra = setting_extra_bytes(setting, request.world_size, workload.param_bytes)
    peak = int(predicted_peak(setting.probe, max(split), extra))
    reduce_every, peak, sync_reason = _gradient_sync(setting, split, peak, sync_on_last,
                                                     usable_bytes(device.budget_bytes, request.headroom),
                                                     extra)
    lr = decide_lr(rule=request.lr_rule, target_batch=request.target_batch, base_lr=request.base_lr,
                   base_batch=request.base_batch, optimizer=workload.optimizer,
                   optimizer_lr=workload.optimizer_lr, dataset_size=request.dataset_size)
    reasons = {
        "precision": request.precision_reason or f"{setting.precision} as requested",
        "checkpointing": checkpoint_reason,
        "sharding": sharding_reason,
        "split": _split_reason(split, request, setting.allowed_micro_batch),
        "memory": (_memory_reason(setting, device, request.headroom, extra, request.world_size)
                   + _gradient_memory(setting, split, reduce_every, sync_on_last)),
        "lr": lr.note,
    }
    if sync_reason:
        reasons["gradient_sync"] = sync_reason
    compiled = setting.probe is not None and setting.probe.compiled
    if compiled:
        reasons["compile"] = compile_reason(setting.probe)
    if estimated_for is not None:
        reasons["memory"] += f"; peaks estimated on fake tensors for the {estimated_for} (nothing allocated)"
    if throughput is not None:
        reasons["throughput"] = throughput.reason
    plan = Plan(
        target_batch=request.target_batch, world_size=request.world_size, micro_batches=split,
        precision=setting.precision, checkpointing=setting.checkpointing, lr=lr, workload=workload,
        versions=dict(versions or {}), device=device, headroom=request.headroom,
        ddp_bucket_bytes=extra,
        predicted_peak_bytes=peak, reduce_every_micro_step=reduce_every,
        predicted_allocated_bytes=_allocated_bytes(setting, split, reduce_every, sync_on_last, extra),
        settings=list(considered if considered is not None else settings), reasons=reasons,
        distributed=request.distributed, created_at=created_at,
        optimize="throughput" if throughput is not None else "memory",
        throughput=list(throughput.records) if throughput is not None else [],
        estimated=estimated_for is not None,
        grad_scaler=request.grad_scaler, sharding=setting.sharding,
        shard_group=setting.shard_group if setting.sharding.sharded else None,
        parallel=setting.parallel,
        compile=compiled, compile_backend=setting.probe.compile_backend if compiled else None,
    )
    if plan.effective_batch != request.target_batch:  # a bug here would silently change training
        raise PlanError(f"internal error: planned {split} × {request.data_parallel} = "
                        f"{plan.effective_batch}, not --target-batch {request.target_batch}")
    plan.warnings = plan_warnings(plan, request)
    if estimated_for is not None:
        plan.warnings.append(f"estimated for the {estimated_for} without the device: check it there "
                             f"with autotune verify PLAN.json before a long run")
    return plan


def compile_reason(probe) -> str:
    """Why a compiled plan's peak is what it says (``reasons["compile"]``)."""
    how = (f"torch.compile backend {probe.compile_backend}" if probe.compile_backend
           else "build_model() returns a torch.compile'd module")
    seed = ("; the fake-tensor estimate ran the eager step (a compiled graph cannot run on fake "
            "tensors) and only chose where the real trials started" if probe.estimate_steps else "")
    graphs = (f" that compiled {probe.graphs_compiled} graph(s) in all"
              if probe.graphs_compiled is not None else "")
    return (f"the training step is compiled ({how}): the peak is the compiled step's, measured "
            f"by compiled real trials{graphs} (batch sizes dynamic){seed}; autotune train trains "
            f"compiled")


def _allocated_bytes(setting: SettingTried, split: list[int], reduce_every: bool,
                     on_last: SyncOnLast | None, extra: int) -> int | None:
    """The planned window's tensor peak where its peak is modelled reserved memory (see
    ``Plan.predicted_allocated_bytes``)."""
    if setting.sharding.sharded and len(split) >= 2 and not reduce_every:
        allocated = on_last.allocated_peak_bytes if on_last is not None else None
    else:
        trial = setting.probe.trial_at(max(split)) if setting.probe is not None else None
        allocated = trial.allocated_peak_bytes if trial is not None else None
    return allocated + extra if allocated is not None else None


def _gradient_sync(setting: SettingTried, split: list[int], peak: int, on_last: SyncOnLast | None,
                   usable: int, extra: int) -> tuple[bool, int, str]:
    """(reduce every micro-step, the plan's peak, why) for a sharded plan with accumulation.

    The probe measured windows that reduce-scatter every micro-step (sharded gradients held,
    one reduce-scatter per micro-step); syncing only on the last micro-step communicates
    ``len(split)`` times less but holds this rank's unsharded gradients through the window. The
    plan syncs on the last where that window fits the budget less the headroom."""
    if not setting.sharding.sharded or len(split) < 2:
        return False, peak, ""
    steps = len(split)
    every = (f"reduce-scattering every micro-step ({steps} reduce-scatters per optimizer step) "
             f"peaks at {format_bytes(peak)}")
    sharded = held_gradient_bytes(setting.probe)
    if sharded:
        every += f", holding {format_bytes(sharded)} of sharded gradients"
    if on_last is None or on_last.micro_batch != max(split) or on_last.steps != steps:
        return True, peak, (f"every micro-step: {every}; holding the unsharded gradients until "
                            f"the last micro-step was not estimated")
    held = (f" ({format_bytes(on_last.held_gradient_bytes)} of unsharded gradients)"
            if on_last.held_gradient_bytes else "")
    if on_last.peak_bytes is not None and on_last.peak_bytes + extra <= usable:
        last = on_last.peak_bytes + extra
        return False, last, (f"last micro-step only: holding this rank's unsharded gradients through "
                             f"the window{held} peaks at {format_bytes(last)}, within the "
                             f"{format_bytes(usable)} the headroom leaves, with one reduce-scatter "
                             f"per optimizer step instead of {steps}; {every}")
    past = (f"holds at least {format_bytes(on_last.at_least_bytes + extra)} of tensors, past the "
            f"{format_bytes(usable)} the headroom leaves" if on_last.at_least_bytes is not None else
            "runs out of memory" if on_last.peak_bytes is None else
            f"peaks at {format_bytes(on_last.peak_bytes + extra)}, past the {format_bytes(usable)} "
            f"the headroom leaves")
    return True, peak, (f"every micro-step: holding this rank's unsharded gradients until the last "
                        f"micro-step{held} {past}; {every}")


def _gradient_memory(setting: SettingTried, split: list[int], reduce_every: bool,
                     on_last: SyncOnLast | None) -> str:
    """What the plan's accumulation holds between micro-steps, for the memory reason."""
    if len(split) < 2:
        return "; one micro-step per optimizer step, so no gradients are held between micro-steps"
    if setting.sharding.sharded and not reduce_every and on_last is not None:
        held, what = on_last.held_gradient_bytes, "this rank's unsharded gradients (synced on the last micro-step)"
    elif setting.sharding.sharded:
        held, what = held_gradient_bytes(setting.probe), "this rank's sharded gradients (reduce-scattered every micro-step)"
    else:
        held, what = held_gradient_bytes(setting.probe), "the replica's gradients"
    if not held:
        return f"; the peak is a window's, with {what} held between its {len(split)} micro-steps"
    return (f"; the peak is a window's: {format_bytes(held)} of {what} stay allocated between its "
            f"{len(split)} micro-steps, counted in it")


def _memory_reason(setting: SettingTried, device: DeviceInfo, headroom: float, extra: int,
                   world_size: int = 1) -> str:
    budget = device.budget_bytes
    text = (f"budget {format_bytes(budget)} ({device.budget_source}) minus headroom {headroom:.0%} "
            f"({format_bytes(budget * headroom)}) leaves {format_bytes(usable_bytes(budget, headroom))}; "
            f"the probe's raw maximum is {setting.raw_max_micro_batch}, and "
            f"{setting.allowed_micro_batch} is predicted to stay within the margin")
    if extra:
        text += f" (counting {format_bytes(extra)} of DDP gradient buckets)"
    if setting.probe is not None and setting.probe.unestimated:
        text += f"; {setting.probe.unestimated}"  # e.g. an optimizer that reads values in its step
    if setting.sharding.offload:
        host = max((t.host_peak_bytes or 0 for t in setting.probe.trials), default=0) if setting.probe else 0
        text += (f"; peaks are the device's, one rank's of {world_size} under {setting.layout} "
                 f"(gathered blocks, uploaded shards and reduce-scatter buffers counted); each rank "
                 f"also needs {format_bytes(host)} of host memory for its shards, gradients, "
                 f"optimizer state and optimizer step" if host else
                 f"; peaks are the device's, one rank's of {world_size} under {setting.layout}")
    elif setting.sharding.sharded:
        text += (f"; peaks are one rank's of {world_size} under {setting.layout} (shards, gathered "
                 f"blocks and reduce-scatter buffers counted)")
    return text


__all__ = [
    "BATCHNORM_MIN_MICRO_BATCH", "MAX_QUIET_ACCUMULATION", "PlanRequest", "allowed_micro_batch",
    "allocator_warnings", "build_plan", "checkpointing_worth_probing", "choose_precision",
    "cpu_precision", "ddp_bucket_bytes", "evaluate_setting", "fewest_steps", "held_gradient_bytes",
    "SyncOnLast",
    "largest_divisor_at_most", "per_device_share", "plan_warnings", "predicted_blocks",
    "predicted_peak", "setting_extra_bytes", "sharding_worth_estimating", "split_evenly",
    "split_for", "split_pinned",
    "split_share", "usable_bytes",
]
