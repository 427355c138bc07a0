"""The largest evaluation micro-batch: forward only, under ``torch.no_grad``, model in ``eval()``.

Evaluation runs while training is under way: parameters, buffers and the optimizer state are
alive (gradients were zeroed with ``set_to_none``), so an eval trial is the probe's session with
the optimizer state allocated, then the model file's loss (the forward the loop runs) under
``no_grad`` and the precision's autocast, nothing stepped. ``probe_eval`` searches it like the
training probe: on fake tensors first where the model allows (``EstimateSession``), then with
real forwards from that answer (a fit at n and a failure at n + 1 prove it), against the budget
less the plan's headroom.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..memory.base import MemoryBackend
from ..memory.fake import EstimateMemoryBackend, EstimateUnavailable, fake_tensor_limits, on_fake_tensors
from ..precision import Precision, autocast
from ..units import format_bytes
from ..workload.contract import Workload, move_batch
from .estimate import EstimateSession
from .result import Trial
from .search import search_largest_fitting
from .trial import SetupOutOfMemory, TrialSession


@dataclass(kw_only=True)
class EvalProbe:
    """What ``probe_eval`` found."""

    max_micro_batch: int
    """The largest eval micro-batch whose forward fits within ``limit_bytes`` (0: none)."""
    trials: list[Trial]
    """The forwards that decided it (real ones on a real device)."""
    limit_bytes: int
    estimated_max_micro_batch: int | None = None
    """The fake-tensor search's answer (None: not estimated, see ``note``)."""
    capped: bool = False
    note: str = ""


class _EvalForward:
    """Turns a session's trial into one eval forward (mixed in before the session class)."""

    def _setup(self):
        super()._setup()
        self.gradient_bytes = 0  # an eval forward makes none

    def _window(self, sizes: list[int]) -> tuple[int, int]:
        self.model.eval()
        try:
            with torch.no_grad():
                batch = move_batch(self.workload.batch(sizes[-1]), self.device)
                with autocast(self.precision, self.device):
                    output = self.workload.loss(self.model, batch)
                del output, batch
        finally:
            self.model.train()
        peak = self.backend.peak_bytes()
        return peak, peak


class EvalSession(_EvalForward, TrialSession):
    pass


class EvalEstimateSession(_EvalForward, EstimateSession):
    pass


def probe_eval(workload: Workload, backend: MemoryBackend, *, precision: Precision,
               limit_bytes: int, upper: int | None = None, use_estimate: bool = True) -> EvalProbe:
    """The largest eval micro-batch (at most ``upper``) whose forward peaks within
    ``limit_bytes`` on ``backend``: exact, proved by forwards at n (fits) and n + 1 (does not)."""
    estimated, note = None, ""
    if use_estimate and not isinstance(backend, EstimateMemoryBackend):
        estimator = EstimateMemoryBackend(backend.info().budget_bytes,
                                          for_cuda=backend.device.type == "cuda")
        try:
            estimated = _search(on_fake_tensors(workload, foreach=estimator.for_cuda), estimator,
                                EvalEstimateSession, precision, limit_bytes, upper, None,
                                fake_tensor_limits(workload))[0]
        except EstimateUnavailable as exc:
            note = f"no fake-tensor estimate of the eval forward ({exc}); real forwards only"
    if isinstance(backend, EstimateMemoryBackend):
        session_type, run_workload, limits = (EvalEstimateSession, on_fake_tensors(workload, foreach=backend.for_cuda),
                                              fake_tensor_limits(workload))
    else:
        session_type, run_workload, limits = EvalSession, workload, None
    best, trials = _search(run_workload, backend, session_type, precision, limit_bytes, upper,
                           estimated, limits)
    proof = (f"forward only under no_grad, model in eval(), optimizer state alive: micro-batch "
             f"{best} fits within {format_bytes(limit_bytes)}")
    if upper is not None and best == upper:
        proof += f" (the cap, {upper})"
    elif trials and not trials[-1].fits:
        proof += f", {trials[-1].micro_batch} does not"
    if estimated is not None:
        proof += f"; the fake-tensor estimate said {estimated}, {len(trials)} forward(s) proved it"
    return EvalProbe(max_micro_batch=best, trials=trials, limit_bytes=limit_bytes,
                     estimated_max_micro_batch=estimated, capped=upper is not None and best == upper,
                     note="; ".join(filter(None, [proof, note])))


def _search(workload, backend, session_type, precision, limit_bytes, upper, hint, limits):
    session = session_type(workload, backend, precision=precision, checkpointing=False)

    def run(n: int) -> Trial:
        trial = session.run(n)
        return dataclasses.replace(trial, fits=trial.fits and trial.peak_bytes <= limit_bytes)

    try:
        with limits if limits is not None else contextlib.nullcontext(), session:
            best, trials, _ = search_largest_fitting(run, budget=limit_bytes, upper=upper, hint=hint)
    except SetupOutOfMemory:
        return 0, []
    return best, trials


__all__ = ["EvalProbe", "EvalSession", "probe_eval"]
