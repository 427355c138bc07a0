"""One prepared command that proves autotune's CUDA claims on one GPU (issue 26).

A GPU is lent only now and then, for about fifteen minutes in all, so everything it should
measure is prepared here, run once, and reported as it goes:

    python bench/gpu_proof.py --out gpu-proof              # the default subset, ~7 minutes
    python bench/gpu_proof.py --list                       # the checks (works without CUDA)
    python bench/gpu_proof.py --out gpu-proof --full       # every example x precision x card
    python bench/gpu_proof.py --out gpu-proof --checks probe_exact,train_200 --budget-seconds 200

Smaller cards are emulated on the one device with ``torch.cuda.set_per_process_memory_fraction``
caps (16, 24 and 40 GiB by default; ``--cards``). A table row is printed as each check finishes
(the cases of a check are printed as they finish too), and ``report.json`` / ``report.md`` in
``--out`` are rewritten after every case, so a run cut short still leaves its report. Exit 0 only
when every check holds (a check that does not apply, such as the multi-GPU one on one GPU, is a
skip and does not count against it); 1 otherwise; 2 without CUDA or for a usage error.

Only autotune's public API (``import autotune``) and its command line are used: module paths
inside autotune move, the public names do not. Every check is a function of a ``Context`` whose
``device`` is a small adapter over the few CUDA calls the checks make (``CudaDevice``), so the
tests run every check's code on the CPU with that adapter faked (tests/test_gpu_proof.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import autotune  # noqa: E402
from rank_correlation import spearman  # noqa: E402  (bench/, beside this file)

GiB = 1 << 30
EXAMPLES = ROOT / "examples"
HF_MODEL = EXAMPLES / "real" / "gpt2.py"
"""The tiny Hugging Face model (transformers is a test dependency): GPT-2 with a tiny config."""

PROFILE_FOR_CARD = {16 * GiB: "t4", 24 * GiB: "l4", 40 * GiB: "a100-40gb", 80 * GiB: "h100-80gb"}
"""The bundled GPU profile `autotune verify` checks for each emulated card size."""

HEADROOM = 0.1
"""autotune plan's default --headroom: the part of the budget left for what the estimate does
not count (the caching allocator's reserve above allocated bytes)."""

HOLDING = ("pass", "skip")
"""A skip is a check that does not apply on this machine (one GPU); it does not fail the run.
"cut" (the time budget ran out before the check proved everything) and "error" do."""


# --- the device adapter --------------------------------------------------------------------------

class CudaDevice:
    """The CUDA calls the checks make, in one place, so that tests can put a CPU fake here."""

    torch_device = "cuda"

    def available(self) -> bool:
        try:
            return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
        except (RuntimeError, AssertionError):  # a driver that cannot be initialised
            return False

    def count(self) -> int:
        return torch.cuda.device_count()

    def describe(self) -> dict:
        props = torch.cuda.get_device_properties(0)
        return {"name": props.name, "total_bytes": int(props.total_memory), "count": self.count(),
                "bf16": bool(torch.cuda.is_bf16_supported()), "cuda": torch.version.cuda,
                "capability": f"{props.major}.{props.minor}"}

    def total_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(0).total_memory)

    def supports(self, precision: str) -> bool:
        return precision != "bf16" or bool(torch.cuda.is_bf16_supported())

    @contextlib.contextmanager
    def capped(self, limit_bytes: int):
        """Emulate a card of ``limit_bytes``: the caching allocator raises OutOfMemoryError past it."""
        total = self.total_bytes()
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = getter(0) if getter else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), 0)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, 0)

    def release(self) -> None:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def reset_peaks(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(0)

    def peaks(self) -> tuple[int, int]:
        """(max_memory_allocated, max_memory_reserved) since the last reset_peaks."""
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(0)), int(torch.cuda.max_memory_reserved(0))

    def oom_count(self) -> int:
        """Out-of-memory errors the allocator has raised in this process (never reset by
        reset_peak_memory_stats), so a run's OOMs are the difference across it."""
        return int(torch.cuda.memory_stats(0).get("num_ooms", 0))

    def synchronize(self) -> None:
        """Wait for the queued kernels: a step's wall time is only known after it."""
        torch.cuda.synchronize()


# --- what runs: cases, checks, the context -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    """One probe setting on one emulated card."""

    workload: str
    precision: str
    checkpointing: str  # "off" | "on"
    card: int  # bytes

    @property
    def label(self) -> str:
        return f"{self.workload} {self.precision} ckpt {self.checkpointing} @ {gib(self.card)}"


@dataclasses.dataclass(frozen=True)
class TrainCase:
    cell: Cell
    factor: float
    """Target batch = factor x the probe's answer: above 1 (with the plan's headroom) the plan
    accumulates; below 1 it takes one step."""


@dataclasses.dataclass(frozen=True)
class VerifyCase:
    workload: str
    profile: str
    card: int
    target_batch: int


@dataclasses.dataclass(frozen=True)
class TimeCase:
    """One workload and precision timed and measured at a few micro-batches, checkpointing off
    and on: ``sizes``, or the largest micro-batch ``cell``'s probe found and its half and quarter."""

    workload: str
    precision: str
    sizes: tuple = ()
    cell: Cell | None = None

    @property
    def label(self) -> str:
        return f"{self.workload} {self.precision}"


@dataclasses.dataclass
class Config:
    cards: list[int]
    probe_cells: list[Cell]
    estimate_cells: list[Cell]
    train_cases: list[TrainCase]
    verify_cases: list[VerifyCase]
    overhead: dict
    """workload, precision, micro_batch, accumulation, steps, rounds, warmup."""
    multi: dict
    """workload, precision, target_batch, card, steps, shardings."""
    train_steps: int = 200
    tolerance: float = 0.03
    overhead_limit: float = 1.03
    budget_seconds: float = 420.0
    pytest_args: tuple = ("-m", "gpu", "tests")
    full: bool = False
    reserved_cases: list = dataclasses.field(default_factory=list)
    """TimeCases whose real steps' max_memory_reserved the allocator model is compared against
    (besides the estimate cells' probe trials)."""
    time_cases: list = dataclasses.field(default_factory=list)
    reserved_tolerance: float = 0.05
    time_tolerance: float = 0.25
    """Issue 22: predicted step time within 25% of measured, and the ranking's Spearman >= 0.9."""
    rank_floor: float = 0.9
    time_profile: str | None = None
    """The GPU profile predictions are made for; None: the bundled one named like this device."""
    time_warmup: int = 2
    time_repeats: int = 5


LLAMA_ENV = {"llama_1b": {"AUTOTUNE_LLAMA": "1b", "AUTOTUNE_LLAMA_SEQ": "2048"}}
"""bench/llama_like.py at a size one GPU trains: 16 blocks, dim 2048, vocab 128256 (1.5 B
parameters), sequence 2048. Large enough that its step is the GPU's work, not kernel launches."""

PROFILE_BY_NAME = (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100", None), ("L4", "l4"),
                   ("T4", "t4"), ("A10G", "a10g"), ("V100", None), ("4090", "rtx-4090"),
                   ("3090", "rtx-3090"))
"""The bundled profile for a device name (A100 and V100 by their memory: 40/80 and 16/32 GB)."""


