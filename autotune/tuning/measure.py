"""Samples per second of one configuration, measured with real training windows.

A configuration is a precision, a checkpointing setting and a split of the per-device share into
micro-batches. Its windows run through the training loop's own ``StepRunner`` (the accumulation,
loss scaling, clipping and optimizer step that ``autotune train`` runs) on a model set up by the
probe's ``TrialSession`` (optimizer state allocated, the memory budget enforced). The first window
is the warm-up and gives the peak; the next ones are timed whole, all micro-steps plus the
optimizer step, so samples/s compares plans with different accumulation on equal terms. Building
the batch is not timed (a data loader overlaps it with compute).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map_only

from ..workload.activation_checkpointing import disable_checkpointing
from ..workload.checkpoint_count import Checkpointing
from ..memory.base import MemoryBackend
from ..memory.frozen_heap import automatic_collection_off
from ..memory.oom import free_memory
from ..planning.types import SplitArithmetic
from ..precision import Precision, grad_scaler
from ..probing.trial import CLIP_NORM, SetupOutOfMemory, TrialSession
from ..training.data import SampleWindow, Window, slice_batch
from ..distributed.process_group import DistContext
from ..training.errors import TrainError
from ..training.loop import StepRunner, TrainState
from ..workload.contract import Workload

TIMED_WINDOWS = 3
"""Windows timed after the warm-up, at least. samples/s comes from the fastest: other processes
can only slow a window down, so the fastest is the closest to what the configuration costs."""

MIN_TIMED_S = 0.25
"""...and windows are timed until they add up to this: a small model's window lasts a few
milliseconds, and the fastest of three that short is whatever the rest of the machine allowed."""

MAX_TIMED_WINDOWS = 30


@dataclass(frozen=True, kw_only=True)
class Configuration(SplitArithmetic):
    """What the search varies: everything else about training stays as planned."""

    precision: Precision
    checkpointing: Checkpointing
    micro_batches: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision.parse(self.precision, option="precision"))
        object.__setattr__(self, "checkpointing",
                           Checkpointing.parse(self.checkpointing, option="checkpointing"))

    @property
    def share(self) -> int:
        return self.per_device_batch


@dataclass(kw_only=True)
class Measurement:
    samples_per_s: float | None
    """None when the configuration ran out of memory."""
    peak_bytes: int | None
    """Peak of the warm-up window; for an out-of-memory one, the usage when it failed (or None)."""
    out_of_memory: bool = False
    within_budget: bool = True
    """False when the backend saw the window pass its budget without raising (CUDA reserved)."""
    window_seconds: tuple[float, ...] = ()
    warm_up_only: bool = False
    """The time left allowed no timed window: samples/s is the warm-up window's, which includes the
    first step's one-time work (slower than the configuration runs, never faster)."""
    seconds: float = 0.0
    """Wall time of the whole measurement: set-up, warm-up and timed windows."""
    setup_seconds: float = 0.0
    """Wall time before the warm-up window: the model built, its optimizer state allocated and the
    window's samples made (what a side-by-side comparison pays once before its rounds)."""


def measure_configuration(workload: Workload, backend: MemoryBackend, config: Configuration, *,
                          windows: int = TIMED_WINDOWS, min_seconds: float = MIN_TIMED_S,
                          clock=time.perf_counter, seconds: float | None = None) -> Measurement:
    """Run one warm-up window, then timed windows of ``config``: at least ``windows``, and more
    until they add up to ``min_seconds`` (at most ``MAX_TIMED_WINDOWS``). ``clock`` times each
    window (wall time; ``time.thread_time`` for the work of a one-thread CPU step alone, without
    the time slices a shared machine gives other processes).

    ``seconds``: what the caller's budget has left. No timed window starts that would end past it
    (each expected to last as long as the one before): a configuration many times slower than the
    rest (bf16 on a CPU without bf16 units) would otherwise spend several budgets on its windows.
    Where not even one fits, the warm-up window's time stands (``warm_up_only``)."""
    started = time.perf_counter()
    until = None if seconds is None else started + seconds
    session = TrialSession(workload, backend, precision=Precision.parse(config.precision),
                           checkpointing=config.checkpointing)
    try:
        with session:
            result = _measure_in(session, config, windows, min_seconds, clock, until, started)
    except SetupOutOfMemory:
        result = Measurement(samples_per_s=None, peak_bytes=None, out_of_memory=True)
    result.seconds = time.perf_counter() - started
    return result


