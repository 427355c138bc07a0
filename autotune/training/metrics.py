"""Per-step metrics: measured here, written to JSONL and a progress line by rank 0 only."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
import json
import math
import resource
import sys
import weakref
from pathlib import Path

import torch

from .. import progress as progress_bars
from ..files import jsonlines
# The CPU backend's own counting mode (private there): the meter counts what the probe counts.
from ..memory.cpu import StorageTracker, _TrackingMode, tracking_resizes
from ..files.outputs import write_atomic
from ..errors import OutputError
from ..units import format_bytes
from .errors import TrainError

FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "samples_per_s",
          # The step's peak in the memory the plan predicted (peak_memory_kind: "allocated" by
          # torch on CUDA, "tensors" counted on the CPU, where only some steps are counted and
          # the others record None: see PeakMeter); reserved on CUDA, RSS on the CPU.
          "peak_memory_bytes", "peak_memory_kind", "reserved_peak_bytes", "rss_peak_bytes",
          "skipped_steps", "oom_recoveries", "micro_batch", "accumulation_steps",
          # The gradient noise scale (samples; None until known) and the moving averages of the
          # per-sample |G|² and tr(Σ) it is the ratio of: see autotune.training.noise_scale.
          "noise_scale", "noise_grad_sq_ema", "noise_trace_ema")


def report_every(total_steps: int) -> int:
    """Progress log lines come every this many steps."""
    return max(1, total_steps // 20)


COUNT_EVERY = 100
"""On the CPU, the peak is counted on the first two steps, every this many steps and the last."""


@dataclass(kw_only=True)
class PlanCheck:
    """What the loop checks each counted step's peak against: the plan's prediction and budget."""

    predicted_bytes: int | None
    """The plan's predicted peak (DDP's buckets included where it has them)."""
    budget_bytes: int | None
    """The plan's device budget: on the CPU a step that passes it stops with a ``PlanExceeded``."""
    headroom_bytes: int = 0
    """The budget share the plan kept free: a peak above the prediction by more warns."""
    untracked_bytes: int = 0
    """Memory the plan counts that the meter does not see (DDP's gradient buckets on the CPU,
    allocated when the model is wrapped)."""
    counted_at_step: int | None = None
    """The step that allocates the untracked memory anew, so that the meter counts it there
    (DDP rebuilds its buckets in the first forward after a synced backward: a run's second step)."""

    def untracked_at(self, step: int) -> int:
        return 0 if step == self.counted_at_step else self.untracked_bytes

    def over(self, step: int, peak: int, kind: str) -> str | None:
        """The warning for a peak above the prediction by more than the headroom (None: fine)."""
        if self.predicted_bytes is None:
            return None
        total = peak + self.untracked_at(step)
        if total <= self.predicted_bytes + self.headroom_bytes:
            return None
        return (f"step {step} peaked at {format_bytes(total)} ({kind}), above the plan's predicted "
                f"{format_bytes(self.predicted_bytes)} by {format_bytes(total - self.predicted_bytes)}, "
                f"more than the {format_bytes(self.headroom_bytes)} of headroom: the plan "
                f"under-estimated this step (please report it with the plan file); re-plan with "
                f"more --headroom or check it with autotune verify")


class PlanExceeded(TrainError):
    """On the CPU, a counted step passed the plan's budget: the plan did not predict that step,
    which is a bug in the plan (an out-of-memory error the probe would have raised)."""


class _StepTracker(StorageTracker):
    """The CPU meter's tracker. The storages of the window's batch, made before the step, are not
    counted: a micro-batch sliced from it is a view of the whole window's samples, and the plan
    counted the one micro-batch a step moves to the device (a copy on CUDA).

    fsdp-offload keeps the shards, their gradients and the optimizer state and step in host
    memory, which on the CPU is the same memory as the "device": what FSDP2 puts on the host
    (``to_host``) or makes inside ``on_host()`` is left out, as the plan's estimate leaves it out
    of the device's peak (``memory.cpu.HostDeviceTracker``)."""

    def __init__(self, budget_bytes: int | None = None, *, ignored=()):
        super().__init__(budget_bytes)
        self.ignored: dict[int, weakref.ref] = {}
        """Storages left out, by key; a key is the storage's address, which a storage allocated
        after this one dies may get: each is forgotten when its storage dies, or the new storage
        would go uncounted (seen with Hugging Face caches: 1.8 MB of GPT-2's step missed)."""
        for storage in ignored:
            self._ignore(storage)
        self.making_host = False
        self.aliasing = False
        """The op being counted returns a view of (or writes into) a tensor it was given."""

    def add_storage(self, storage) -> None:
        key = storage._cdata
        if key in self.ignored:
            return
        if (self.making_host or self.aliasing) and key not in self._live:
            # An op that only aliases shows a storage the step did not allocate: memory made
            # before the step and not among its live tensors (DDP's gradient buckets, which
            # the plan counts apart, the window's batch). Counted, a step's peak would depend on
            # whether the peak came before or after the first op touching it.
            self._ignore(storage)
            return
        super().add_storage(storage)

    def _ignore(self, storage) -> None:
        key = storage._cdata
        if key not in self.ignored:
            self.ignored[key] = weakref.ref(storage, lambda _, key=key: self.ignored.pop(key, None))

    def to_host(self, tensor: torch.Tensor) -> None:
        if hasattr(tensor, "to_local"):  # a DTensor: its local shard holds the storage
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        self.disown([storage._cdata])
        self._ignore(storage)


