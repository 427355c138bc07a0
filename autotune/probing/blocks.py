"""Selective checkpointing: how many repeated blocks a micro-batch needs checkpointed.

``learn_block_model`` learns what each checkpointed block saves from steps on fake tensors
(nothing allocated); the planner predicts the peak for any count K from it. ``prove_fewest_blocks``
then proves a count with real trials at one micro-batch, as the probe proves micro-batches: K
fits within the limit and K - 1 does not (walking from the predicted K when it was wrong).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from ..errors import EstimateUnavailable
from ..memory.base import MemoryBackend
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits, on_fake_tensors
from ..precision import Precision
from ..distributed.sharding.settings import Sharding
from .affine_blocks import layout_session
from .estimate import EstimateSession
from .result import BlockModel, Trial
from .trial import SetupOutOfMemory, TrialSession


def learn_block_model(workload, backend: MemoryBackend, *, precision: Precision,
                      micro_batches: tuple[int, ...]) -> BlockModel | None:
    """The per-block saving at the given micro-batches (one or two), from the activation peaks of
    steps on fake tensors with 0, 1 and all N blocks checkpointed. None when the model has no
    repeated blocks or cannot run on fake tensors."""
    estimator = EstimateMemoryBackend(None, for_cuda=backend.device.type == "cuda")
    sizes = sorted(set(micro_batches))
    peaks: dict[tuple[int, int], int] = {}
    try:
        with _session(on_fake_tensors(workload, foreach=estimator.for_cuda), estimator, EstimateSession,
                      precision, False) as session, fake_tensor_limits(workload), session:
            total = session.total_blocks
            if total < 1:
                return None
            for n in sizes:
                for blocks in sorted({0, 1, total}):
                    session.set_checkpointing(blocks)
                    peaks[n, blocks] = session.run(n).activation_peak_bytes
    except EstimateUnavailable:
        return None

    def saving(n):
        return peaks[n, 0] - peaks[n, 1]

    def last_block(n):  # what K = N costs beyond N savings: its last block is rerun first
        return peaks[n, total] - (peaks[n, 0] - total * saving(n))

    return BlockModel(total_blocks=total, saving=_line(sizes, saving), last_block=_line(sizes, last_block))


def _line(sizes: list[int], value) -> tuple[float, float]:
    """(intercept, slope) through the values at one or two micro-batches (one: through zero)."""
    if len(sizes) == 1:
        return 0.0, value(sizes[0]) / sizes[0]
    low, high = sizes[0], sizes[-1]
    slope = (value(high) - value(low)) / (high - low)
    return value(low) - slope * low, slope


def _session(workload, backend, session_type, precision, checkpointing):
    # Replicated; on fake tensors identical blocks are measured on few of them.
    return layout_session(workload, backend, session_type=session_type, precision=precision,
                          checkpointing=checkpointing, sharding=Sharding.DDP, world_size=1,
                          shard_group=None)


@dataclass(kw_only=True)
class BlocksProof:
    """Real trials at one micro-batch with different numbers of checkpointed blocks."""

    micro_batch: int
    total_blocks: int
    blocks: int | None = None
    """The fewest blocks whose step stays within the limit (None: not even all of them)."""
    trials: dict[int, Trial] = field(default_factory=dict)
    """By number of checkpointed blocks."""
    seconds: float = 0.0

    @property
    def fewer(self) -> Trial | None:
        """The trial with one block fewer than the answer (the proof that fewer do not do)."""
        return self.trials.get(self.blocks - 1) if self.blocks else None


def prove_fewest_blocks(workload, backend: MemoryBackend, *, precision: Precision, micro_batch: int,
                        start: int, limit_bytes: float, window: int = 1) -> BlocksProof:
    """Real trials at ``micro_batch`` from ``start`` blocks: down while one block fewer still
    fits within ``limit_bytes``, up until one fits. ``window``: the plan's accumulation steps
    (a window trial where more than one, see ``TrialSession.window_micro_batches``)."""
    started = time.perf_counter()
    # On the estimate backend (--gpu) the trials run on fake tensors, as the probe's do there.
    estimating = isinstance(backend, EstimateMemoryBackend)
    run_workload = on_fake_tensors(workload, foreach=backend.for_cuda) if estimating else workload
    proof = BlocksProof(micro_batch=micro_batch, total_blocks=0)
    limits = fake_tensor_limits(workload) if estimating else contextlib.nullcontext()
    try:
        with _session(run_workload, backend, TrialSession, precision, start) as session, limits, session:
            proof.total_blocks = total = session.total_blocks

            def fits(blocks: int) -> bool:
                session.set_checkpointing(blocks)
                trial = proof.trials[blocks] = session.run(micro_batch, window=window)
                return trial.fits and trial.peak_bytes <= limit_bytes

            blocks = min(max(start, 0), total)
            if fits(blocks):
                while blocks > 0 and fits(blocks - 1):
                    blocks -= 1
                proof.blocks = blocks
            else:
                while blocks < total:
                    blocks += 1
                    if fits(blocks):
                        proof.blocks = blocks
                        break
    except SetupOutOfMemory:
        pass
    proof.seconds = time.perf_counter() - started
    return proof


__all__ = ["BlocksProof", "learn_block_model", "prove_fewest_blocks"]