def profile_for(describe: dict) -> str | None:
    name, total = describe.get("name") or "", describe.get("total_bytes") or 0
    for key, profile in PROFILE_BY_NAME:
        if key in name:
            if key == "A100":
                return "a100-80gb" if total > 48 * GiB else "a100-40gb"
            if key == "V100":
                return "v100-32gb" if total > 20 * GiB else "v100-16gb"
            return profile
    return None


def workload_path(name: str) -> Path:
    if name == "gpt2":
        return HF_MODEL
    if name in LLAMA_ENV:
        return ROOT / "bench" / "llama_like.py"
    path = EXAMPLES / f"{name}.py"
    if not path.is_file():
        raise autotune.ConfigError(f"unknown workload {name!r}: not an examples/*.py file nor gpt2")
    return path


def bundled_workloads() -> list[str]:
    """Every bundled example (examples/*.py) and the tiny Hugging Face model."""
    return sorted(p.stem for p in EXAMPLES.glob("*.py")) + ["gpt2"]


def default_config(cards: list[int], *, full: bool = False) -> Config:
    """The default subset fits about seven minutes of an H200 (every precision and both
    checkpointing settings appear, each card is used); ``full`` is the whole matrix."""
    small, mid, large = (cards + cards[-1:] * 3)[:3]  # fewer than three cards: reuse the last
    if full:
        cells = [Cell(w, p, c, card) for card in cards for w in bundled_workloads()
                 for p in ("fp32", "bf16", "fp16") for c in ("off", "on")]
        trains = [TrainCase(Cell(w, p, c, card), f) for card in cards
                  for (w, p, c, f) in (("tiny_lm", "bf16", "off", 2.5), ("gpt2", "fp16", "on", 1.5),
                                       ("tiny_lm", "fp32", "on", 0.5))]
        verifies = [VerifyCase(w, PROFILE_FOR_CARD[card], card, t) for card in cards
                    if card in PROFILE_FOR_CARD for (w, t) in (("tiny_lm", 1 << 16), ("gpt2", 1 << 18))]
    else:
        # One cell per example plus one, so that fp32, bf16 and fp16 each run with checkpointing
        # off and on. mlp stays on the smallest card: its make_batch draws every sample on the CPU.
        cells = [Cell("mlp", "fp32", "off", small), Cell("cnn_bn", "bf16", "on", mid),
                 Cell("tiny_lm", "fp16", "off", small), Cell("gpt_varlen", "fp32", "on", large),
                 Cell("gpt2", "fp16", "on", mid), Cell("tiny_lm", "bf16", "off", large)]
        # Token models only: their make_batch is cheap at any size, and the other examples'
        # datasets are smaller than one window of a near-full card.
        trains = [TrainCase(Cell("tiny_lm", "fp16", "off", small), 1.5),
                  TrainCase(Cell("gpt2", "fp16", "on", mid), 0.5)]
        verifies = [VerifyCase(w, PROFILE_FOR_CARD[card], card, t)
                    for (w, card, t) in (("gpt2", small, 1 << 18), ("tiny_lm", large, 1 << 16))
                    if card in PROFILE_FOR_CARD]
    # The Llama shape first: its step is GPU-bound, the examples' steps partly launch-bound.
    llama = TimeCase("llama_1b", "bf16", sizes=(1, 2, 4))
    by_workload = {c.workload: c for c in cells}
    timed = [TimeCase(w, by_workload[w].precision, cell=by_workload[w])
             for w in ("tiny_lm", "gpt2", "cnn_bn", "gpt_varlen", "mlp") if w in by_workload]
    return Config(
        reserved_cases=[llama], time_cases=[llama, *timed],
        cards=cards, probe_cells=cells, estimate_cells=list(cells), train_cases=trains,
        verify_cases=verifies,
        overhead={"workload": "tiny_lm", "precision": "bf16", "micro_batch": 256, "accumulation": 4,
                  "steps": 40, "rounds": 3, "warmup": 5},
        multi={"workload": "tiny_lm", "precision": "bf16", "target_batch": 16384, "card": small,
               "steps": 30, "shardings": ("ddp", "fsdp")},
        full=full,
    )


@dataclasses.dataclass
class Outcome:
    status: str
    summary: str
    rows: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    title: str
    share: float
    """Its part of what is left of the time budget when it starts, against the parts of the
    checks after it that apply here (time one check leaves unused goes to the ones after it)."""
    run: Callable[["Context"], Outcome]
    applies: Callable[["Context"], bool] = lambda ctx: True
    """False: the check skips at once here, and its part of the budget goes to the others."""


class Stopped(BaseException):
    """SIGTERM/SIGINT: stop now, keep what was measured (BaseException: the checks' own
    ``except Exception`` must not swallow it)."""


class Context:
    """What a check gets: the device adapter, the configuration, the report, and its deadline."""

    def __init__(self, device, config: Config, report: "Report", *, log=print):
        self.device = device
        self.config = config
        self.report = report
        self.log = log
        self.started = time.monotonic()
        self.deadline = self.started + config.budget_seconds
        self.check_deadline = self.deadline
        self.rows: list[dict] = []
        self._probes: dict[Cell, Any] = {}
        self._workloads: dict[str, Any] = {}
        self._measured: dict[tuple, dict] = {}
        self._cuda_peaks: dict[tuple, tuple[int, int]] = {}

    # time
    def left(self) -> float:
        return min(self.check_deadline, self.deadline) - time.monotonic()

    def out_of_time(self) -> bool:
        return self.left() <= 0

    # shared work, done once whichever check asks first
    def workload(self, name: str):
        if name not in self._workloads:
            os.environ.update(LLAMA_ENV.get(name, {}))  # llama_like.py reads its shape at import
            self._workloads[name] = autotune.load_workload(str(workload_path(name)))
        return self._workloads[name]

    def cuda_peaks(self, name: str, precision: str, checkpointing: bool, sizes) -> dict:
        """``autotune.estimate_cuda_peaks`` for this device (cached: the estimate and reserved
        checks share them): {n: (tensor bytes, modelled reserved bytes)}."""
        key = (name, precision, checkpointing)
        todo = sorted({n for n in sizes if (*key, n) not in self._cuda_peaks})
        if todo:
            peaks = autotune.estimate_cuda_peaks(
                self.workload(name), todo, gpu_name=_device_name(self),
                precision=precision, checkpointing=checkpointing)
            self._cuda_peaks.update({(*key, n): peak for n, peak in peaks.items()})
        return {n: self._cuda_peaks[(*key, n)] for n in sizes}

    def measure(self, name: str, precision: str, checkpointing: bool, sizes) -> dict[int, dict]:
        """Real reference steps at each size, uncapped (cached: the reserved and step-time
        checks share them): median step seconds, allocated and reserved peaks, or an OOM."""
        key = (name, precision, checkpointing)
        todo = [n for n in sizes if (*key, n) not in self._measured]
        if todo:
            self.device.release()
            step = ReferenceStep(self.workload(name), self.device.torch_device, precision,
                                 checkpointing)
            try:
                for n in todo:
                    self._measured[(*key, n)] = _timed_steps(step, self.device, n,
                                                             self.config.time_warmup,
                                                             self.config.time_repeats)
            finally:
                step = None
                self.device.release()
        return {n: self._measured[(*key, n)] for n in sizes}

    def probe(self, cell: Cell):
        """autotune's probe for ``cell`` (cached: the estimate and train checks reuse the matrix's)."""
        if cell not in self._probes:
            self.device.release()
            start = time.perf_counter()
            result = autotune.probe(self.workload(cell.workload), device=self.device.torch_device,
                                    precision=cell.precision, checkpointing=cell.checkpointing == "on",
                                    memory_limit=cell.card)
            # Wall time includes the fake-tensor search that ProbeResult.seconds may not.
            self._probes[cell] = (result, time.perf_counter() - start)
            self.device.release()
        return self._probes[cell][0]

    def probe_seconds(self, cell: Cell) -> float:
        return self._probes[cell][1]

    def add_row(self, row: dict) -> None:
        """Record one case: print it and rewrite the report, so a run cut short keeps it."""
        self.rows.append(row)
        self.log("    " + "  ".join(f"{k}={_text(v)}" for k, v in row.items()), flush=True)
        self.report.write_partial(self.rows)