class _PlanBudget(_StepTracker):
    """The CPU meter's tracker, holding a step to the plan's budget as the probe held its trials."""

    def __init__(self, check: PlanCheck, step: int, *, ignored=()):
        super().__init__(check.budget_bytes - check.untracked_at(step), ignored=ignored)
        self.check, self.step = check, step

    def _out_of_memory(self, delta: int) -> Exception:
        check, need = self.check, self.current + delta + self.check.untracked_at(self.step)
        predicted = (format_bytes(check.predicted_bytes) if check.predicted_bytes is not None
                     else "no peak")
        return PlanExceeded(
            f"step {self.step} needed {format_bytes(need)} of tensors (allocating "
            f"{format_bytes(delta)} more), past the plan's budget of "
            f"{format_bytes(check.budget_bytes)}, where the plan predicted {predicted}: the plan "
            f"under-estimated this step, which is a bug in autotune; please report it with the "
            f"plan file and the model file. To train meanwhile, re-plan with more --headroom")


class PeakMeter:
    """The peak of an optimizer step, in the memory the plan predicted.

    CUDA: torch's allocated bytes (reserved beside it), every step. CPU: the bytes of live tensor
    storages, counted by the CPU backend's tracker as the probe counted them. Counting every op
    makes a step slower (1.4x on the bundled tiny LM at micro-batch 8), so the CPU counts the
    first two steps of a run (the second is steady, with optimizer state), every COUNT_EVERY-th
    and the last; the others record None (and their samples/s is not slowed). The process's
    resident set (RSS) also holds the interpreter, libraries and allocator caches: it is recorded
    beside the peak, never in its place.

    ``check`` (a ``PlanCheck``): each measured step is compared with the plan's prediction
    (``warning`` says when it passes it by more than the headroom), and on the CPU a counted
    step is held to the plan's budget as the probe held its trials (``PlanExceeded``).
    """

    def __init__(self, device: torch.device, *, total_steps: int, check: PlanCheck | None = None):
        self.device = device
        self.check = check
        self._tracker = None
        self.warning = None
        """The last measured step's warning against the plan (None: within it)."""
        self.kind = "allocated" if device.type == "cuda" else "tensors"
        self.total_steps = total_steps
        self.counted = 0
        self.peak = None
        self.reserved = None

    def _counts(self, step: int) -> bool:
        return self.counted < 2 or step % COUNT_EVERY == 0 or step == self.total_steps

    @contextlib.contextmanager
    def step(self, step: int, live_tensors, batch=None, host=()):
        """Measure optimizer step ``step`` (1-based), run inside the block; ``live_tensors`` were
        allocated before it (parameters, buffers, optimizer state); ``batch`` is the window's,
        whose micro-batches the CPU counts as they are made, not as views of it; ``host``: what
        lives in host memory (fsdp-offload's shards and optimizer state), never counted."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            self.reserved = int(torch.cuda.max_memory_reserved(self.device))
            self._compare(step)
            return
        if not self._counts(step):
            self.peak = None
            yield
            return
        enforce = self.check is not None and self.check.budget_bytes is not None
        ignored = list(_storages(batch))
        tracker = (_PlanBudget(self.check, step, ignored=ignored) if enforce
                   else _StepTracker(ignored=ignored))
        for tensor in live_tensors:
            tracker.add(tensor)
        for tensor in host:
            tracker.to_host(tensor)
        # Resizes too, as the probe counts them: FSDP2 frees each gathered block by resizing its
        # storage to 0, which no dispatch mode sees (counted without, every block stays).
        self._tracker = tracker
        try:
            with tracking_resizes(tracker), _MeterMode(tracker):
                yield
        finally:
            self._tracker = None
        self.counted += 1
        self.peak = tracker.peak
        self._compare(step)

    @contextlib.contextmanager
    def on_host(self):
        """fsdp-offload on the CPU: what the block makes is host memory, not counted."""
        tracker = self._tracker
        if tracker is None:
            yield
            return
        saved, tracker.making_host = tracker.making_host, True
        try:
            yield
        finally:
            tracker.making_host = saved

    def to_host(self, tensor) -> None:
        """fsdp-offload on the CPU: this tensor now lives in host memory (not counted)."""
        if self._tracker is not None and tensor is not None:
            self._tracker.to_host(tensor)

    def _compare(self, step: int) -> None:
        self.warning = (self.check.over(step, self.peak, self.kind)
                        if self.check is not None and self.peak is not None else None)

    def fields(self) -> dict:
        return {"peak_memory_bytes": self.peak, "peak_memory_kind": self.kind,
                "reserved_peak_bytes": self.reserved,
                "rss_peak_bytes": rss_peak_bytes() if self.device.type == "cpu" else None}


class _MeterMode(_TrackingMode):
    """The CPU backend's counting mode, telling the tracker which ops only alias their inputs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        saved, self.tracker.aliasing = self.tracker.aliasing, _aliases(func)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.tracker.aliasing = saved


