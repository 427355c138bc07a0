"""``autotune.training``: run a plan with exact accumulation, on one device or under torchrun."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..workload.activation_checkpointing import enable_checkpointing
from ..workload.optimizer_steps import group_lr
from ..workload.dataset_batch import check_default_collate
from ..planning.planfile import load_planned_workload, planned_model_file
from ..precision import Precision, grad_scaler, scaler_settings
from ..distributed.sharding import Sharding
from ..distributed.sharding.settings import resolve_shard_group
from ..compiled import compiled_step_module, eager_module, is_compiled, with_compile
from ..distributed.apply_layout import apply_layout
from ..distributed.context_parallel import context_parallel_step
from ..distributed.tensor_parallel import tensor_parallel_step
from ..distributed.sharding.wrap import build_mesh, full_state_dict, is_sharded, shard_model
from . import checkpoint_lock, checks, restart, sharded_checkpoint
from ..distributed import process_group as distributed
from ..distributed.environment import adopt_slurm
from .checkpoint import (FORMAT_VERSION, REQUIRED_KEYS, TRAIN_STATE_KEYS, check_resumable, check_train_state,
                         checkpoint_path, load, plan_record, rng_state, save_atomic, set_rng_state)
from .checkpoint import written_by as checkpoint_written_by
from .data import (WindowLayout, dataset_batches, dataset_size, split_micro_batches, synthetic_batches,
                   windows_per_epoch)
from ..errors import AutotuneError, ConfigError, OutputError, UserCodeError, flag, option
from .errors import NonFiniteError, OOMRestart, TrainError
from .loop import StepRunner, TrainState, run_steps
from .metrics import MetricsLog, PlanCheck
from .noise_scale import NoiseScaleEMA, batch_advice, noise_scale, unavailable_reason
from .schedule import apply_plan_lr, build_scheduler, describe_warmup
from .stop import StopRequest

_FROM_PLAN = object()


@dataclass
class TrainResult:
    model: torch.nn.Module
    """The trained model (unwrapped from DDP; still sharded under FSDP2: its parameters are
    DTensors, ``autotune.distributed.sharding.wrap.full_state_dict`` gathers them)."""
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    steps: int
    """Optimizer steps taken so far, resumed ones included (skipped fp16 steps count too)."""
    metrics: list[dict]
    """One record per optimizer step run by this call (see ``autotune.training.metrics.FIELDS``)."""
    skipped_steps: int
    oom_recoveries: int
    micro_batches: list[int]
    """The micro-batch sizes in use at the end (finer than the plan's after kept OOM recoveries)."""
    interrupted: bool
    """Stopped early by SIGINT/SIGTERM (after checkpointing when a checkpoint folder was given)."""
    checkpoint: Path | None
    rank: int = 0
    world_size: int = 1
    noise_scale: float | None = None
    """The gradient noise scale B_noise in samples at the end (None: not measured or too few
    windows yet; ``noise_scale_note`` says which)."""
    noise_scale_note: str | None = None
    warnings: list[str] = field(default_factory=list)
    """Advice printed once at the end of the run (the effective batch far beyond B_noise)."""

    def __repr__(self) -> str:
        loss = f", last loss {self.metrics[-1]['loss']:.4g}" if self.metrics else ""
        return (f"TrainResult(steps={self.steps}{loss}, micro-batches {self.micro_batches}, "
                f"skipped {self.skipped_steps}, out-of-memory recoveries {self.oom_recoveries}"
                f"{', interrupted' if self.interrupted else ''})")


def train(plan, workload, *, steps: int | None = None, epochs: int | None = None,
          checkpoint_dir=None, checkpoint_every: int | None = None, resume: bool = False,
          overwrite: bool = False, metrics_path=None, clip_grad_norm=_FROM_PLAN, seed: int = 0,
          device=None, num_workers: int = 0, progress: bool = True, measure_noise_scale: bool = True,
          save_path=None, grad_scaler=None, on_checkpoint=None, compile=None) -> TrainResult:
    """Train ``workload`` as ``plan`` says: its micro-batches, accumulation, world size,
    precision, checkpointing, LR and warmup, with the gradient of each window exactly that of the
    whole window as one batch.

    ``plan`` is a ``Plan`` or a plan-file path; ``workload`` a model-file path or ``Workload``.
    A ``checkpoint_dir`` that already holds a checkpoint is continued with ``resume=True`` or
    started over with ``overwrite=True``; without either it is refused (never replaced quietly).
    One run at a time holds a ``checkpoint_dir`` (``autotune.lock``, taken by rank 0); torchrun's
    restart of a failed attempt continues from the checkpoint an earlier attempt of its run wrote.
    ``clip_grad_norm`` defaults to the plan's (None: no clipping). Under torchrun each process
    calls this; rank 0 alone writes metrics and checkpoints. ``measure_noise_scale`` estimates
    the gradient noise scale from gradient norms the loop has anyway (it never changes training).
    ``save_path`` writes the trained model's full state dict there (``save_model``) while the
    process group is still up, which a sharded model needs to be gathered.
    ``grad_scaler`` (a dict of some of init_scale, growth_factor, backoff_factor, growth_interval,
    or a ``GradScalerSettings``) overrides the plan's fp16 GradScaler knobs.
    ``on_checkpoint(step, checkpoint_dir)`` is called on every rank after each checkpoint is
    complete (a cluster's own checkpointing takes it from there: ``autotune.integrations.ray``).
    Under ``srun`` without torchrun, SLURM's task environment gives the ranks
    (``autotune.distributed.environment.adopt_slurm``).
    A plan with ``compile`` trains the compiled step (its backend); ``compile`` (True: inductor,
    or a backend name) compiles a plan that was not, whose peak is then the eager step's.
    """
    adopt_slurm()
    plan_source = plan if isinstance(plan, (str, Path)) else "the plan"
    plan = checks.load_plan(plan)
    workload = with_compile(load_planned_workload(plan, workload, source=str(plan_source)), compile)
    clip = plan.clip_grad_norm if clip_grad_norm is _FROM_PLAN else clip_grad_norm
    checks.check_options(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                         resume=resume, clip_grad_norm=clip, num_workers=num_workers, seed=seed,
                         overwrite=overwrite)
    sharding = Sharding.parse(plan.sharding, option="plan sharding")
    restarts = restart.Restarts.from_environment()
    main_process = _launched_as_main()
    if checkpoint_dir is not None and main_process:  # before "already holds a checkpoint"
        checkpoint_lock.check_free(checkpoint_dir, restarts)
    oom_record = restart.read_record(checkpoint_dir)
    ours = _written_by_this_run(checkpoint_dir, sharding, restarts)
    restarted = ours or restart.restarted_by_torchrun(oom_record, restarts)
    if restarted:
        # torchrun relaunched the ranks (a rank killed, out of memory inside a collective, any
        # failure): the same command, --overwrite or not, continues from the last checkpoint this
        # torchrun run wrote, if it wrote one; a checkpoint of another run is left to the command.
        resume = resume or ours
        overwrite = overwrite and not resume
    elif overwrite:
        oom_record = None
    outputs = dict(checkpoint_dir=checkpoint_dir, resume=resume, overwrite=overwrite,
                   metrics_path=metrics_path, save_path=save_path, inputs=_inputs(plan, plan_source, workload))
    checks.check_outputs(**outputs)
    precision = Precision.parse(plan.precision, option="plan precision")
    scaler = scaler_settings(grad_scaler, plan.grad_scaler)
    dataset = workload.build_dataset() if workload.build_dataset is not None else None
    size = None if dataset is None else dataset_size(dataset, source=workload.source)
    if dataset is not None and workload.collate_fn is None:
        check_default_collate(dataset, source=workload.source)
    if size is not None:
        checks.check_dataset_size(size, plan, source=workload.source)
    total = checks.total_steps(steps=steps, epochs=epochs, source=workload.source,
                               windows_per_epoch=windows_per_epoch(size, plan.effective_batch,
                                                                   plan.world_size))
    if checkpoint_dir is not None and sharding.sharded:
        sharded_checkpoint.check_folder(checkpoint_dir)
    lock = checkpoint_lock.acquire(checkpoint_dir, restarts) if checkpoint_dir is not None and main_process else None
    ctx = None
    try:
        if lock is not None:
            # Checked again under the lock: a run started beside this one may have written its
            # checkpoint here (and let go of the lock) since the check above.
            checks.check_outputs(**outputs)
        if overwrite and not restarted:
            restart.remove_record(checkpoint_dir)
        ctx = distributed.setup(device, sharded=sharding.sharded)
        checks.check_world_size(plan, ctx.world_size)
        shard_group = resolve_shard_group(plan.shard_group, plan.parallel.data_parallel(ctx.world_size),
                                          option="plan shard_group")
        checks.check_precision(precision, ctx.device)
        session = _Session(plan=plan, workload=workload, ctx=ctx, precision=precision, clip=clip,
                           sharding=sharding, shard_group=shard_group, seed=seed, dataset=dataset,
                           dataset_size=size, total_steps=total, checkpoint_dir=checkpoint_dir,
                           scaler=scaler, oom_record=oom_record, attempt=restarts.tag(),
                           on_checkpoint=on_checkpoint)
        with session.parallel_step():
            result = session.run(resume=resume, checkpoint_every=checkpoint_every,
                                 metrics_path=metrics_path, num_workers=num_workers, progress=progress,
                                 measure_noise=measure_noise_scale)
        state = _model_state(result) if save_path is not None else None  # every rank gathers
        distributed.settle(ctx)  # the ranks' last collective: rank 0 may write long after
        if state is not None:
            _write_model(result, state, save_path)
        return result
    finally:
        if ctx is not None:
            distributed.teardown(ctx)
        if lock is not None:
            lock.release()


class _Session:
    """The objects of one run, and how they are checkpointed and restored."""

    def __init__(self, *, plan, workload, ctx, precision, clip, sharding, shard_group, seed, dataset,
                 dataset_size, total_steps, checkpoint_dir, scaler, oom_record=None, attempt=None,
                 on_checkpoint=None):
        self.plan, self.workload, self.ctx, self.precision = plan, workload, ctx, precision
        self.clip, self.seed, self.dataset, self.dataset_size = clip, seed, dataset, dataset_size
        self.total_steps, self.sharding, self.shard_group = total_steps, sharding, shard_group
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.path = None
        if checkpoint_dir is not None:
            self.path = (sharded_checkpoint.pointer_path(checkpoint_dir) if sharding.sharded
                         else checkpoint_path(checkpoint_dir))
        # Ranks of one data-parallel group (tensor/context/pipeline peers) take the same samples.
        self.layout = WindowLayout(effective_batch=plan.effective_batch, micro_batches=plan.micro_batches,
                                   world_size=plan.parallel.data_parallel(ctx.world_size),
                                   rank=plan.parallel.data_rank(ctx.rank, ctx.world_size),
                                   dataset_size=dataset_size)
        torch.manual_seed(seed)  # the same initial weights on every rank and in every run
        built = workload.new_model()
        # build_model()'s torch.compile: its eager module is the one checkpointed, sharded and
        # saved (state dict keys without "_orig_mod."); the compiled one runs the steps.
        model = eager_module(built).to(ctx.device)
        self.compiled_by_model = built if is_compiled(built) else None
        model.train()
        if plan.checkpointing:
            enable_checkpointing(model, source=workload.source,
                                 blocks=None if plan.checkpointing.all_blocks else plan.checkpointing.count)
        if not plan.parallel.trivial and not sharding.sharded:
            raise ConfigError(f"{plan.parallel.describe_degrees()} with ddp: the training loop "
                              f"replicates model-parallel plans with FSDP2 only; re-plan with "
                              f"--sharding fsdp")
        if not plan.parallel.trivial:
            # Before the optimizer is built: the split and fully_shard replace the parameters.
            self.mesh = build_mesh(ctx.device.type, ctx.world_size, shard_group, plan.parallel)
            model = apply_layout(model, mesh=self.mesh, parallel=plan.parallel, sharding=sharding,
                                 precision=precision, workload=workload)
        elif sharding.sharded:
            # Before the optimizer is built: fully_shard replaces the parameters with DTensors.
            shard_model(model, mesh=build_mesh(ctx.device.type, ctx.world_size, shard_group),
                        sharding=sharding, precision=precision)
        self.model = model
        self.optimizer = workload.new_optimizer(p for p in model.parameters() if p.requires_grad)
        apply_plan_lr(self.optimizer, plan)
        self.scheduler = build_scheduler(workload, self.optimizer, plan)
        self.scaler = grad_scaler(precision, ctx.device, scaler)
        self.state = TrainState()
        self.saved_step = None
        """The step of the last checkpoint written or resumed from (None: none yet)."""
        self.oom_record = oom_record
        """The split recorded by a rank that ran out of memory inside a collective (restart.py)."""
        self.attempt = attempt
        """The torchrun attempt this is (``Restarts.tag``), recorded in its checkpoints."""
        self.on_checkpoint = on_checkpoint

    @contextlib.contextmanager
    def parallel_step(self):
        """While inside, every batch's sequence is sharded over the plan's cp ranks and attention
        rings over them (``autotune.distributed.context_parallel``), and a tensor-parallel plan's
        loss may take the logits split by vocabulary (``tensor_parallel.tensor_parallel_step``);
        nothing without cp or tp."""
        workload = self.workload
        with contextlib.ExitStack() as stack:
            if self.plan.parallel.cp > 1:
                self.workload = stack.enter_context(context_parallel_step(self.workload, self.mesh["cp"]))
            if self.plan.parallel.tp > 1:
                self.workload = stack.enter_context(tensor_parallel_step(self.workload, self.plan.parallel))
            try:
                yield
            finally:
                self.workload = workload

    def run(self, *, resume, checkpoint_every, metrics_path, num_workers, progress,
            measure_noise=True) -> TrainResult:
        rng = self._restore() if resume else None
        if self.state.step >= self.total_steps:
            return self._nothing_to_train(progress)
        if self.ctx.distributed:
            # Every rank must split its windows alike, even where the record is in a folder not
            # every node sees: the finest split any rank read wins.
            seen = [r for r in distributed.gather_objects(self.oom_record, self.ctx) if r is not None]
            self.oom_record = max(seen, key=lambda record: record["level"], default=None)
        recorded = self.oom_record is not None and restart.apply_record(self.oom_record, self.state.split)
        metrics = MetricsLog(metrics_path, enabled=self.ctx.is_main, total_steps=self.total_steps,
                             progress=progress, resume_step=self.state.step,
                             predicted_peak_bytes=self.plan.predicted_peak_bytes)
        try:
            if progress:
                metrics.note(self._describe())
            if progress and resume and self.attempt and self.attempt["restart"]:
                metrics.note(f"torchrun restart {self.attempt['restart']}: resumed from the checkpoint of "
                             f"step {self.state.step} in {self.checkpoint_dir}")
            if recorded:
                metrics.note(self._describe_recorded_split())
            runner = StepRunner(model=self._step_model(),
                                optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                                precision=self.precision, workload=self.workload, ctx=self.ctx,
                                clip_grad_norm=self.clip, state=self.state, notify=metrics.note,
                                measure_noise=measure_noise,
                                reduce_every_micro_step=self.plan.reduce_every_micro_step,
                                offload=self.sharding.offload,
                                restart_after_oom=self._restart_after_oom,
                                # FSDP2 averages a context-parallel plan's gradients over
                                # dp_shard x cp: its cp ranks' partial sums count as ranks too.
                                data_parallel=(self.plan.parallel.data_parallel(self.ctx.world_size)
                                               * self.plan.parallel.cp),
                                tensor_parallel=self.plan.parallel.tp)
            batches = self._batches(num_workers)
            if rng is not None:
                set_rng_state(rng)  # last, so nothing before the first step draws from it
            with StopRequest() as stop:
                try:
                    records, interrupted = run_steps(
                        runner, self.layout, batches, total_steps=self.total_steps, metrics=metrics,
                        stop=stop, save_checkpoint=self._save, checkpoint_every=checkpoint_every,
                        plan_check=self._plan_check())
                except NonFiniteError as exc:
                    raise NonFiniteError(f"{exc}; {self._last_good()}", step=exc.step) from None
                except Exception as exc:
                    peer = self._peer_out_of_memory(exc)
                    if peer is None:
                        raise
                    raise peer from exc
            noise, note, warnings = self._noise_advice(measure_noise)
            for warning in warnings:
                metrics.note(f"warning: {warning}")
            if note is not None and progress:
                metrics.note(note)
        finally:
            metrics.close()
        return TrainResult(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, steps=self.state.step, metrics=records,
            skipped_steps=self.state.skipped_steps, oom_recoveries=self.state.split.recoveries,
            micro_batches=_current_split(self.plan, self.state), interrupted=interrupted,
            checkpoint=self.path, rank=self.ctx.rank, world_size=self.ctx.world_size,
            noise_scale=noise, noise_scale_note=note, warnings=warnings)

    def _step_model(self) -> torch.nn.Module:
        """What each micro-step calls: the model wrapped for the ranks, compiled as the plan says
        (``--compile``'s backend, or build_model's own compiled module)."""
        if self.compiled_by_model is not None:
            return distributed.wrap_model(self.compiled_by_model, self.ctx)
        return compiled_step_module(distributed.wrap_model(self.model, self.ctx), self.workload.compile)

    def _nothing_to_train(self, progress: bool) -> TrainResult:
        """The checkpoint is at or past the last step asked for: no step is run and nothing is
        written but ``--save`` (the checkpoint's model), the same on every rank."""
        if progress and self.ctx.is_main:
            print(f"nothing to train: the checkpoint in {self.checkpoint_dir} is at step {self.state.step} "
                  f"and this run asks for {self.total_steps} steps in all; give {option('steps')} "
                  f"(or {option('epochs')}) beyond {self.state.step} to train on", file=sys.stderr, flush=True)
        return TrainResult(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
            steps=self.state.step, metrics=[], skipped_steps=self.state.skipped_steps,
            oom_recoveries=self.state.split.recoveries, micro_batches=_current_split(self.plan, self.state),
            interrupted=False, checkpoint=self.path, rank=self.ctx.rank, world_size=self.ctx.world_size,
            noise_scale_note="nothing was trained")

    def _plan_check(self) -> PlanCheck:
        """The plan's peak and budget for the loop to hold its steps to (see ``PeakMeter``): on the
        CPU the budget is enforced as the probe enforced it, elsewhere a peak past the prediction
        by more than the headroom is a warning. The CPU meter counts tensors, not DDP's buckets,
        which the plan's peak includes."""
        budget, cpu = self.plan.budget_bytes, self.ctx.device.type == "cpu"
        buckets = cpu and self.ctx.distributed and not self.sharding.sharded
        return PlanCheck(predicted_bytes=self.plan.predicted_peak_bytes,
                         budget_bytes=budget if cpu else None,
                         headroom_bytes=int(budget * self.plan.headroom) if budget else 0,
                         untracked_bytes=self.plan.ddp_bucket_bytes if buckets else 0,
                         # DDP rebuilds its buckets in this run's second step (after a resume too).
                         counted_at_step=self.state.step + 2 if buckets else None)

    def _noise_advice(self, measured: bool) -> tuple[float | None, str | None, list[str]]:
        """(B_noise, why it is None, warnings) at the end of the run."""
        if not measured:
            return None, "the gradient noise scale was not measured (measure_noise_scale=False)", []
        if self.sharding.sharded and self.plan.reduce_every_micro_step:
            return None, ("the gradient noise scale is not measured when the plan reduces gradients "
                          "every micro-step (reduce_every_micro_step): no rank holds a micro-batch's "
                          "gradient alone"), []
        if self.plan.parallel.tp > 1:
            return None, (f"the gradient noise scale is not measured under tensor parallelism "
                          f"(tp {self.plan.parallel.tp}): no rank holds a micro-batch's whole "
                          f"gradient"), []
        value = noise_scale(self.state.noise)
        if value is not None:
            advice = batch_advice(value, self.plan.effective_batch)
            return value, None, [advice] if advice else []
        steps = len(_current_split(self.plan, self.state))
        note = unavailable_reason(micro_steps=steps, world_size=self.ctx.world_size,
                                  sharded=self.sharding.sharded)
        if note is None:
            note = (f"the gradient noise scale is not known yet ({self.state.noise.windows} "
                    f"windows measured; it needs more windows, or the gradient is still lost in "
                    f"the noise)")
        return None, note, []

    def _batches(self, num_workers):
        start, stop = self.state.step, self.total_steps
        if self.dataset is None:
            return synthetic_batches(self.workload.batch, self.layout, seed=self.seed,
                                     start_step=start, stop_step=stop)
        return dataset_batches(self.dataset, self.layout, seed=self.seed, start_step=start,
                               stop_step=stop, num_workers=num_workers,
                               pin_memory=self.ctx.device.type == "cuda",
                               collate_fn=self.workload.collate_fn)

    def _describe(self) -> str:
        plan = self.plan
        lr = plan.lr.lr if plan.lr.lr is not None else group_lr(self.optimizer.param_groups[0])
        data = ("make_batch (no dataset)" if self.dataset_size is None else
                f"{self.dataset_size} samples, {self.layout.windows_per_epoch} steps per epoch")
        ranks = "rank(s)" if plan.parallel.trivial else "data-parallel rank(s)"
        return (f"{self.total_steps} optimizer steps from step {self.state.step}: micro-batches "
                f"{plan.micro_batches} x {plan.data_parallel} {ranks} = effective batch "
                f"{plan.effective_batch}; {self.precision.value}; lr {lr:g} "
                f"({describe_warmup(plan, self.workload)}); clip {self.clip}; "
                f"{self._describe_sharding()}; data: {data}")

    def _describe_recorded_split(self) -> str:
        record, split = self.oom_record, _current_split(self.plan, self.state)
        return (f"rank {record.get('rank')} ran out of memory at step {record.get('step')} inside a "
                f"collective ({restart.record_path(self.checkpoint_dir)}): training from step "
                f"{self.state.step} with micro-batch {max(split)} x {len(split)} accumulation steps "
                f"(effective batch {self.plan.effective_batch} and the LR schedule unchanged)")

    def _restart_after_oom(self, *, step, where, micro_batch, level, finer) -> TrainError:
        return restart.restart_after_oom(
            directory=self.checkpoint_dir, rank=self.ctx.rank, step=step, where=where,
            micro_batch=micro_batch, level=level, finer=finer,
            recoveries=self.state.split.recoveries + 1, from_step=self.saved_step)

    def _peer_out_of_memory(self, exc: Exception) -> OOMRestart | None:
        """Why a collective failed on this rank, when another rank has just recorded an
        out-of-memory exit (its process ended, so gloo's read from it failed)."""
        if isinstance(exc, UserCodeError) and exc.__cause__ is not None:
            exc = exc.__cause__  # the collective failed inside the model's forward (FSDP2's all-gathers)
        if isinstance(exc, AutotuneError) or not self.ctx.distributed or self.checkpoint_dir is None:
            return None
        record = restart.new_record(self.checkpoint_dir, self.oom_record)
        if record is None:
            return None
        return OOMRestart(
            f"rank {self.ctx.rank} stopped ({type(exc).__name__} in a collective: "
            f"{str(exc).splitlines()[0][:200]}) because rank {record.get('rank')} ran out of memory "
            f"at step {record.get('step')}; micro-batch {record.get('micro_batch')} is recorded in "
            f"{restart.record_path(self.checkpoint_dir)} (rank {record.get('rank')}'s error says what next)")

    def _describe_sharding(self) -> str:
        if not self.plan.parallel.trivial:
            return self.plan.parallel.describe(self.ctx.world_size, str(self.sharding).upper())
        if not self.sharding.sharded:
            return "ddp" if self.ctx.distributed else "one process"
        hybrid = (f", hybrid: shard groups of {self.shard_group}"
                  if self.shard_group < self.ctx.world_size else "")
        return f"{self.sharding} over {self.ctx.world_size} rank(s){hybrid}"

    # -- checkpoints -----------------------------------------------------------------------------
    def _save(self) -> None:
        if self.path is None:
            return
        rng = distributed.gather_objects(rng_state(), self.ctx)  # every rank takes part
        if self.sharding.sharded:
            sharded_checkpoint.save(self.checkpoint_dir, step=self.state.step,
                                    world_size=self.ctx.world_size, model=self.model,
                                    optimizer=self.optimizer, train_state=self._train_state(rng),
                                    is_main=self.ctx.is_main, run=self.attempt)
        elif self.ctx.is_main:
            save_atomic({"format": FORMAT_VERSION, "model": self.model.state_dict(),
                         "optimizer": self.optimizer.state_dict(), **self._train_state(rng)}, self.path)
        self.saved_step = self.state.step
        if self.ctx.is_main:  # the checkpoint now carries the recorded split
            restart.clear_record(self.checkpoint_dir, self.state.split.level)
        if self.on_checkpoint is not None:
            if self.ctx.distributed:  # rank 0 has written it before any rank hands it on
                distributed.barrier(self.ctx)
            self.on_checkpoint(self.state.step, self.checkpoint_dir)

    def _train_state(self, rng: list) -> dict:
        """Everything of a checkpoint but the model and the optimizer."""
        return {
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "step": self.state.step,
            "skipped_steps": self.state.skipped_steps,
            "split": self.state.split.state_dict(),
            "noise_scale": self.state.noise.to_dict(),
            "data": self._data_position(),
            "plan": plan_record(self.plan, self.workload),  # plain types: loadable with weights_only
            "run": self.attempt,
        }

    def _last_good(self) -> str:
        if self.path is None:
            return f"no checkpoint was kept (train with {option('checkpoint_dir')} to keep one)"
        if self.saved_step is None:
            return f"no checkpoint was written to {self.path.parent} before it"
        return f"the last good checkpoint, {self.path} (step {self.saved_step}), is kept"

    def _data_position(self) -> dict:
        position = {"seed": self.seed, "effective_batch": self.plan.effective_batch,
                    "dataset_size": self.dataset_size, "epoch": None, "window": None}
        if self.state.step < self.total_steps:
            window = self.layout.window(self.state.step)
            position.update(epoch=window.epoch, window=window.index)
        return position

    def _damaged(self, name: str, why: str) -> TrainError:
        return TrainError(f"{flag('resume')}: in checkpoint {self.path}, the field {name!r} cannot be "
                          f"restored ({why}); the checkpoint is damaged or was edited. Start a new "
                          f"{option('checkpoint_dir')} (or {flag('overwrite')})")

    def _restore(self):
        if self.sharding.sharded:
            saved = sharded_checkpoint.load(self.checkpoint_dir, world_size=self.ctx.world_size,
                                            model=self.model, optimizer=self.optimizer)
        else:
            saved = load(self.path)
        check_resumable(saved, self.plan, self.workload, path=self.path,
                        required=TRAIN_STATE_KEYS if self.sharding.sharded else REQUIRED_KEYS)
        check_train_state(saved, path=self.path, rank=self.ctx.rank)
        data = saved["data"]
        for label, name, value in ((option("seed"), "seed", self.seed),
                                   ("the plan's effective batch", "effective_batch", self.plan.effective_batch),
                                   ("the dataset size", "dataset_size", self.dataset_size)):
            if not isinstance(data, dict) or name not in data:
                raise self._damaged("data", f"it has no {name!r}")
            if data[name] != value:
                raise TrainError(
                    f"{flag('resume')}: {label} is {value} but the checkpoint {self.path} was trained with "
                    f"{data[name]}; resume with the same setting (or start a new {option('checkpoint_dir')})"
                )
        if not self.sharding.sharded:  # a sharded checkpoint loaded its shards in place
            try:
                self.model.load_state_dict(saved["model"])
            except RuntimeError as exc:  # shapes or names: the model changed in a way the hash missed
                raise TrainError(f"{flag('resume')}: the checkpoint {self.path} holds another model's weights "
                                 f"({str(exc).splitlines()[0]} ...); resume with the model it was "
                                 f"trained with, or start a new {option('checkpoint_dir')}") from None
            try:
                self.optimizer.load_state_dict(saved["optimizer"])
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                raise self._damaged("optimizer", f"{type(exc).__name__}: {exc}") from None
        for name, restore in (("scaler", self.scaler.load_state_dict),
                               ("scheduler", self.scheduler.load_state_dict),
                               ("split", self.state.split.load_state_dict),
                               ("noise_scale", self._restore_noise)):
            if name in saved:  # noise_scale is absent from checkpoints written before it was measured
                try:
                    restore(saved[name])
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                    raise self._damaged(name, f"{type(exc).__name__}: {exc}") from None
        self.state.step = self.saved_step = saved["step"]
        self.state.skipped_steps = saved["skipped_steps"]
        ranks = saved["rng"]
        return ranks[self.ctx.rank] if self.ctx.rank < len(ranks) else None


    def _restore_noise(self, saved: dict) -> None:
        self.state.noise = NoiseScaleEMA.from_dict(saved)


def _written_by_this_run(directory, sharding: Sharding, restarts: restart.Restarts) -> bool:
    """True when ``directory`` holds a checkpoint an earlier attempt of this torchrun run wrote."""
    if directory is None or not restarts.count:
        return False
    tag = (sharded_checkpoint.written_by(directory) if sharding.sharded
           else checkpoint_written_by(checkpoint_path(directory)))
    return restarts.later_attempt_of(tag)


def _launched_as_main() -> bool:
    """Rank 0 of the run about to start (before its process group exists, when it makes one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") in ("", "0")


def _inputs(plan, plan_source, workload) -> dict:
    """The files this run reads, which no output of it may replace (the model file the plan
    names too, where it is another path to the file trained)."""
    inputs = {"model file": workload.source if workload.file_sha256 is not None else None}
    if isinstance(plan_source, (str, Path)):
        inputs["--plan"] = plan_source
        inputs["model file (the plan's)"] = planned_model_file(plan, plan_source)
    return inputs


def _current_split(plan, state) -> list[int]:
    return [n for n in split_micro_batches(plan.micro_batches, state.split.level) if n]


def save_model(result: TrainResult, path) -> None:
    """``--save``: ``{"model": state_dict, "steps": n}`` with ``torch.save``, written by rank 0.

    Every rank calls it: a sharded model is gathered into a full, unsharded state dict (plain
    CPU tensors that load into the model file's ``build_model()`` without torch.distributed),
    which needs the process group ``train`` tore down: pass ``save_path`` to ``train`` instead.
    """
    _write_model(result, _model_state(result), path)


def _model_state(result: TrainResult) -> dict:
    return full_state_dict(result.model) if is_sharded(result.model) else result.model.state_dict()


def _write_model(result: TrainResult, state: dict, path) -> None:
    if result.rank != 0:
        return
    try:
        save_atomic({"model": state, "steps": result.steps}, Path(path))
    except OutputError as exc:
        kept = (f"the trained model is in the last checkpoint, {result.checkpoint}"
                if result.checkpoint is not None and result.checkpoint.is_file()
                else f"the trained model was not kept (no {option('checkpoint_dir')})")
        raise OutputError(f"--save {exc}; {kept}") from None