# --- 1. the probe against an exhaustive bisection ------------------------------------------------

def _map(batch, fn):
    """``fn`` applied to every tensor of a batch made of tensors, tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        items = [_map(v, fn) for v in batch]
        return items if isinstance(batch, list) else tuple(items)
    return batch


def _slice(batch, start: int, stop: int):
    """Samples start..stop of a batch-first batch."""
    return _map(batch, lambda t: t[start:stop])


def _to(batch, device):
    return _map(batch, lambda t: t.to(device))


class _BatchCache:
    """make_batch at the largest size asked so far, sliced for smaller ones: the bisection asks
    for sizes below the doubling's failed one, and drawing the mlp's 10^5-10^6 random samples
    on the CPU again for each of them would cost more than the GPU steps. Shapes (the largest
    training sees) are unchanged by slicing; only the values differ, which memory does not see."""

    def __init__(self, workload):
        self.workload = workload
        self.batch, self.size = None, 0

    def get(self, n: int):
        if n > self.size:
            self.batch, self.size = None, 0  # free the old one before drawing the larger
            self.batch, self.size = self.workload.batch(n), n
        return _slice(self.batch, 0, n)


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    """Checkpointing written here, independently of autotune: a Hugging Face model's own switch
    (cache off), else every child with parameters of the outermost ModuleList/Sequential with
    two or more children, non-reentrant, as autotune's docs say it does."""
    if getattr(model, "supports_gradient_checkpointing", False):
        if getattr(model, "config", None) is not None:
            model.config.use_cache = False
        kwargs = {"use_reentrant": False}
        if callable(getattr(model, "activation_checkpointing_enable", None)):  # transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return

    def outermost(module):
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) >= 2:
            return list(module)
        found = []
        for child in module.children():
            found.extend(outermost(child))
        return found

    for block in outermost(model):
        if not any(True for _ in block.parameters()):
            continue
        forward = block.forward

        def run(*args, _forward=forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        block.forward = run


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class ReferenceStep:
    """One steady-state training step, written here and not taken from autotune (the reference
    must not share the probe's bugs): optimizer state allocated up front, then batch, forward
    under autocast, backward (scaled by a GradScaler under fp16), unscale, clip, step, zero_grad."""

    def __init__(self, workload, device_type: str, precision: str, checkpointing: bool):
        self.workload, self.device_type, self.precision = workload, device_type, precision
        # Built on the device: a 1.5 B-parameter model's initialisation on the host would cost
        # more than its timed steps.
        with torch.device(device_type):
            self.model = workload.new_model().to(device_type)
        self.model.train()
        if checkpointing:
            _checkpoint_blocks(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = workload.new_optimizer(self.params)
        # Adam-like optimizers allocate their state lazily, at the first step: take one on zero
        # gradients now, so that every trial measures the steady state.
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.batches = _BatchCache(workload)

    def __call__(self, n: int) -> None:
        batch = _to(self.batches.get(n), self.device_type)
        dtype = AUTOCAST[self.precision]
        # A fresh scaler per step: after an OOM between unscale_ and update an old one refuses
        # the next unscale_.
        scaler = torch.amp.GradScaler(self.device_type) if self.precision == "fp16" else None
        with torch.autocast(self.device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, count = self.workload.loss(self.model, batch)
        if count is not None:
            loss = loss / count
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        # optimizer.step() even under fp16, not scaler.step(): a step the scaler skips for an
        # inf gradient would leave the optimizer's peak unmeasured (values do not matter here).
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def recover(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def exhaustive_max(step: ReferenceStep, device, cap: int, *, limit: int = 1 << 24) -> dict:
    """The largest n whose reference step fits under ``cap``: doubling from 1, then bisection,
    every size a real step (no estimate, no model of memory)."""
    counts = {"steps": 0, "ooms": 0}

    def fits(n: int) -> bool:
        device.release()
        device.reset_peaks()
        failed = False
        try:
            step(n)
        except Exception as exc:  # noqa: BLE001 - an OOM is the answer; anything else is raised
            if not autotune.is_oom_error(exc):
                raise
            failed = True
        counts["steps"] += 1
        if failed:
            # Outside the except block: the traceback no longer pins the failed step's tensors.
            counts["ooms"] += 1
            step.recover()
            device.release()
            return False
        return device.peaks()[1] <= cap

    start = time.perf_counter()
    fit, fail, n = 0, None, 1
    with device.capped(cap):
        while n <= limit:
            if fits(n):
                fit, n = n, n * 2
            else:
                fail = n
                break
        while fail is not None and fail - fit > 1:
            mid = (fit + fail) // 2
            if fits(mid):
                fit = mid
            else:
                fail = mid
    return {"exact": fit, "steps": counts["steps"], "ooms": counts["ooms"],
            "seconds": time.perf_counter() - start, "capped_at_limit": fail is None}


def check_probe_exact(ctx: Context) -> Outcome:
    rows, cut = [], []
    for cell in ctx.config.probe_cells:
        if ctx.out_of_time():
            cut.append(cell.label)
            continue
        if not ctx.device.supports(cell.precision):
            ctx.add_row(row := {"case": cell.label, "status": "skip", "why": f"no {cell.precision}"})
            rows.append(row)
            continue
        row = {"case": cell.label}
        reference = None
        try:
            try:
                result = ctx.probe(cell)
                row.update(found=result.max_micro_batch, probe_steps=len(result.trials),
                           probe_ooms=result.oom_count,
                           probe_seconds=round(ctx.probe_seconds(cell), 2),
                           estimated=result.estimated_max_micro_batch,
                           # The real steps in order ("-" a failure): how the search got there.
                           probe_trials=" ".join(f"{t.micro_batch}{'' if t.fits else '-'}"
                                                 for t in result.trials))
            except autotune.ProbeError as exc:  # nothing fits: right where the search agrees
                row.update(found=0, probe_says=_error_text(exc))
            reference = ReferenceStep(ctx.workload(cell.workload), ctx.device.torch_device,
                                      cell.precision, cell.checkpointing == "on")
            exact = exhaustive_max(reference, ctx.device, cell.card)
            row.update(exact=exact["exact"], exact_steps=exact["steps"], exact_ooms=exact["ooms"],
                       exact_seconds=round(exact["seconds"], 2))
            exact_found = row["found"] == row["exact"] and not exact["capped_at_limit"]
            row["status"] = "pass" if exact_found else "fail"
        except Exception as exc:  # noqa: BLE001 - one case's failure is its row, not the run's end
            row.update(status="error", why=_error_text(exc))
        finally:
            # The next cell's cap must not hold this cell's model and optimizer state.
            reference = None
            ctx.device.release()
        ctx.add_row(row)
        rows.append(row)
    return _tally(rows, cut, "found == exact")


# --- 2. the fake-tensor estimate against measured peaks ------------------------------------------

def _cells_in_time(ctx: Context, cells, cut: list[str]):
    """The cells to run: those reached after the deadline go to ``cut``, and those whose precision
    this device lacks are left out."""
    for cell in cells:
        if ctx.out_of_time():
            cut.append(cell.label)
        elif ctx.device.supports(cell.precision):
            yield cell


def _fitting_trials(ctx: Context, cell: Cell) -> list:
    """The probe's real trials at ``cell`` that fitted (ProbeError where none did)."""
    fitting = [t for t in ctx.probe(cell).trials if t.fits]
    if not fitting:
        raise autotune.ProbeError(f"{cell.label}: no real step fitted, nothing to compare")
    return fitting


def _failed(ctx: Context, rows: list[dict], label: str, exc: Exception) -> None:
    """A case that raised: a skip where no estimate is possible for it, else an error row."""
    status = "skip" if isinstance(exc, autotune.EstimateUnavailable) else "error"
    ctx.add_row(row := {"case": label, "status": status, "why": _error_text(exc)})
    rows.append(row)


def _tensor_estimates(ctx: Context, cell: Cell, sizes: list[int]) -> dict[int, int]:
    """The estimate's tensor bytes at each size: on CUDA ``estimate_cuda_peaks``'s (the foreach
    optimizer path and the cuBLAS workspaces a CUDA step allocates), elsewhere ``estimate_peak``."""
    workload, checkpointing = ctx.workload(cell.workload), cell.checkpointing == "on"
    if ctx.device.torch_device == "cuda":
        peaks = ctx.cuda_peaks(cell.workload, cell.precision, checkpointing, sizes)
        return {n: tensors for n, (tensors, _) in peaks.items()}
    return {n: autotune.estimate_peak(workload, n, precision=cell.precision,
                                      checkpointing=checkpointing) for n in sizes}


def check_estimate(ctx: Context) -> Outcome:
    """At every micro-batch where the probe ran a real step that fitted: the estimate against that
    step's max_memory_allocated (within the tolerance) and max_memory_reserved (within what the
    plan's default headroom leaves for the allocator's cache: estimate / 0.9)."""
    rows, cut = [], []
    tol = ctx.config.tolerance
    for cell in _cells_in_time(ctx, ctx.config.estimate_cells, cut):
        try:
            fitting = _fitting_trials(ctx, cell)
            start = time.perf_counter()
            estimates = _tensor_estimates(ctx, cell, [t.micro_batch for t in fitting])
            seconds = (time.perf_counter() - start) / len(fitting)
            for trial in fitting:
                estimate = estimates[trial.micro_batch]
                allocated = trial.peak_bytes
                reserved = trial.reserved_peak_bytes
                error = estimate / allocated - 1
                # A plan keeps predicted <= 90% of the budget: the cache fits when reserved is
                # at most estimate / 0.9.
                ok = abs(error) <= tol and (reserved is None or reserved <= estimate / (1 - HEADROOM))
                row = {"case": cell.label, "micro_batch": trial.micro_batch, "estimate": gib(estimate),
                       "allocated": gib(allocated), "error": f"{error:+.3%}",
                       "reserved": gib(reserved) if reserved is not None else None,
                       "reserved/estimate": round(reserved / estimate, 4) if reserved else None,
                       "estimate_seconds": round(seconds, 2),
                       "status": "pass" if ok else "fail"}
                ctx.add_row(row)
                rows.append(row)
        except Exception as exc:  # noqa: BLE001 - a case's failure is its row
            _failed(ctx, rows, cell.label, exc)
    return _tally(rows, cut, f"|estimate/allocated - 1| <= {tol:.0%}, reserved <= estimate / "
                             f"{1 - HEADROOM:g}")


# --- 2b. the caching-allocator model against max_memory_reserved (issue 22) ---------------------

def _timed_steps(step: "ReferenceStep", device, n: int, warmup: int, repeats: int) -> dict:
    """``warmup`` steps, then ``repeats`` timed ones (each synchronised): their median seconds,
    and the allocated and reserved peaks of them all from a released cache."""
    device.release()
    device.reset_peaks()
    failed, times = False, []
    try:
        for _ in range(warmup):
            step(n)
        device.synchronize()
        for _ in range(repeats):
            start = time.perf_counter()
            step(n)
            device.synchronize()
            times.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - an OOM is a row; anything else is raised
        if not autotune.is_oom_error(exc):
            raise
        failed = True
    if failed:
        step.recover()
        device.release()
        return {"oom": True}
    allocated, reserved = device.peaks()
    return {"oom": False, "seconds": statistics.median(times), "allocated": allocated,
            "reserved": reserved}


def _settings_in_time(ctx: "Context", cases, cut: list[str]):
    """(case, checkpointing, label) for each case with checkpointing off and on: those reached
    after the deadline go to ``cut``."""
    for case in cases:
        for checkpointing in ("off", "on"):
            label = f"{case.label} ckpt {checkpointing}"
            if ctx.out_of_time():
                cut.append(label)
            else:
                yield case, checkpointing, label


def _case_sizes(ctx: "Context", case: TimeCase) -> list[int]:
    if case.sizes:
        return list(case.sizes)
    largest = ctx.probe(case.cell).max_micro_batch
    return sorted({max(1, largest // 4), max(1, largest // 2), largest})


def _device_name(ctx: "Context") -> str:
    return ctx.device.describe().get("name") or ""


def check_reserved(ctx: Context) -> Outcome:
    """``autotune.estimate_cuda_peaks`` (the fake step with torch's caching allocator modelled
    for this GPU) against the real steps' max_memory_reserved: the estimate cells' probe trials
    (under their card's cap) and the reserved cases' reference steps (uncapped), each within
    ``reserved_tolerance``."""
    rows, cut = [], []
    tol = ctx.config.reserved_tolerance

    def compare(label, checkpointing, measured: dict, modelled: dict, capped: int | None):
        for n, (allocated, reserved) in measured.items():
            if not reserved:  # a device adapter without a reserved counter (the CPU fake's)
                row = {"case": label, "ckpt": checkpointing, "micro_batch": n, "status": "skip",
                       "why": "no reserved peak measured on this device"}
                ctx.add_row(row)
                rows.append(row)
                continue
            tensors, model = modelled[n]
            error = model / reserved - 1
            row = {"case": label, "ckpt": checkpointing, "micro_batch": n,
                   "modelled": gib(model), "reserved": gib(reserved), "error": f"{error:+.3%}",
                   "tensors": gib(tensors), "allocated": gib(allocated),
                   "cap": gib(capped) if capped else None, "status": "pass" if abs(error) <= tol else "fail"}
            ctx.add_row(row)
            rows.append(row)

    for cell in _cells_in_time(ctx, ctx.config.estimate_cells, cut):
        try:
            fitting = _fitting_trials(ctx, cell)
            modelled = ctx.cuda_peaks(cell.workload, cell.precision, cell.checkpointing == "on",
                                      [t.micro_batch for t in fitting])
            compare(cell.label, cell.checkpointing,
                    {t.micro_batch: (t.peak_bytes, t.reserved_peak_bytes or 0) for t in fitting},
                    modelled, cell.card)
        except Exception as exc:  # noqa: BLE001 - a case's failure is its row
            _failed(ctx, rows, cell.label, exc)
    for case, checkpointing, label in _settings_in_time(ctx, ctx.config.reserved_cases, cut):
        try:
            sizes = _case_sizes(ctx, case)
            measured = ctx.measure(case.workload, case.precision, checkpointing == "on", sizes)
            fitted = {n: (m["allocated"], m["reserved"]) for n, m in measured.items() if not m["oom"]}
            modelled = ctx.cuda_peaks(case.workload, case.precision, checkpointing == "on",
                                      sorted(fitted))
            compare(case.label, checkpointing, fitted, modelled, None)
        except Exception as exc:  # noqa: BLE001 - a case's failure is its row
            _failed(ctx, rows, label, exc)
    return _tally(rows, cut, f"|modelled reserved / max_memory_reserved - 1| <= {tol:.0%}")


# --- 2c. predicted step time against measured (issue 22) ------------------------------------------

def check_step_time(ctx: Context) -> Outcome:
    """``autotune.predict_step_time`` for this GPU's bundled profile (datasheet peaks, the cited
    achievable fractions) against the reference step's median wall time, checkpointing off and
    on at three micro-batches per case: each within ``time_tolerance``, and the ranking of all
    the settings by predicted time matching the measured one (Spearman >= ``rank_floor``)."""
    profile = ctx.config.time_profile or profile_for(ctx.device.describe())
    if profile is None:
        return Outcome("skip", f"no bundled GPU profile for {_device_name(ctx)!r}")
    rows, cut, pairs = [], [], []
    tol = ctx.config.time_tolerance
    for case, checkpointing, label in _settings_in_time(ctx, ctx.config.time_cases, cut):
        if not ctx.device.supports(case.precision):
            continue
        try:
            sizes = _case_sizes(ctx, case)
            measured = ctx.measure(case.workload, case.precision, checkpointing == "on", sizes)
            fitted = sorted(n for n, m in measured.items() if not m["oom"])
            predicted = autotune.predict_step_time(
                ctx.workload(case.workload), fitted, precision=case.precision,
                checkpointing=checkpointing == "on", gpu=profile) if fitted else {}
            for n in sizes:
                if measured[n]["oom"]:
                    row = {"case": label, "micro_batch": n, "status": "skip",
                           "why": "out of memory on the whole device"}
                else:
                    seconds, guess = measured[n]["seconds"], predicted[n]
                    error = guess.seconds / seconds - 1
                    parts = {k: round(1e3 * v, 2) for k, v in guess.breakdown.items() if v}
                    row = {"case": label, "micro_batch": n,
                           "predicted_ms": round(1e3 * guess.seconds, 3),
                           "measured_ms": round(1e3 * seconds, 3), "error": f"{error:+.1%}",
                           "breakdown_ms": parts,
                           "status": "pass" if abs(error) <= tol else "fail"}
                    pairs.append((guess.seconds, seconds))
                ctx.add_row(row)
                rows.append(row)
        except Exception as exc:  # noqa: BLE001 - a case's failure is its row
            _failed(ctx, rows, label, exc)
    outcome = _tally(rows, cut, f"|predicted / measured - 1| <= {tol:.0%} on {profile}")
    if len(pairs) >= 3:
        rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
        rows.append({"spearman": round(rho, 4), "settings": len(pairs)})
        outcome.rows = rows
        outcome.summary += f"; Spearman {rho:.3f} over {len(pairs)} settings (need >= {ctx.config.rank_floor:g})"
        if outcome.status == "pass" and not rho >= ctx.config.rank_floor:
            outcome.status = "fail"
    return outcome


# --- 3. 200 optimizer steps of each plan ---------------------------------------------------------

def check_train(ctx: Context) -> Outcome:
    """Each plan trained under its card's cap: every step taken, no OOM (neither the loop's
    recoveries nor the allocator's count), max_memory_reserved within the card, and
    max_memory_allocated at most the plan's prediction plus the tolerance."""
    rows, cut = [], []
    steps, tol = ctx.config.train_steps, ctx.config.tolerance
    accumulating = 0
    for case in ctx.config.train_cases:
        cell = case.cell
        if ctx.out_of_time():
            cut.append(cell.label)
            continue
        if not ctx.device.supports(cell.precision):
            continue
        row = {"case": cell.label}
        try:
            workload = ctx.workload(cell.workload)
            largest = ctx.probe(cell).max_micro_batch
            target = max(1, round(largest * case.factor))
            plan = autotune.plan(workload, target_batch=target, world_size=1,
                                 device=ctx.device.torch_device, memory_limit=cell.card,
                                 precision=cell.precision, checkpointing=cell.checkpointing)
            row.update(target=target, split=f"{plan.micro_batch} x {plan.accumulation_steps}",
                       predicted=gib(plan.predicted_peak_bytes))
            ctx.device.release()
            ooms_before = ctx.device.oom_count()
            ctx.device.reset_peaks()
            start = time.perf_counter()
            with ctx.device.capped(cell.card):
                result = autotune.train(plan, workload, steps=steps, device=ctx.device.torch_device,
                                        progress=False)
            seconds = time.perf_counter() - start
            allocated, reserved = ctx.device.peaks()
            ooms = ctx.device.oom_count() - ooms_before
            loop_peak = max((m.get("peak_memory_bytes") or 0 for m in result.metrics), default=0)
            predicted = plan.predicted_peak_bytes
            row.update(steps=result.steps, ooms=ooms, recoveries=result.oom_recoveries,
                       allocated=gib(allocated), reserved=gib(reserved),
                       **{"allocated/predicted": round(allocated / predicted, 4),
                          "reserved/predicted": round(reserved / predicted, 4),
                          "loop_peak/predicted": round(loop_peak / predicted, 4)},
                       seconds=round(seconds, 1))
            ok = (result.steps == steps and ooms == 0 and result.oom_recoveries == 0
                  and reserved <= cell.card and allocated <= predicted * (1 + tol))
            row["status"] = "pass" if ok else "fail"
            if result.interrupted and not ok:
                # The loop stops gracefully on SIGTERM (an outer timeout's, say): cut, not failed.
                row.update(status="cut", why=f"interrupted by a signal after step {result.steps}")
            accumulating += plan.accumulation_steps >= 2
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", why=_error_text(exc))
        finally:
            result = None  # the trained model and optimizer state, before the next case's cap
            ctx.device.release()
        ctx.add_row(row)
        rows.append(row)
    outcome = _tally(rows, cut, f"{steps} steps, 0 OOMs, allocated <= predicted x {1 + tol:g}")
    if outcome.status == "pass" and not accumulating:
        outcome.status = "fail"
        outcome.summary += "; no plan accumulated (the issue asks for accumulation >= 2)"
    return outcome


# --- 4. the built-in loop's overhead -------------------------------------------------------------

def _hand_written_steps(workload, plan, device_type: str, steps: int) -> list[float]:
    """What a careful user writes for the same plan: make_batch of the window, micro-batches cut
    from it, autocast, each micro-batch's loss weighted by its share of the window's samples (a
    (loss_sum, count) loss divided by its own count first: a timing reference, not exact
    accumulation), a GradScaler under fp16, clipping, step, one loss.item() per step."""
    torch.manual_seed(0)
    model = workload.new_model().to(device_type)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = workload.new_optimizer(params)
    if plan.lr.lr:
        for group in optimizer.param_groups:
            group["lr"] = plan.lr.lr
    dtype = AUTOCAST[str(plan.precision)]
    scaler = torch.amp.GradScaler(device_type) if dtype is torch.float16 else None
    sizes = list(plan.micro_batches)
    window = sum(sizes)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = workload.batch(window)  # a new window each step, as the loop's batches are
        losses, offset = [], 0
        for size in sizes:
            piece = _to(_slice(batch, offset, offset + size), device_type)
            offset += size
            with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss, count = workload.loss(model, piece)
            loss = (loss if count is None else loss / count) * (size / window)
            (scaler.scale(loss) if scaler else loss).backward()
            losses.append(loss.detach())
        if scaler:
            scaler.unscale_(optimizer)
        if plan.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, plan.clip_grad_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(torch.stack(losses).sum().item())  # the per-step sync every loop has
        times.append(time.perf_counter() - start)
    return times


def check_overhead(ctx: Context) -> Outcome:
    """The loop's median step time (its metrics' samples/s) against the hand-written loop's,
    alternating whole runs for ``rounds`` rounds so that drift hits both."""
    spec = ctx.config.overhead
    workload = ctx.workload(spec["workload"])
    micro, accum = spec["micro_batch"], spec["accumulation"]
    plan = autotune.plan(workload, target_batch=micro * accum, world_size=1, micro_batch=micro,
                         device=ctx.device.torch_device, precision=spec["precision"],
                         checkpointing="off")
    ours, hand, rows = [], [], []
    warmup = spec["warmup"]
    for round_index in range(spec["rounds"]):
        if ctx.out_of_time() and round_index:
            break
        result = autotune.train(plan, workload, steps=spec["steps"], device=ctx.device.torch_device,
                                progress=False)
        loop_times = [plan.effective_batch / m["samples_per_s"] for m in result.metrics]
        del result
        ctx.device.release()
        hand_times = _hand_written_steps(workload, plan, ctx.device.torch_device, spec["steps"])
        ctx.device.release()
        ours += loop_times[warmup:]
        hand += hand_times[warmup:]
        row = {"round": round_index + 1, "split": f"{plan.micro_batch} x {plan.accumulation_steps}",
               "ours_ms": round(1e3 * statistics.median(loop_times[warmup:]), 3),
               "hand_ms": round(1e3 * statistics.median(hand_times[warmup:]), 3)}
        ctx.add_row(row)
        rows.append(row)
    ratio = statistics.median(ours) / statistics.median(hand)
    limit = ctx.config.overhead_limit
    summary = (f"{spec['workload']} {spec['precision']} {micro} x {accum}: median step "
               f"{1e3 * statistics.median(ours):.2f} ms ours, {1e3 * statistics.median(hand):.2f} ms "
               f"hand-written, ratio {ratio:.3f} (need <= {limit:g})")
    rows.append({"ratio": round(ratio, 4)})
    return Outcome("pass" if ratio <= limit else "fail", summary, rows)


# --- 5. autotune verify on a --gpu plan ----------------------------------------------------------

def check_verify(ctx: Context) -> Outcome:
    """`autotune plan --gpu PROFILE` (memory estimated on fake tensors for a card not here), then
    `autotune verify` of it on this device capped to that card: exit 0 means confirmed."""
    rows, cut = [], []
    folder = ctx.report.folder / "verify"
    folder.mkdir(parents=True, exist_ok=True)
    for case in ctx.config.verify_cases:
        label = f"{case.workload} --gpu {case.profile} @ {gib(case.card)}"
        if ctx.out_of_time():
            cut.append(label)
            continue
        plan_path = folder / f"{case.workload}-{case.profile}.json"
        model = str(workload_path(case.workload))
        made = run_command(autotune_cli("plan", model, "--gpu", case.profile, "--target-batch",
                                        str(case.target_batch), "-o", str(plan_path), "--quiet"),
                           timeout=ctx.left())
        row = {"case": label, "plan_rc": made.rc, "plan_seconds": round(made.seconds, 1)}
        if made.rc == 0:
            plan = autotune.load_plan(plan_path)
            row.update(split=f"{plan.micro_batch} x {plan.accumulation_steps}",
                       precision=str(plan.precision), predicted=gib(plan.predicted_peak_bytes))
            checked = run_command(autotune_cli("verify", str(plan_path), "--device",
                                               ctx.device.torch_device, "--memory-limit",
                                               str(case.card), "--quiet"), timeout=ctx.left())
            row.update(verify_rc=checked.rc, verify_seconds=round(checked.seconds, 1),
                       verify_says=_last_lines(checked.output, 3))
            row["status"] = "pass" if checked.rc == 0 else "cut" if checked.timed_out else "fail"
        else:
            row.update(status="cut" if made.timed_out else "error", why=_last_lines(made.output, 5))
        ctx.add_row(row)
        rows.append(row)
    return _tally(rows, cut, "autotune verify exits 0")


# --- 6. two ranks: NCCL DDP and FSDP2 ------------------------------------------------------------

def check_multi_gpu(ctx: Context) -> Outcome:
    count = ctx.device.count()
    if count < 2:
        return Outcome("skip", f"{count} CUDA device: the 2-rank NCCL DDP and FSDP2 runs need 2")
    spec = ctx.config.multi
    rows, cut = [], []
    folder = ctx.report.folder / "multi_gpu"
    folder.mkdir(parents=True, exist_ok=True)
    model = str(workload_path(spec["workload"]))
    for sharding in spec["shardings"]:
        label = f"{spec['workload']} {sharding} 2 ranks"
        if ctx.out_of_time():
            cut.append(label)
            continue
        plan_path, metrics = folder / f"plan-{sharding}.json", folder / f"metrics-{sharding}.jsonl"
        made = run_command(autotune_cli(
            "plan", model, "--target-batch", str(spec["target_batch"]), "--world-size", "2",
            "--sharding", sharding, "--precision", spec["precision"], "--device", ctx.device.torch_device,
            "--memory-limit", str(spec["card"]), "-o", str(plan_path), "--quiet"), timeout=ctx.left())
        row = {"case": label, "plan_rc": made.rc}
        if made.rc != 0:
            row.update(status="cut" if made.timed_out else "error", why=_last_lines(made.output, 5))
        else:
            plan = autotune.load_plan(plan_path)
            metrics.unlink(missing_ok=True)
            trained = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node=2", "-m", "autotune", "train", model, "--plan",
                                   str(plan_path), "--steps", str(spec["steps"]), "--metrics",
                                   str(metrics), "--quiet"], timeout=ctx.left())
            records = _read_jsonl(metrics)
            peak = max((r.get("peak_memory_bytes") or 0 for r in records), default=0)
            reserved = max((r.get("reserved_peak_bytes") or 0 for r in records), default=0)
            recoveries = max((r.get("oom_recoveries") or 0 for r in records), default=0)
            predicted = plan.predicted_peak_bytes
            row.update(split=f"{plan.micro_batch} x {plan.accumulation_steps}", train_rc=trained.rc,
                       steps=len(records), recoveries=recoveries, predicted=gib(predicted),
                       peak=gib(peak), reserved=gib(reserved),
                       **{"peak/predicted": round(peak / predicted, 4) if predicted else None},
                       seconds=round(trained.seconds, 1))
            ok = (trained.rc == 0 and len(records) == spec["steps"] and recoveries == 0
                  and peak <= predicted * (1 + ctx.config.tolerance))
            row["status"] = "pass" if ok else "cut" if trained.timed_out else "fail"
            if not ok:
                row["says"] = _last_lines(trained.output, 5)
        ctx.add_row(row)
        rows.append(row)
    return _tally(rows, cut, f"rc 0, {spec['steps']} steps, no recoveries, peak <= predicted")


# --- 7. the tests marked gpu ---------------------------------------------------------------------

def check_pytest_gpu(ctx: Context) -> Outcome:
    ctx.device.release()  # the subprocess wants the memory this process cached
    done = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *ctx.config.pytest_args], timeout=ctx.left())
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)",
                                               _last_lines(done.output, 3))}
    counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    row = {"rc": done.rc, **counts, "seconds": round(done.seconds, 1),
           "tail": _last_lines(done.output, 2)}
    ctx.add_row(row)
    if done.timed_out:
        return Outcome("cut", f"pytest {' '.join(ctx.config.pytest_args)} ran out of time", [row])
    ok = done.rc == 0 and counts.get("passed", 0) > 0
    summary = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
               f"{counts['errors']} errors, {counts.get('skipped', 0)} skipped (rc {done.rc})")
    return Outcome("pass" if ok else "fail", summary, [row])


