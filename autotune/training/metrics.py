"""Per-step metrics: measured here, written to JSONL and a progress line by rank 0 only."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

from ..atomicfile import write_atomic
from ..units import format_bytes

FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "peak_memory_bytes",
          "skipped_steps", "oom_recoveries", "micro_batch", "accumulation_steps",
          # The gradient noise scale (samples; None until known) and the moving averages of the
          # per-sample |G|² and tr(Σ) it is the ratio of: see autotune.training.noise_scale.
          "noise_scale", "noise_grad_sq_ema", "noise_trace_ema")


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the step's peak allocation (the peak is reset after reading); CPU: the process's
    peak resident set size so far (the operating system keeps no per-step peak)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def _finite_or_none(value):
    # JSON has no Infinity/NaN; a skipped fp16 step has a non-finite gradient norm.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """JSONL file (one object per optimizer step) and a progress line on stderr."""

    def __init__(self, path, *, enabled: bool, total_steps: int, progress: bool, resume_step: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.every = max(1, total_steps // 20)
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
        step = record["step"]
        if self.progress and (step % self.every == 0 or step == self.total_steps):
            print(format_progress(record, self.total_steps), file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            print(f"autotune train: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def format_progress(record: dict, total_steps: int) -> str:
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
        f"peak {format_bytes(record['peak_memory_bytes'])}{extra}"
    )


def _keep_steps_before(path: Path, resume_step: int) -> None:
    """On resume, drop lines for steps after the checkpoint: they will be trained again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step <= resume_step:
            kept.append(line)
    text = "".join(line + "\n" for line in kept).encode("utf-8")
    write_atomic(path, lambda handle: handle.write(text))
