"""The optimizer-step loop: accumulate a window exactly, step once, recover from OOM, checkpoint.

``StepRunner`` owns one optimizer step (a window); ``run_steps`` drives the steps, the metrics
and the checkpoints. Everything is built by ``autotune.training.api``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from ..memory.oom import free_memory, is_oom_error
from ..precision import Precision, autocast
from ..distributed.sharding import wrap as sharding
from ..workload.contract import Workload, check_within_seq_len, move_batch
from ..workload.optimizer_steps import counted_step, group_lr
from . import noise_scale
from ..distributed import process_group as distributed
from ..distributed.pipeline import PipelinedModel, pipeline_grad_norm
from ..distributed.tensor_parallel import clip_grad_norm_
from ..accumulation import COUNTED_RANKS, WindowTotals, backward_scale, count_correction, scale_gradients, summed_loss
from .data import Window, slice_batch, split_micro_batches
from ..errors import WorkloadError, option, flag
from .errors import NonFiniteError, TrainError
from .metrics import PeakMeter, PlanCheck
from .recovery import SplitPolicy


class _OOMInCollective(Exception):
    """Out of memory where the other ranks may already wait in a collective this rank cannot
    join: inside FSDP2's all-gathers and reduce-scatters (any forward or backward of a sharded
    model, whose per-module state cannot be rewound either), or inside DDP's gradient all-reduce
    (a window's last backward). The window cannot be redone in-process."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


def _cannot_restart(*, step, where, micro_batch, level, finer, **_) -> TrainError:
    return TrainError(f"ran out of memory at step {step} with micro-batch {micro_batch} {where}; "
                      f"re-plan with autotune plan --micro-batch {max(finer)}")


MAX_SKIPS_IN_A_ROW = 20
"""fp16 steps skipped one after another before training stops (overflow at the start of a run
costs a handful; a NaN in the data costs every step)."""


@dataclass
class StepOutcome:
    loss: float
    lr: float
    grad_norm: float
    skipped: bool
    stop: bool
    micro_batches: list[int]


@dataclass
class TrainState:
    """What changes from step to step besides model/optimizer/scheduler/scaler (checkpointed)."""

    step: int = 0
    skipped_steps: int = 0
    split: SplitPolicy = field(default_factory=SplitPolicy)
    noise: noise_scale.NoiseScaleEMA = field(default_factory=noise_scale.NoiseScaleEMA)


class StepRunner:
    def __init__(self, *, model, optimizer, scheduler, scaler, precision: Precision, workload: Workload,
                 ctx: distributed.DistContext, clip_grad_norm: float | None, state: TrainState,
                 notify=lambda message: None, measure_noise: bool = True,
                 reduce_every_micro_step: bool = False, restart_after_oom=_cannot_restart,
                 offload: bool = False, data_parallel: int | None = None, tensor_parallel: int = 1):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.precision = precision
        self.workload = workload
        self.ctx = ctx
        self.device = ctx.device
        self.clip_grad_norm = clip_grad_norm
        self.state = state
        self.notify = notify
        # Called with the step, where, micro_batch, level and finer split of an out-of-memory the
        # ranks cannot agree on in-process; returns the error this rank exits with.
        self.restart_after_oom = restart_after_oom
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sharded = sharding.is_sharded(model)
        self.pipelined = isinstance(model, PipelinedModel)
        """A pipeline's stages: a window is one run of its schedule (``_pipeline_window``)."""
        self.data_parallel = data_parallel or ctx.world_size
        """Ranks whose gradients DDP/FSDP2 average (the world, unless the plan splits the model:
        the data-parallel ranks, times cp where FSDP2 shards over dp_shard x cp)."""
        # FSDP2 only: then no rank ever holds a micro-step's gradient alone (no noise scale).
        self.reduce_every_micro_step = reduce_every_micro_step and self.sharded
        self.tensor_parallel = tensor_parallel
        """Ranks that compute each sample's same loss (tensor parallel): each adds the same loss
        and item counts to the window's totals."""
        # A pipeline's ranks never hold one micro-batch's whole gradient alone, nor does a
        # tensor-parallel rank (its gradients are pieces of the layers'): no noise scale.
        self.measure_noise = (measure_noise and not self.reduce_every_micro_step and not self.pipelined
                              and tensor_parallel == 1)
        self.totals = WindowTotals(self.device)
        self.offload = offload and self.sharded
        self.host = _NoHost()
        """fsdp-offload: what tells the CPU meter what lives in host memory (``run_steps`` sets it)."""
        if self.offload:
            # FSDP2 copies each sharded gradient to the host as it assigns it, then calls these.
            for p in self.params:
                p.register_post_accumulate_grad_hook(lambda p: self.host.to_host(p.grad))
        self.skips_in_a_row = 0
        # DDP's forward runs collectives before the model's own: the buffer broadcast of a
        # window's first forward, the one-time bucket rebuild. A rank out of memory before its
        # model ran (the batch's copy to the device, the loss function's own work) never joined
        # them while the other ranks wait in them: the inner module's pre-hook says it did.
        self._ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        self._model_entered = False
        if self._ddp is not None:
            self._ddp.module.register_forward_pre_hook(self._entered)
        # BatchNorm updates its running statistics in forward; a window redone after an OOM must
        # start from the statistics it started with, or the redo would count its samples twice.
        self._norm_buffers = [buf for module in model.modules()
                              if isinstance(module, torch.nn.modules.batchnorm._NormBase)
                              for buf in module.buffers()]

    def live_tensors(self):
        """What is allocated before a step: parameters, buffers and optimizer state. Not the
        window's batch: it holds every micro-step's samples, and the probe counted one.
        Under fsdp-offload the shards and the optimizer state live in host memory
        (``host_tensors``): buffers only."""
        yield from self.model.buffers()
        if not self.offload:
            yield from self._parameters_and_state()

    def host_tensors(self):
        """fsdp-offload: the shards and the optimizer state, in host memory (none otherwise)."""
        return self._parameters_and_state() if self.offload else ()

    def _parameters_and_state(self):
        yield from self.model.parameters()
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    # -- one window ------------------------------------------------------------------------------
    def step(self, window: Window, batch, *, stop_requested: bool) -> StepOutcome:
        level = self.state.split.level
        saved_buffers = [buf.clone() for buf in self._norm_buffers]
        while True:
            sizes = split_micro_batches(window.micro_batches, level)
            try:
                failed = self._accumulate(window, batch, sizes)
            except _OOMInCollective as oom:
                # No collective from here on: this rank leaves, the others fail in theirs.
                self._check_splittable(window, sizes)
                raise self.restart_after_oom(
                    step=window.step + 1, where=oom.where, micro_batch=max(sizes), level=level + 1,
                    finer=split_micro_batches(window.micro_batches, level + 1)) from oom.__cause__
            if not failed:
                break
            # Outside the except block that caught the OOM: its traceback is gone, so the failed
            # micro-step's activations can be freed with the partial gradients.
            self._drop_window(saved_buffers)
            self._check_splittable(window, sizes)
            level += 1
            kept = self.state.split.record_recovery(level)
            finer = split_micro_batches(window.micro_batches, level)
            self.notify(f"out of memory at step {window.step + 1} with micro-batch {max(sizes)}; "
                        f"redoing the window as {len(finer)} micro-batches of at most {max(finer)}")
            if kept:
                self.notify(f"ran out of memory {self.state.split.keep_after} times; keeping micro-batch "
                            f"{max(finer)} ({len(finer)} accumulation steps) for the rest of the run "
                            f"(effective batch and LR unchanged); re-plan with a smaller micro-batch")
        with self.host.on_host():  # fsdp-offload: the optimizer steps on the CPU
            return self._optimizer_step(window, sizes, stop_requested)

    @staticmethod
    def _check_splittable(window: Window, sizes: list[int]) -> None:
        if max(sizes) <= 1:
            raise TrainError(
                f"step {window.step + 1}: a micro-batch of 1 sample ran out of memory even after "
                f"splitting; the model does not fit at this precision. Re-plan (autotune plan) with "
                f"--precision bf16 or --checkpointing on, or use a device with more memory"
            )

    def _accumulate(self, window: Window, batch, sizes: list[int]) -> bool:
        """Forward and backward over the window's micro-batches; True when any rank ran out of memory."""
        self.totals.reset()
        scale = backward_scale(world_size=self.data_parallel, window_samples=window.samples)
        if self.pipelined:
            self._pipeline_window(batch, sizes, scale)
            return False
        failed = False
        offset = 0
        last = len(sizes) - 1
        # The noise scale's small batch is the first non-empty micro-step, provided another one
        # follows it (the last is never empty): its gradient alone, still local under no_sync.
        measure_at = next((i for i, n in enumerate(sizes) if n), last) if self.measure_noise else last
        for index, size in enumerate(sizes):
            part = slice_batch(batch, offset, offset + size)
            offset += size
            final = index == last
            if failed:
                if final and self.ctx.distributed:
                    distributed.any_rank(True, self.ctx)  # every rank joins the agreement once
                continue
            if size == 0:  # an empty piece of a split (never the last one: sizes are sorted)
                if self.sharded:
                    # FSDP2 all-gathers in every forward and backward, so this rank must run the
                    # micro-step the others run: one sample whose loss counts zero times.
                    failed = self._micro_step(slice_batch(batch, 0, 1), 1, 0.0, final, measure=False,
                                              padding=True)
                continue
            failed = self._micro_step(part, size, scale, final, measure=index == measure_at < last)
        return failed

    def _entered(self, module, args):
        self._model_entered = True

    def _forward_collectives(self) -> bool:
        """Whether DDP's next forward runs collectives before the model's (a buffer broadcast, or
        a bucket rebuild it has not done yet)."""
        ddp = self._ddp
        return ddp is not None and (ddp.will_sync_module_buffers()
                                    or not getattr(ddp, "_has_rebuilt_buckets", False))

    def _micro_step(self, part, size: int, scale: float, final: bool, *, measure: bool,
                    padding: bool = False) -> bool:
        out_of_memory = agreed = False
        self._model_entered = False
        collectives_first = self.ctx.distributed and self._forward_collectives()
        try:
            if self.workload.seq_len is not None:  # a plan in tokens: no batch past its length
                check_within_seq_len(part, self.workload.seq_len, source=self.workload.source)
            batch = move_batch(part, self.device)
            with distributed.sync_context(self.model, final=final or self.reduce_every_micro_step):
                with autocast(self.precision, self.device):
                    loss, count = self.workload.loss(self.model, batch)
                loss_sum, items = summed_loss(loss, count, size)
                if final and self.ctx.distributed:
                    # The last backward all-reduces gradients; ranks agree first that none ran out
                    # of memory, so no rank waits forever in an all-reduce another rank skipped.
                    agreed = True
                    if distributed.any_rank(False, self.ctx):
                        return True
                self.scaler.scale(loss_sum * scale).backward()
            if not padding:
                self.totals.add(loss_sum, items, counted=count is not None)
            if measure:
                # Reading the gradients leaves them (and so training) untouched. The grads are
                # GradScaler scale × (world_size·n/N) × the micro-batch's per-sample mean
                # gradient; the factor is divided out at the optimizer step, where the scale is
                # read anyway, so no device sync happens here.
                self.totals.add_small_batch(self._grad_sq_norm() / (scale * size) ** 2, size)
        except Exception as exc:  # noqa: BLE001 - anything but out-of-memory is re-raised untouched
            if not is_oom_error(exc):
                raise
            if self.sharded:
                raise _OOMInCollective("in a forward or backward of an FSDP2 (sharded) plan, whose "
                                       "all-gathers and reduce-scatters run inside them") from exc
            if agreed:
                raise _OOMInCollective("inside the window's last backward, which all-reduces "
                                       "DDP's gradients while it runs") from exc
            if collectives_first and not self._model_entered:
                raise _OOMInCollective("before the model's forward, while the other ranks wait in "
                                       "the collectives DDP runs first (its buffer broadcast or "
                                       "bucket rebuild)") from exc
            out_of_memory = True
        if out_of_memory and final and self.ctx.distributed:
            distributed.any_rank(True, self.ctx)
        return out_of_memory

    def _pipeline_window(self, batch, sizes: list[int], scale: float) -> None:
        """The window's micro-batches through the pipeline schedule; the last stage's losses are
        weighed exactly as the micro-steps' (``summed_loss`` times ``scale``) and counted."""
        parts, offset = [], 0
        for size in sizes:
            part = slice_batch(batch, offset, offset + size)
            offset += size
            if self.workload.seq_len is not None:
                check_within_seq_len(part, self.workload.seq_len, source=self.workload.source)
            parts.append(move_batch(part, self.device))

        def weigh(loss, count, index):
            loss_sum, items = summed_loss(loss, count, sizes[index])
            self.totals.add(loss_sum, items, counted=count is not None)
            return self.scaler.scale(loss_sum * scale)

        try:
            self.model.run(parts, weigh, self.workload.loss)
        except Exception as exc:  # noqa: BLE001 - anything but out-of-memory is re-raised untouched
            if not is_oom_error(exc):
                raise
            raise _OOMInCollective("inside the pipeline schedule, whose sends and receives to the "
                                   "other stages run between its forwards and backwards") from exc

    def _drop_window(self, saved_buffers) -> None:
        distributed.forget_failed_window(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.totals.reset()
        with torch.no_grad():
            for buf, saved in zip(self._norm_buffers, saved_buffers):
                buf.copy_(saved)
        free_memory()

    # -- the optimizer step ----------------------------------------------------------------------
    def _optimizer_step(self, window: Window, sizes: list[int], stop_requested: bool) -> StepOutcome:
        if self.totals.small_ranks and self.scaler.is_enabled():
            self.totals.small_sq_norm = self.totals.small_sq_norm / self.scaler.get_scale() ** 2
        reduced = None
        if self.totals.token_counts or self.pipelined:
            # Item counts are only known now; the window's gradient becomes sum / count exactly.
            # A pipeline counts them on its last stage, and every stage's gradients take the
            # correction: all its ranks reduce the totals here (and agree whether items counted).
            reduced = self._reduce_totals(stop_requested)
        if reduced is not None and reduced[COUNTED_RANKS] > 0:
            self._check_items(window, reduced[1])
            scale_gradients(self.params, count_correction(window_samples=window.samples,
                                                          window_items=reduced[1]))
        self.scaler.unscale_(self.optimizer)  # no-op unless fp16
        norm = self._grad_norm()
        if not self.scaler.is_enabled():
            # fp16's GradScaler skips non-finite steps on purpose; anywhere else a NaN or infinite
            # gradient would turn every weight into NaN, and training on would hide it.
            self._check_finite(window, norm=float(norm), reduced=reduced)
        lr = group_lr(self.optimizer.param_groups[0])
        skipped = False
        if self.scaler.is_enabled():
            before = self.scaler.get_scale()
            with counted_step():
                self.scaler.step(self.optimizer)
            self.scaler.update()
            # GradScaler skips optimizer.step() on inf/NaN and lowers the scale: then the
            # scheduler must not advance either.
            skipped = self.scaler.get_scale() < before
        else:
            with counted_step():
                self.optimizer.step()
        if skipped:
            self.state.skipped_steps += 1
        else:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if reduced is None:
            reduced = self._reduce_totals(stop_requested)
        loss_sum, items, stop = reduced[:3]
        if not skipped:
            self._check_finite(window, norm=None, reduced=reduced)
        self._count_skips(window, skipped)
        self._update_noise_scale(window, reduced, float(norm))
        return StepOutcome(loss=loss_sum / items, lr=lr, grad_norm=float(norm), skipped=skipped,
                           stop=stop > 0, micro_batches=sizes)

    def _count_skips(self, window: Window, skipped: bool) -> None:
        # GradScaler recovers from overflow within a few halvings of its scale; skipping window
        # after window means the loss or gradients are NaN/inf at any scale.
        self.skips_in_a_row = self.skips_in_a_row + 1 if skipped else 0
        if self.skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(
                f"step {window.step + 1}: fp16's GradScaler skipped {self.skips_in_a_row} steps in a "
                f"row (the gradients are NaN or infinite at every scale); training stopped there. "
                f"Look for a NaN in the data or the loss_fn, or re-plan with --precision bf16 or fp32",
                step=window.step + 1)

    def _check_items(self, window: Window, items: float) -> None:
        # A window of zero (or a negative number of) items has no mean: the model-file contract's
        # error, not a ZeroDivisionError or a sign-flipped loss.
        if not items > 0:
            raise WorkloadError(
                f"{self.workload.source}: at step {window.step + 1} loss_fn's item counts sum to "
                f"{items:g} over the window; a (loss_sum, item_count) loss needs counts >= 0 that "
                f"sum to more than 0 in every window (count the real tokens or samples)")

    def _check_finite(self, window: Window, *, norm: float | None, reduced) -> None:
        """Raise ``NonFiniteError`` naming the step when the loss or gradient norm is NaN/inf."""
        if norm is not None and math.isfinite(norm) and (reduced is None or math.isfinite(reduced[0])):
            return
        # Only on the way to an error: read this rank's loss when the window's is not reduced yet.
        loss = (reduced[0] / reduced[1] if reduced is not None
                else float(self.totals.loss_sum / self.totals.items))
        if not math.isfinite(loss):
            what = f"the loss is {loss}"
        elif norm is not None and not math.isfinite(norm):
            what = f"the gradient norm is {norm} (the loss {loss:.4g})"
        else:
            return
        raise NonFiniteError(
            f"step {window.step + 1}: {what}; training stopped there (no checkpoint is written after it). "
            f"Look for a NaN in the data or the loss_fn, or lower the learning rate", step=window.step + 1)

    def _reduce_totals(self, stop_requested: bool) -> list[float]:
        totals = distributed.all_reduce_sum(self.totals.as_tensor(stop_requested), self.ctx)
        if self.tensor_parallel > 1:
            totals = totals / self.tensor_parallel  # each sample's totals came from all its TP ranks
        return totals.tolist()

    def _update_noise_scale(self, window: Window, reduced: list[float], norm: float) -> None:
        _, items, _, small_sq_sum, inverse_sum, ranks = reduced[:COUNTED_RANKS]
        if not ranks:
            return
        # The window's gradient is per-sample mean (or, with item counts, sum / C): scale it back
        # to the per-sample mean of the summed loss, the quantity the small batch measured.
        big = norm * (items / window.samples if self.totals.token_counts else 1.0)
        small_batch = ranks / inverse_sum  # harmonic mean of the ranks' micro-batch sizes
        if not small_batch < window.samples:
            return
        estimate = noise_scale.two_batch_estimate(small_sq_sum / ranks, big * big,
                                                  small_batch=small_batch, big_batch=window.samples)
        self.state.noise = noise_scale.update(self.state.noise, estimate)

    def _grad_sq_norm(self) -> torch.Tensor:
        grads = distributed.local_grads(self.model, self.params)
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.nn.utils.get_total_norm(grads).to(torch.float64) ** 2

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm (clipping to it when asked); over FSDP2's DTensor shards the
        norm is reduced across ranks, and every rank gets the full value."""
        if self.pipelined:  # every stage's gradients count, on whichever rank they live
            return pipeline_grad_norm(self.params, self.model.group, max_norm=self.clip_grad_norm)
        if not any(p.grad is not None for p in self.params):
            return torch.zeros(())
        return clip_grad_norm_(self.params, self.clip_grad_norm)


class _NoHost:
    """Host and device apart (CUDA), or no offload: nothing to tell the meter."""

    def on_host(self):
        return contextlib.nullcontext()

    def to_host(self, tensor) -> None:
        pass


class DivergenceWatch:
    """Warns once when the loss has grown far above the first step's: the run is likely
    diverging long before it turns into NaN."""

    FACTOR = 10.0

    def __init__(self):
        self.first: tuple[int, float] | None = None
        self.warned = False

    def check(self, step: int, loss: float) -> str | None:
        if self.first is None:
            self.first = (step, loss)
            return None
        first_step, first_loss = self.first
        if self.warned or not first_loss > 0 or not loss > self.FACTOR * first_loss:
            return None
        self.warned = True
        return (f"the loss grew from {first_loss:.4g} at step {first_step} to {loss:.4g} at step "
                f"{step} (over {self.FACTOR:g}x): training looks divergent; lower the learning "
                f"rate or clip gradients ({option('clip_grad_norm')})")


def run_steps(runner: StepRunner, layout, batches, *, total_steps: int, metrics, stop,
              save_checkpoint, checkpoint_every: int | None,
              plan_check: PlanCheck | None = None) -> tuple[list[dict], bool]:
    """Train from ``runner.state.step`` to ``total_steps``; returns (metrics records, interrupted).
    ``plan_check``: each measured step's peak is checked against the plan's (see ``PeakMeter``)."""
    state = runner.state
    records: list[dict] = []
    meter = PeakMeter(runner.device, total_steps=total_steps, check=plan_check)
    if runner.offload and runner.device.type == "cpu":
        runner.host = meter
    warned = False
    divergence = DivergenceWatch()
    last = time.perf_counter()
    while state.step < total_steps:
        window = layout.window(state.step)
        batch = next(batches)
        with meter.step(state.step + 1, runner.live_tensors(), batch, host=runner.host_tensors()):
            outcome = runner.step(window, batch, stop_requested=stop.requested)
        state.step += 1
        now = time.perf_counter()
        record = {
            "step": state.step, "epoch": window.epoch, "loss": outcome.loss, "lr": outcome.lr,
            "grad_norm": outcome.grad_norm, "samples_per_s": window.samples / max(now - last, 1e-9),
            **meter.fields(), "skipped_steps": state.skipped_steps,
            "oom_recoveries": state.split.recoveries, "micro_batch": max(outcome.micro_batches),
            "accumulation_steps": len(outcome.micro_batches),
            "noise_scale": noise_scale.noise_scale(state.noise),
            "noise_grad_sq_ema": state.noise.grad_sq, "noise_trace_ema": state.noise.trace,
        }
        records.append(record)
        metrics.write(record)
        if meter.warning is not None and not warned:
            warned = True  # once: every step after it would say the same
            metrics.note(f"warning: {meter.warning}")
        warning = divergence.check(state.step, outcome.loss)
        if warning is not None:
            metrics.note(f"warning: {warning}")
        due = checkpoint_every is not None and state.step % checkpoint_every == 0
        if outcome.stop or due or state.step == total_steps:
            save_checkpoint()
        last = time.perf_counter()
        if outcome.stop:
            metrics.note(f"stopped by {stop.signal_name or 'a signal on another rank'} after step "
                         f"{state.step}; resume with {flag('resume')}")
            return records, True
    return records, False