class _WindowOutOfMemory(Exception):
    """Raised through StepRunner's notify hook: a measurement stops at its first OOM instead of
    letting the loop redo the window with a finer split (that would measure another plan)."""


def _stop_at_out_of_memory(message: str) -> None:
    raise _WindowOutOfMemory(message)


class _ConstantSchedule:
    def step(self) -> None:
        """The LR does not change the cost of a step."""


def _runner(session: TrialSession, precision: Precision, scaler) -> StepRunner:
    return StepRunner(
        model=session.model, optimizer=session.optimizer, scheduler=_ConstantSchedule(),
        scaler=scaler, precision=precision, workload=session.workload,
        ctx=DistContext(world_size=1, rank=0, device=session.device), clip_grad_norm=CLIP_NORM,
        state=TrainState(), notify=_stop_at_out_of_memory,
    )


def _window(config: Configuration) -> Window:
    return Window(step=0, epoch=0, index=0, samples=config.share, start=0, stop=config.share,
                  micro_batches=config.micro_batches)


def _measure_in(session: TrialSession, config: Configuration, windows: int, min_seconds: float,
                clock=time.perf_counter, until: float | None = None, started: float = 0.0) -> Measurement:
    backend = session.backend
    runner = _runner(session, session.precision, session.scaler)
    window = _window(config)
    with _untracked(backend):  # the window's samples: host data, as the loop's window is
        batch = session.workload.batch(config.share)
    backend.release()
    backend.reset_peak()
    warm_up_started = time.perf_counter()
    setup_s = warm_up_started - started
    if not _run_window(runner, window, _counted_micro_batches(batch, backend)):
        peak = backend.peak_bytes()
        free_memory()
        return Measurement(samples_per_s=None, peak_bytes=peak, out_of_memory=True)
    warm_up_s = last_s = time.perf_counter() - warm_up_started
    peak, within = backend.peak_bytes(), backend.within_budget()
    times = []
    # As timeit does: a collection that happens to fall into one configuration's windows would
    # be charged to that configuration alone. What is left to collect waits for the next one.
    with _untracked(backend), automatic_collection_off():
        while len(times) < windows or (sum(times) < min_seconds and len(times) < MAX_TIMED_WINDOWS):
            window_started = time.perf_counter()
            if until is not None and window_started + last_s > until:
                break
            seconds = _timed_window(runner, window, batch, session.device, clock)
            if seconds is None:  # possible on CUDA (fragmentation) even after the warm-up fitted
                return Measurement(samples_per_s=None, peak_bytes=peak, out_of_memory=True)
            times.append(seconds)
            last_s = time.perf_counter() - window_started
    if not times:
        return Measurement(samples_per_s=config.share / warm_up_s, peak_bytes=peak, within_budget=within,
                           warm_up_only=True, setup_seconds=setup_s)
    return Measurement(samples_per_s=config.share / min(times), peak_bytes=peak,
                       within_budget=within, window_seconds=tuple(times), setup_seconds=setup_s)


COMPARE_MIN_ROUNDS = 3


def compare_configurations(workload: Workload, backend: MemoryBackend, configs: list[Configuration], *,
                           seconds: float, clock=time.perf_counter) -> list[Measurement]:
    """Time configurations side by side: one model, their windows interleaved round by round for
    at most about ``seconds`` (at least ``COMPARE_MIN_ROUNDS`` rounds after a warm-up round; no
    later round starts that would end past them), samples/s from each one's median window.

    A machine's speed drifts from one second to the next, so configurations measured one after
    the other are compared across different moments; interleaved, every configuration sees the
    same ones, and the median window compares them on those same moments where each one's
    single fastest window is a matter of luck. Only for configurations already measured one by
    one: this measures no peak, and one that runs out of memory here (CUDA fragmentation) drops
    out with ``out_of_memory``. ``clock`` times each window, as ``measure_configuration``'s.
    """
    if len({config.share for config in configs}) > 1:
        raise ValueError("compare_configurations: every configuration must split the same share")
    started = time.perf_counter()
    session = TrialSession(workload, backend, precision=Precision.FP32,
                           checkpointing=Checkpointing.off())
    try:
        with session:
            times = _compare_in(session, configs, started + seconds, clock)
    except SetupOutOfMemory:
        times = [None] * len(configs)
    return [Measurement(samples_per_s=None, peak_bytes=None, out_of_memory=True) if not found
            else Measurement(samples_per_s=config.share / statistics.median(found), peak_bytes=None,
                             window_seconds=tuple(found), seconds=time.perf_counter() - started)
            for config, found in zip(configs, times)]