# Shares first sized from CPU timings; on the H200 (2026-12-04) the probe matrix took 280 s of a
# 330 s budget for two cells and left the later checks nothing, so it gets less, and the checks
# no other run measures (step time, the gpu-marked tests) more.
CHECKS = [
    Check("probe_exact", "the probe against an exhaustive bisection over real steps", 0.22,
          check_probe_exact),
    Check("estimate", "the fake-tensor estimate against measured allocated and reserved peaks", 0.04,
          check_estimate),
    Check("reserved", "the caching-allocator model against measured max_memory_reserved", 0.06,
          check_reserved),
    Check("step_time", "predicted step time for this GPU's profile against measured, and the "
          "ranking", 0.16, check_step_time),
    Check("train_200", "200 optimizer steps of each plan under its card's cap: 0 OOMs, peaks vs "
          "the plan's prediction", 0.14, check_train),
    Check("loop_overhead", "the built-in loop's step time against a hand-written loop (ratio)", 0.05,
          check_overhead),
    Check("verify_profile", "`autotune verify` on a plan made with --gpu for the card's profile",
          0.12, check_verify),
    Check("multi_gpu", "2-rank NCCL DDP and FSDP2 runs against the plan (skip on one GPU)", 0.08,
          check_multi_gpu, applies=lambda ctx: ctx.device.count() >= 2),
    Check("pytest_gpu", "the tests marked gpu (`pytest -m gpu`), in a subprocess", 0.13,
          check_pytest_gpu),
]


