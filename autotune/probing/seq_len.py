"""The longest sequence that fits: the probe's search over the sequence length at one micro-batch.

A model file with ``make_batch(batch_size, seq_len)`` makes the sequence length a dimension to
probe like the micro-batch: each trial is the same steady-state training step (optimizer state
allocated, forward, backward, unscale, clip, step), at a fixed micro-batch and a length of
``k * seq_multiple`` positions. The search is the micro-batch search itself
(``search_largest_fitting``) over k: it fits a memory model (quadratic where attention is), is
seeded by the same search on fake tensors where the model runs on them, and proves its answer
with a step that fits at k and one that does not at k + 1 (or k is the model's limit), so it is
exact whatever shape memory has in the length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from .. import progress
from ..errors import ConfigError, EstimateUnavailable, ProbeError, given, option
from ..memory import MemoryBackend, backend_for
from ..memory.base import DeviceInfo
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits, on_fake_tensors
from ..precision import Precision
from ..units import format_bytes
from ..workload.checkpoint_count import CheckpointingRequest
from ..workload.contract import Workload, load_workload
from .result import Trial, setting_label
from .search import GROWTH_LIMIT, search_largest_fitting
from .trial import SetupOutOfMemory, TrialSession

POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")
"""Model (or ``model.config``) attributes that bound the sequence length a model accepts."""


@dataclass(kw_only=True)
class SeqLenTrial:
    """One training step at ``micro_batch`` samples of ``seq_len`` positions."""

    seq_len: int
    fits: bool
    peak_bytes: int
    seconds: float


@dataclass(kw_only=True)
class SeqLenResult:
    """The longest sequence (a multiple of ``seq_multiple``) whose training step fits at
    ``micro_batch``, and how it was found."""

    max_seq_len: int
    """0 when not even ``seq_multiple`` positions fit."""
    micro_batch: int
    seq_multiple: int
    upper_bound: int | None
    """The longest length considered: the model's position limit or the caller's (None: none)."""
    capped: bool
    """``max_seq_len`` is the upper bound: longer might fit, but the model takes no more."""
    trials: list[SeqLenTrial]
    """The real steps, in the order they ran."""
    device: DeviceInfo
    precision: str
    checkpointing: str
    seconds: float
    estimate_steps: int = 0
    """Steps run on fake tensors to find where to start (not in ``trials``)."""
    estimated_max_seq_len: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def budget_bytes(self) -> int:
        return self.device.budget_bytes

    @property
    def tokens(self) -> int:
        """Positions per micro-batch at the answer."""
        return self.micro_batch * self.max_seq_len

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["device"] = self.device.to_dict()
        return data


def probe_seq_len(workload, *, micro_batch: int = 1, seq_multiple: int = 1,
                  max_seq_len: int | None = None, device=None, precision="fp32",
                  checkpointing=False, memory_limit=None, backend: MemoryBackend | None = None,
                  use_estimate: bool = True, accumulation: bool = False) -> SeqLenResult:
    """Find the exact longest sequence length whose full steady-state training step fits at
    ``micro_batch`` samples, among the multiples of ``seq_multiple`` (8 or 64 suit tensor cores
    and flash attention's tiles).

    ``workload`` needs ``make_batch(batch_size, seq_len)``. The search stops at ``max_seq_len``
    or, without it, at the model's own position limit (``config.max_position_embeddings`` or
    ``n_positions``, read from the model the trials build), where longer inputs would be
    an error rather than out of memory. ``device``, ``precision``, ``checkpointing``,
    ``memory_limit``, ``backend`` and ``use_estimate`` as for ``probe``. ``accumulation``: each
    trial measures an accumulation window's micro-step (the gradients of the window's first
    held, see ``TrialSession.window_micro_batches``), the step a plan with accumulation runs.
    """
    workload = load_workload(workload)
    workload.check_takes_seq_len()
    for name, value in (("micro_batch", micro_batch), ("seq_multiple", seq_multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{given(name, value)} is not a positive whole number; use 1 or more")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or max_seq_len < seq_multiple):
        raise ConfigError(f"{given('max_seq_len', max_seq_len)} must be a whole number of at least "
                          f"{given('seq_multiple', seq_multiple)}")
    precision = Precision.parse(precision)
    checkpointing = CheckpointingRequest.parse(checkpointing, allow_auto=False)
    backend = backend or backend_for(device, memory_limit)
    info = backend.info()
    started = time.perf_counter()
    estimating = isinstance(backend, EstimateMemoryBackend)
    notes = []
    hint = estimate = None
    estimate_steps, estimated = 0, None
    if use_estimate and not estimating:
        estimator = EstimateMemoryBackend(info.budget_bytes, for_cuda=backend.device.type == "cuda")
        try:
            answer, fake_trials, fake_model, _ = _search(
                workload, estimator, micro_batch=micro_batch, seq_multiple=seq_multiple,
                limit=max_seq_len, precision=precision, checkpointing=checkpointing,
                window=2 if accumulation else 1)
        except EstimateUnavailable as exc:
            notes.append(f"no estimate, so real trials only: {exc}")
        else:
            estimate_steps, estimated = len(fake_trials), answer * seq_multiple
            hint = answer
            estimate = fake_model.predict if fake_model is not None and fake_model.points >= 2 else None
    best, trials, _, (limit, limit_name) = _search(
        workload, backend, micro_batch=micro_batch, seq_multiple=seq_multiple, limit=max_seq_len,
        precision=precision, checkpointing=checkpointing, hint=hint, estimate=estimate,
        window=2 if accumulation else 1)
    upper = limit // seq_multiple if limit is not None else None
    if limit_name is not None:
        notes.append(f"the search stops at the model's {limit_name} ({limit})")
    if best == 0 and upper == 0:
        # No length was tried: the first multiple is past the longest the model takes.
        raise ConfigError(
            f"{given('seq_multiple', seq_multiple)} is past "
            + (f"the model's {limit_name} ({limit})" if limit_name is not None else
               f"{given('max_seq_len', limit)}")
            + f": no multiple of it is a length the model takes; use a {option('seq_multiple')} "
              f"of at most {limit}")
    if best == 0:
        first = trials[0] if trials else None
        raise ProbeError(
            f"{workload.source}: not even {seq_multiple} position(s) fit at micro-batch "
            f"{micro_batch} ({setting_label(precision, checkpointing)}): "
            + (f"the step ran out of memory with {format_bytes(first.peak_bytes)} in use against "
               f"{format_bytes(info.budget_bytes)}; try {given('precision', 'bf16')}, "
               f"{given('checkpointing', 'on')}, a smaller {option('micro_batch')} or more memory"
               if first is not None else
               f"the parameters, gradients and optimizer state alone pass the "
               f"{format_bytes(info.budget_bytes)} budget, whatever the length; it needs more "
               f"memory, an optimizer with less state or sharding"))
    if estimated is not None:
        notes.append(f"the estimate ({estimate_steps} steps on fake tensors) put the answer at "
                     f"{estimated}; {len(trials)} real step(s) "
                     + ("confirmed it" if estimated == best * seq_multiple
                        else f"found {best * seq_multiple}"))
    if estimating:
        notes.append(f"every trial ran on fake tensors ({info.name}): estimated, nothing allocated")
    return SeqLenResult(
        max_seq_len=best * seq_multiple, micro_batch=micro_batch, seq_multiple=seq_multiple,
        upper_bound=limit, capped=upper is not None and best == upper,
        trials=[SeqLenTrial(seq_len=t.micro_batch * seq_multiple, fits=t.fits,
                            peak_bytes=t.peak_bytes, seconds=t.seconds) for t in trials],
        device=info, precision=precision.value, checkpointing=checkpointing.label,
        seconds=time.perf_counter() - started, estimate_steps=estimate_steps,
        estimated_max_seq_len=estimated, notes=notes)


def _search(workload: Workload, backend: MemoryBackend, *, micro_batch: int, seq_multiple: int,
            limit: int | None, precision: Precision, checkpointing, hint=None, estimate=None,
            window: int = 1):
    """``search_largest_fitting`` over k, a trial at k being one step at micro_batch × k·multiple
    positions; each ``Trial`` it sees is labelled by k (the size the search reasons about).
    Without a ``limit`` the model's own (read from the session's model: longer inputs would be an
    error, not out of memory) bounds k. Returns (k, trials, memory model, (limit, its name))."""
    estimating = isinstance(backend, EstimateMemoryBackend)
    lengths = _Lengths(workload)
    stepped = dataclasses.replace(workload, make_batch=lengths, seq_len=None)
    run_workload = on_fake_tensors(stepped, foreach=backend.for_cuda) if estimating else stepped
    limits = fake_tensor_limits(workload) if estimating else contextlib.nullcontext()
    session = TrialSession(run_workload, backend, precision=precision, checkpointing=checkpointing)
    where = "fake tensors" if estimating else "real"

    def run(k: int) -> Trial:
        lengths.seq_len = k * seq_multiple
        shown.set_postfix_str(f"trying length {lengths.seq_len} ({where})", refresh=True)
        trial = session.run(micro_batch, window=window)
        shown.update(1)
        return dataclasses.replace(trial, micro_batch=k)

    label = f"{'estimate' if estimating else 'probe'} seq len, {setting_label(precision, checkpointing)}"
    bound = (limit, None)
    try:
        with limits, session, progress.bar(label, unit=" step") as shown:
            found = model_position_limit(session.model) if limit is None else None
            if found is not None:
                bound = (found[1], found[0])
            upper = bound[0] // seq_multiple if bound[0] is not None else None
            return (*search_largest_fitting(run, budget=backend.info().budget_bytes, upper=upper,
                                            hint=hint, estimate=estimate), bound)
    except SetupOutOfMemory:
        return 0, [], None, bound


class _Lengths:
    """``make_batch(n)`` for the trial session: the model file's ``make_batch(n, seq_len)`` at
    the length the search is trying."""

    def __init__(self, workload: Workload):
        self.workload = workload
        self.seq_len = 1

    def __call__(self, batch_size: int):
        return self.workload.batch(batch_size, self.seq_len)


def model_position_limit(model: torch.nn.Module) -> tuple[str, int] | None:
    """(attribute, value) of the model's position limit, from ``model.config`` or the model
    itself; None where it declares none."""
    for holder in (getattr(model, "config", None), model):
        for name in POSITION_LIMITS:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < GROWTH_LIMIT:
                return name, value
    return None


__all__ = ["SeqLenResult", "SeqLenTrial", "model_position_limit", "probe_seq_len"]