def _compare_in(session: TrialSession, configs: list[Configuration], deadline: float,
                clock=time.perf_counter) -> list:
    """Per configuration, its timed windows (None: it ran out of memory)."""
    runners = []
    for config in configs:
        precision = Precision.parse(config.precision)
        runners.append(_runner(session, precision, grad_scaler(precision, session.device)))
    batch = session.workload.batch(configs[0].share) if configs else None
    times: list = [[] for _ in configs]
    try:
        with _untracked(session.backend), automatic_collection_off():  # as above
            # Round 0 is the warm-up: each configuration's first window after set-up. Past the
            # fixed rounds, none starts that would end past the deadline (each expected to last
            # as long as the one before), as a measurement's timed windows.
            round_s = 0.0
            for round_ in range(MAX_TIMED_WINDOWS + 1):
                round_started = time.perf_counter()
                if round_ > COMPARE_MIN_ROUNDS and round_started + round_s > deadline:
                    break
                for i, config in enumerate(configs):
                    if times[i] is None:
                        continue
                    session.set_checkpointing(config.checkpointing)
                    seconds = _timed_window(runners[i], _window(config), batch, session.device, clock)
                    if seconds is None:
                        times[i] = None
                    elif round_:
                        times[i].append(seconds)
                round_s = time.perf_counter() - round_started
    finally:
        disable_checkpointing(session.model)
    return times


def _timed_window(runner: StepRunner, window: Window, batch, device: torch.device,
                  clock=time.perf_counter) -> float | None:
    """Seconds of one window, device work included; None when it ran out of memory."""
    _synchronize(device)
    start = clock()
    ran = _run_window(runner, window, batch)
    _synchronize(device)
    if not ran:
        free_memory()
        return None
    return clock() - start


def _run_window(runner: StepRunner, window: Window, batch) -> bool:
    """One optimizer step over the window; False when it ran out of memory."""
    try:
        runner.step(window, batch, stop_requested=False)
    except _WindowOutOfMemory:
        return False
    except TrainError:
        # In one process, StepRunner.step raises TrainError only when a micro-batch of one sample
        # ran out of memory (it cannot split further, so notify is never reached). Anything else
        # is not ours to hide.
        if window.micro_batches and max(window.micro_batches) > 1:
            raise
        return False
    return True


class _MicroBatchCopies(SampleWindow):
    """The window's samples handing each micro-step a copy of its slice, made where the CPU
    backend counts it. A slice is a view of the whole window, which counted at its first use
    made the warm-up's peak the whole window's samples, not the micro-batch the plan counts and
    CUDA holds (the loop moves one micro-batch at a time to the device): cnn_bn's 32 x 2 showed
    5.95 MiB against the plan's 5.57, and a window of many micro-batches could pass the budget
    where training fits."""

    def __init__(self, batch, backend: MemoryBackend):
        self.batch, self.backend = batch, backend

    def collate(self, start: int, stop: int):
        with _untracked(self.backend):
            part = slice_batch(self.batch, start, stop)
        return tree_map_only(torch.Tensor, torch.clone, part)


def _counted_micro_batches(batch, backend: MemoryBackend):
    """``batch`` for the warm-up window, whose peak is measured (``_MicroBatchCopies`` on the
    CPU; on CUDA the window stays on the host and the loop copies each micro-batch over)."""
    return _MicroBatchCopies(batch, backend) if backend.device.type == "cpu" else batch


def _untracked(backend: MemoryBackend):
    # The CPU backend counts bytes in a TorchDispatchMode, which adds Python work to every op that
    # real training does not pay; the warm-up already measured the peak, so timed windows run
    # without it. On CUDA tracking is the allocator's own and costs nothing.
    if backend.device.type != "cpu":
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