@functools.lru_cache(maxsize=None)
def _aliases(func) -> bool:
    # lift_fresh aliases a tensor torch.tensor() just made (outside dispatch): an allocation of
    # the step, as the probe counts it.
    if func is torch.ops.aten.lift_fresh.default:
        return False
    return any(r.alias_info is not None for r in func._schema.returns)


def _storages(batch):
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
            yield leaf.untyped_storage()


def rss_peak_bytes() -> int:
    """The process's peak resident set size so far (the operating system keeps no per-step peak)."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def _finite_or_none(value):
    # JSON has no Infinity/NaN; a skipped fp16 step has a non-finite gradient norm.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """JSONL file (one object per optimizer step) and progress on stderr: a tqdm bar where stderr
    is a terminal, else a log line every twentieth of the run."""

    def __init__(self, path, *, enabled: bool, total_steps: int, progress: bool, resume_step: int,
                 predicted_peak_bytes: int | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.predicted_peak_bytes = predicted_peak_bytes
        self.every = report_every(total_steps)
        self._shown_peak = {}
        self._bar = None
        if self.progress and progress_bars.shown():
            self._bar = progress_bars.bar("train", total=total_steps, unit=" step")
            self._bar.update(resume_step)
        self._file = None
        if enabled and path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step:
                _keep_steps_before(path, resume_step)
            # "w" empties a file in place (its permissions and links kept) and writes through to a
            # device or pipe; it never deletes what is at the path.
            self._file = path.open("a" if resume_step else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is not None:
            clean = {key: _finite_or_none(value) for key, value in record.items()}
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()
        if record.get("peak_memory_bytes") is not None:
            self._shown_peak = {k: record.get(k) for k in ("peak_memory_bytes", "peak_memory_kind",
                                                             "reserved_peak_bytes")}
            self._shown_peak["peak_step"] = record["step"]
        # Steps whose peak was not counted show the last one counted, with its step.
        shown = {**record, **self._shown_peak}
        if self._bar is not None:
            self._bar.set_postfix_str(format_postfix(shown, self.predicted_peak_bytes), refresh=False)
            self._bar.update(1)
            return
        step = record["step"]
        if self.progress and (step % self.every == 0 or step == self.total_steps):
            print(format_progress(shown, self.total_steps, self.predicted_peak_bytes),
                  file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            progress_bars.write(f"autotune train: {message}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def format_peak(record: dict, predicted: int | None = None) -> str:
    """The step's peak, named for what it counts, next to the plan's prediction of the same."""
    if record.get("peak_memory_bytes") is None:
        return "peak not counted"
    kind = record.get("peak_memory_kind") or "allocated"
    at = record.get("peak_step", record["step"])
    text = f"peak {format_bytes(record['peak_memory_bytes'])} {kind}"
    if at != record["step"]:
        text += f" (counted at step {at})"
    if predicted is not None:
        text += f" (plan {format_bytes(predicted)})"
    if record.get("reserved_peak_bytes") is not None:
        text += f", reserved {format_bytes(record['reserved_peak_bytes'])}"
    if record.get("rss_peak_bytes") is not None:
        text += f", process RSS {format_bytes(record['rss_peak_bytes'])}"
    return text


def format_postfix(record: dict, predicted: int | None = None) -> str:
    return (f"loss {record['loss']:.4f}, {record['samples_per_s']:.0f} samples/s, "
            f"{format_peak(record, predicted)}")


def format_progress(record: dict, total_steps: int, predicted: int | None = None) -> str:
    norm = record["grad_norm"]
    norm_text = f"{norm:.3g}" if norm is not None and math.isfinite(norm) else "inf"
    extra = ""
    if record["skipped_steps"]:
        extra += f"  skipped {record['skipped_steps']}"
    if record["oom_recoveries"]:
        extra += f"  oom-recoveries {record['oom_recoveries']}"
    if record.get("noise_scale") is not None:
        extra += f"  B_noise {record['noise_scale']:.3g}"
    return (
        f"step {record['step']}/{total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  "
        f"|g| {norm_text}  {record['samples_per_s']:.0f} samples/s  "
        f"{format_peak(record, predicted)}{extra}"
    )


def _keep_steps_before(path: Path, resume_step: int) -> None:
    """On resume, drop lines for steps after the checkpoint: they will be trained again."""
    if not path.is_file():
        return
    kept = []
    try:
        for _, line in jsonlines.read_lines(path):
            try:
                step = jsonlines.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int) and step <= resume_step:
                kept.append(line)
    except (jsonlines.LineTooLong, UnicodeDecodeError) as exc:
        raise OutputError(f"--metrics {path}: {exc}, so it is not a metrics file autotune wrote; "
                          f"resuming would rewrite it. Give another --metrics path") from None
    text = "".join(line + "\n" for line in kept).encode("utf-8")
    write_atomic(path, lambda handle: handle.write(text))