# --- running and reporting -----------------------------------------------------------------------

@dataclasses.dataclass
class Completed:
    rc: int | None
    output: str
    seconds: float
    timed_out: bool = False


def run_command(argv: list[str], *, timeout: float, cwd: Path = ROOT) -> Completed:
    """Run a command with stdout and stderr together; past ``timeout`` its whole process group
    is killed (torchrun's ranks too) and rc is None."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=max(1.0, timeout))
        return Completed(process.returncode, output, time.perf_counter() - start)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        output, _ = process.communicate()
        return Completed(None, output or "", time.perf_counter() - start, timed_out=True)
    except BaseException:  # Stopped (SIGTERM): no orphaned ranks left holding the GPU
        _kill_group(process)
        raise


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def autotune_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "autotune", *args]


class Report:
    """report.json and report.md in the output folder, rewritten after every case."""

    def __init__(self, folder: Path, meta: dict):
        self.folder = folder
        self.meta = meta
        self.checks: list[dict] = []
        self.current: str | None = None

    def write_partial(self, rows: list[dict]) -> None:
        self.write(running={"check": self.current, "rows": rows})

    def write(self, running: dict | None = None) -> None:
        data = {"meta": self.meta, "checks": self.checks, "running": running,
                "exit_code": exit_code(self.checks) if running is None else None}
        _write_text(self.folder / "report.json", json.dumps(data, indent=2, default=str) + "\n")
        _write_text(self.folder / "report.md", markdown(data))


def _write_text(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)  # a run killed mid-write keeps the previous report whole


def markdown(data: dict) -> str:
    meta = data["meta"]
    device = meta.get("device") or {}
    lines = [f"GPU proof, {meta.get('started')}, commit {meta.get('commit')}, torch {meta.get('torch')}"
             f" (CUDA {device.get('cuda')}), {device.get('count')} x {device.get('name')} "
             f"({gib(device.get('total_bytes'))}); budget {meta.get('budget_seconds')} s, "
             f"`{meta.get('command')}`", "",
             "| check | status | seconds | result |", "| --- | --- | ---: | --- |"]
    for check in data["checks"]:
        lines.append(f"| {check['name']} | {check['status']} | {check['seconds']:.0f} | "
                     f"{_cell(check['summary'])} |")
    if data.get("running"):
        lines.append(f"| {data['running']['check']} | running | | (cut short here) |")
    sections = [(c["name"], c["rows"]) for c in data["checks"] if c["rows"]]
    if data.get("running") and data["running"]["rows"]:
        sections.append((data["running"]["check"] + " (cut short)", data["running"]["rows"]))
    for name, rows in sections:
        keys = list(dict.fromkeys(k for row in rows for k in row))
        lines += ["", f"### {name}", "", "| " + " | ".join(keys) + " |",
                  "|" + " --- |" * len(keys)]
        lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    if data.get("exit_code") is not None:
        lines += ["", f"exit code {data['exit_code']}"]
    return "\n".join(lines) + "\n"


def exit_code(checks: list[dict]) -> int:
    """0 only where every check holds (passes, or does not apply here)."""
    return 0 if checks and all(c["status"] in HOLDING for c in checks) else 1


def _tally(rows: list[dict], cut: list[str], criterion: str) -> Outcome:
    """A check over cases: it holds when every case ran and every case that applies passed.
    ``cut``: the cases the time budget left out (a row whose command ran out of time is one)."""
    cut = cut + [r.get("case", "?") for r in rows if r.get("status") == "cut"]
    total = len(cut) + sum(r.get("status") != "cut" for r in rows)
    bad = [r.get("case", "?") for r in rows if r.get("status") in ("fail", "error")]
    passed = sum(r.get("status") == "pass" for r in rows)
    summary = f"{passed}/{total} cases pass ({criterion})"
    if bad:
        summary += "; failed: " + ", ".join(bad)
    if cut:
        return Outcome("cut", summary + f"; not run, out of time: {', '.join(cut)}", rows)
    if bad:
        return Outcome("fail", summary, rows)
    if not passed:
        return Outcome("skip", summary + "; none applies here", rows)
    return Outcome("pass", summary, rows)


def run_checks(ctx: Context, names: list[str]) -> list[dict]:
    chosen = [c for c in CHECKS if c.name in names]
    width = max(len(c.name) for c in chosen)
    ctx.log(f"{'check':<{width}}  status  seconds  result", flush=True)
    for index, check in enumerate(chosen):
        left = ctx.deadline - time.monotonic()
        shares = sum(c.share for c in chosen[index:] if c.applies(ctx))
        share = check.share if check.applies(ctx) else 0.0
        ctx.check_deadline = time.monotonic() + (left * share / shares if shares else 0.0)
        ctx.rows = []
        ctx.report.current = check.name
        ctx.log(f"  {check.name}: {check.title} (up to {max(0, ctx.left()):.0f} s)", flush=True)
        start = time.perf_counter()
        try:
            if left <= 0:
                outcome = Outcome("cut", "not run: the time budget was spent")
            else:
                outcome = check.run(ctx)
        except Stopped:
            outcome = Outcome("cut", "stopped by a signal while running", ctx.rows)
            _record(ctx, check, outcome, start, width)
            raise
        except Exception as exc:  # noqa: BLE001 - a check's crash is its row; the others still run
            outcome = Outcome("error", _error_text(exc), ctx.rows)
            outcome.rows = ctx.rows + [{"traceback": traceback.format_exc(limit=8)}]
        finally:
            with contextlib.suppress(Exception):
                ctx.device.release()
        _record(ctx, check, outcome, start, width)
    return ctx.report.checks


def _record(ctx: Context, check: Check, outcome: Outcome, start: float, width: int) -> None:
    seconds = time.perf_counter() - start
    ctx.report.checks.append({"name": check.name, "title": check.title, "status": outcome.status,
                              "seconds": round(seconds, 1), "summary": outcome.summary,
                              "rows": outcome.rows})
    ctx.report.current = None
    ctx.report.write()
    ctx.log(f"{check.name:<{width}}  {outcome.status:<6}  {seconds:7.1f}  {outcome.summary}", flush=True)


# --- command line --------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'16GiB', '512MiB', '16G' or bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise autotune.ConfigError(f"--cards: {text!r} is not a size such as 16GiB or 512MiB")
    value, unit = float(match.group(1)), match.group(2).upper()
    size = int(value * (1 << (10 * "_KMGT".index(unit or "_"))) if unit else value)
    if size <= 0:
        raise autotune.ConfigError(f"--cards: {text!r} must be more than 0 bytes")
    return size


def gib(n) -> str | None:
    if n is None:
        return None
    if n % (1 << 20) == 0:  # card sizes: "16 GiB", "512 MiB"
        return f"{n // GiB} GiB" if n % GiB == 0 else f"{n >> 20} MiB"
    return f"{n / GiB:.3f} GiB" if n >= GiB / 4 else f"{n / (1 << 20):.2f} MiB"


def _text(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _cell(value) -> str:
    return _text(value).replace("|", "\\|").replace("\n", " ")


def _last_lines(text: str, count: int) -> str:
    return " / ".join(line.strip() for line in (text or "").strip().splitlines()[-count:])


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:400]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


def _commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def listing(config: Config) -> str:
    lines = ["checks (in the order they run; --checks NAME,NAME picks some):"]
    lines += [f"  {c.name:<15} {c.title}" for c in CHECKS]
    lines += ["", f"{'full matrix' if config.full else 'default subset'} "
              f"(cards {', '.join(gib(c) for c in config.cards)}; --full for every example x "
              f"precision x checkpointing x card):"]
    lines += [f"  probe_exact/estimate: {c.label}" for c in config.probe_cells]
    lines += [f"  train_200: {t.cell.label}, target {t.factor:g} x the probe's answer"
              for t in config.train_cases]
    lines += [f"  reserved: {c.label} ckpt off/on at {', '.join(map(str, c.sizes)) or 'the probe'}"
              for c in config.reserved_cases]
    lines += [f"  step_time: {c.label} ckpt off/on at "
              f"{', '.join(map(str, c.sizes)) if c.sizes else 'the ' + c.cell.label + ' probe answer, /2, /4'}"
              for c in config.time_cases]
    o = config.overhead
    lines += [f"  loop_overhead: {o['workload']} {o['precision']} {o['micro_batch']} x "
              f"{o['accumulation']}, {o['rounds']} rounds of {o['steps']} steps"]
    lines += [f"  verify_profile: {v.workload} --gpu {v.profile} @ {gib(v.card)}, target {v.target_batch}"
              for v in config.verify_cases]
    m = config.multi
    lines += [f"  multi_gpu: {m['workload']} {m['precision']} target {m['target_batch']} @ "
              f"{gib(m['card'])}, {', '.join(m['shardings'])}, {m['steps']} steps"]
    lines += [f"  pytest_gpu: pytest {' '.join(config.pytest_args)}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-proof"),
                        help="folder for report.json, report.md and the plans (default: gpu-proof)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--checks", default=",".join(c.name for c in CHECKS),
                        help="comma-separated checks to run (default: all)")
    parser.add_argument("--budget-seconds", type=float, default=420.0,
                        help="stop starting work after this many seconds (default: 420)")
    parser.add_argument("--cards", default="16GiB,24GiB,40GiB",
                        help="emulated card sizes (default: 16GiB,24GiB,40GiB)")
    parser.add_argument("--full", action="store_true",
                        help="every example x precision x checkpointing x card (needs far more time)")
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="allowed relative error of predictions (default: 0.03)")
    parser.add_argument("--overhead-limit", type=float, default=1.03,
                        help="largest loop/hand-written step time ratio that passes (default: 1.03)")
    return parser


def configure(args) -> Config:
    cards = [parse_size(c) for c in args.cards.split(",") if c.strip()]
    if not cards:
        raise autotune.ConfigError("--cards: give at least one size, such as 16GiB")
    unknown = sorted(set(args.checks.split(",")) - {c.name for c in CHECKS})
    if unknown:
        raise autotune.ConfigError(f"--checks: unknown {', '.join(unknown)}; --list shows the checks")
    if args.train_steps < 1 or args.budget_seconds <= 0 or args.tolerance < 0 or args.overhead_limit <= 0:
        raise autotune.ConfigError("--train-steps, --budget-seconds and --overhead-limit must be "
                                   "positive, --tolerance not negative")
    config = default_config(cards, full=args.full)
    config.train_steps, config.tolerance = args.train_steps, args.tolerance
    config.overhead_limit, config.budget_seconds = args.overhead_limit, args.budget_seconds
    return config


def main(argv: list[str] | None = None, *, device=None, config: Config | None = None) -> int:
    """``device`` and ``config`` replace the CUDA adapter and the configuration the arguments
    give (the tests run every check on the CPU that way)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        config = config or configure(args)
    except autotune.AutotuneError as exc:
        print(f"gpu_proof: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        print(listing(config))
        return 0
    device = device or CudaDevice()
    if not device.available():
        print(f"gpu_proof: no CUDA device here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}): nothing to prove; run it where a GPU is")
        return 2
    names = [n for n in args.checks.split(",") if n]
    try:
        if args.out.exists() and not args.out.is_dir():
            raise autotune.OutputError(f"--out {args.out} is a file; give a folder")
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"gpu_proof: error: {exc}", file=sys.stderr)
        return 2
    meta = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _commit(),
            "torch": torch.__version__, "autotune": autotune.__version__, "device": device.describe(),
            "budget_seconds": config.budget_seconds, "full": config.full,
            "cards": [gib(c) for c in config.cards], "checks": names,
            "command": "python bench/gpu_proof.py " + " ".join(argv)}
    report = Report(args.out, meta)
    ctx = Context(device, config, report)
    print(f"gpu_proof: {meta['device'].get('count')} x {meta['device'].get('name')}, torch "
          f"{meta['torch']}, budget {config.budget_seconds:g} s; report in {args.out}", flush=True)

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        checks = run_checks(ctx, names)
    except Stopped as exc:
        print(f"gpu_proof: stopped by {exc}; the report holds what was measured", flush=True)
        report.write()
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = exit_code(checks)
    print(f"gpu_proof: {'every check holds' if code == 0 else 'not every check holds'} "
          f"(exit {code}); {args.out / 'report.md'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
