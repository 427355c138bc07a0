"""Where the probe starts: the same search, run first on fake tensors (nothing allocated).

The estimate backend counts the storage bytes of the very step a real trial runs, so its answer
is usually the real one; the real search then only has to prove it (a fit at the answer and a
failure one above). Where the estimate is off the real search continues from the bracket those
trials left, so the answer stays exact. Models that fake tensors cannot run give no estimate,
and the real search runs as it would without one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import EstimateUnavailable
from ..memory.base import MemoryBackend
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits, on_fake_tensors
from ..precision import Precision
from .. import progress
from .result import UNESTIMATED, MemoryModel, Trial, setting_label
from .share import search_with_share, window_steps
from .trial import SetupOutOfMemory, TrialSession


@dataclass(kw_only=True)
class EstimateSeed:
    """What the search on fake tensors found, for the real search to start from."""

    answer: int | None = None
    """Estimated largest micro-batch that fits (0: not even 1); None when there is no estimate."""
    steps: int = 0
    """Training steps run on fake tensors."""
    seconds: float = 0.0
    model: MemoryModel | None = None
    """The memory model fitted to the estimated trials."""
    unavailable: str | None = None
    """Why the model cannot be estimated (the EstimateUnavailable message)."""
    share_fits: bool | None = None
    """Whether one step at the probe's share fitted on fake tensors (None: not tried)."""
    curve: bool = True
    """Whether ``model`` is in the real trials' units, so that the real search may rescale it.
    Not for a CUDA device: the estimate's peaks are the modelled allocator's reserved bytes,
    which stop growing near the budget (the allocator frees its cache and retries), where a real
    trial's peak is the tensors' max_memory_allocated. A flat curve rescaled to a real step at
    micro-batch 1 sent mlp's next real step to 16777216 samples (H200, 2026-12-04)."""

    @property
    def hint(self) -> int | None:
        return self.answer

    @property
    def estimate(self):
        """The estimated peak at n (the memory model fitted to the fake trials), for the real
        search to rescale once a real step has fitted; None without one."""
        if self.model is None or self.model.points < 2 or not self.curve:
            return None
        return self.model.predict

    def note(self, best: int, trials: list[Trial]) -> str:
        """One line for ProbeResult.notes: what the estimate said and what the real trials found."""
        if self.answer is None:
            return f"{UNESTIMATED}: {self.unavailable}"
        said = (f"the estimate ({self.steps} steps on fake tensors, {self.seconds:.1f}s, nothing "
                f"allocated) put the answer at {self.answer}")
        if best == self.answer:
            return f"{said}; {len(trials)} real trial(s) confirmed it"
        return (f"{said}; the real answer is {best} (off by {best - self.answer:+d}), found with "
                f"{len(trials)} real trials")

    def memory_model(self, trials: list[Trial], measured: MemoryModel) -> MemoryModel:
        """The memory model for the planner's predictions below the answer.

        Where the real trials fitted at one micro-batch only, their model is a ray from the
        baseline, which under-predicts below that point when part of the memory does not grow
        with n. The estimate's curve, scaled to agree with the real peak there, keeps its shape.
        """
        fitting = {t.micro_batch: t.peak_bytes for t in trials if t.fits}
        if self.estimate is None or len(fitting) != 1:
            return measured
        (n, real), = fitting.items()
        estimated = self.model.predict(n)
        if estimated <= 0:
            return measured
        return _scaled(self.model, real / estimated)


def estimate_seed(workload, backend: MemoryBackend, *, precision: Precision, checkpointing,
                  upper: int | None, share: int | None = None) -> EstimateSeed:
    """Run the probe's search on fake tensors, against the real backend's budget."""
    budget = backend.info().budget_bytes
    # A CUDA step runs the optimizer's foreach path; estimate that one.
    # (In the child process of probing/isolated.py the backend is the estimate's own.)
    for_cuda = backend.device.type == "cuda" or getattr(backend, "for_cuda", False)
    estimator = EstimateMemoryBackend(budget, for_cuda=for_cuda)
    session = TrialSession(on_fake_tensors(workload, foreach=estimator.for_cuda), estimator,
                           precision=precision, checkpointing=checkpointing)
    started = time.perf_counter()
    try:
        setting = setting_label(precision, checkpointing)
        with (fake_tensor_limits(workload), session,
              progress.bar(f"estimate {setting}", unit=" step") as shown):
            run = progress.watch_trials(
                lambda n: session.run(n, window=window_steps(n, share)), shown, fake=True)
            best, trials, model = search_with_share(run, budget=budget, upper=upper, share=share)
    except SetupOutOfMemory:
        best, trials, model = 0, [], None
    except EstimateUnavailable as exc:
        return EstimateSeed(unavailable=str(exc))
    share_trial = next((t for t in trials if share is not None and t.micro_batch == share), None)
    return EstimateSeed(answer=best, steps=len(trials), seconds=time.perf_counter() - started,
                        model=model, share_fits=share_trial.fits if share_trial else None,
                        curve=not for_cuda)


def _scaled(model: MemoryModel, factor: float) -> MemoryModel:
    return MemoryModel(activation=tuple(c * factor for c in model.activation),
                       step=tuple(c * factor for c in model.step), kind=model.kind,
                       points=model.points)
