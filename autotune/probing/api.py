"""The probe: the exact largest micro-batch that fits, for one precision and checkpointing setting."""

from __future__ import annotations

import contextlib
import time

import torch

from ..compiled import compiled_note, with_compile
from ..errors import ConfigError, ProbeError, option
from ..memory import CPUMemoryBackend, MemoryBackend, backend_for
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits, on_fake_tensors
from ..precision import Precision
from .. import progress
from ..distributed.sharding.settings import Sharding, resolve_shard_group
from ..units import format_bytes
from ..workload.checkpoint_count import CheckpointingRequest
from ..workload.contract import load_workload
from .result import MemoryModel, ProbeResult, Trial, setting_label
from .affine_blocks import TensorFloorSession, layout_session
from .estimate import EstimateSession
from .search import fit_memory_model, search_largest_fitting
from .isolated import isolated, seed_in_child
from .seed import estimate_seed
from .share import search_with_share, window_steps
from .trial import SetupOutOfMemory, TrialSession


def probe(
    workload,
    *,
    device=None,
    precision="fp32",
    checkpointing=False,
    memory_limit=None,
    max_micro_batch: int | None = None,
    backend: MemoryBackend | None = None,
    use_estimate: bool = True,
    sharding="ddp",
    world_size: int = 1,
    shard_group: int | None = None,
    explain: bool = True,
    hint: int | None = None,
    share: int | None = None,
    reduce_every_micro_step: bool = True,
    compile=None,
    parallel=None,
    session_type=None,
    limit: int | None = None,
    least: int | None = None,
) -> ProbeResult:
    """Find the exact largest micro-batch whose full steady-state training step fits.

    ``workload`` is a path to a model file or an ``autotune.Workload``. ``device=None`` means CUDA
    when available, else the CPU. ``memory_limit`` ("8GiB", "512MiB" or bytes) emulates a smaller
    device. ``max_micro_batch`` caps the search (the per-device share of a target batch); None
    finds the true maximum. ``backend`` overrides the memory backend built from device and limit.
    ``use_estimate``: first search on fake tensors (nothing allocated), then prove that answer
    with real trials (two when the estimate is right); models that fake tensors cannot run are
    searched with real trials alone, and ``notes`` says so. The answer is exact either way.

    ``sharding="fsdp"`` probes one rank of ``world_size`` under FSDP2 (shard groups of
    ``shard_group`` ranks). Under torchrun every rank measures with real FSDP2 on the real process
    group; in one process the step runs on fake tensors with a fake process group against the
    device's budget (estimated, and ``notes`` says so).

    ``hint`` (sharded probes in one process) is where a prediction puts the answer: the search
    tries it and the next micro-batch first (see ``search_largest_fitting``); the answer is the
    same wherever it starts.

    ``share`` (the samples each rank takes per optimizer step, for a plan): a micro-batch
    below it means gradient accumulation, so trials below the share measure the steady state of
    an accumulation window (micro-steps that start with every gradient alive, see
    ``TrialSession.window_micro_batches``) and the trial at the share one step (see
    ``autotune.probing.share``); None: every trial is one step. A CUDA estimate (fake tensors,
    allocator modelled) tries only the micro-batches below the share that take fewer steps than
    every smaller one (``search_with_share``'s ``steps_only``): its answer is the largest of those. Sharded windows reduce-scatter
    every micro-step (``reduce_every_micro_step``, the least memory a sharded window needs;
    the planner estimates holding unsharded gradients apart, see ``window_trial``).

    Where nothing fits, ``explain`` runs one more step with the budget lifted (CPU and estimate
    backends) so that the error says how far over the budget the model is. The error is a
    ``SetupOutOfMemory`` when parameters, buffers and optimizer state alone do not fit.

    ``compile`` (True: inductor, or a torch.compile backend name; None: as the workload says)
    runs the real trials' step compiled, batch sizes dynamic (a module ``build_model`` compiles
    is run as it is); the estimate runs the eager step on fake tensors, in a child process for
    a model file, and only seeds the search (see ``autotune.compiled``).
    ``ProbeResult.graphs_compiled`` counts the graphs the trials compiled.

    ``parallel`` (an ``autotune.Layout``): probe one rank of that tensor/context/pipeline split
    of ``world_size`` ranks (``shard_group`` then counts data-parallel ranks).

    ``limit`` (bytes; a planner's budget less its headroom): where the largest micro-batch that
    fits the budget holds more, the search goes on below it to the largest within ``limit``
    (``share._down_to_limit``), so that a plan's micro-batch is measured, not predicted.
    ``least`` (with ``max_micro_batch`` at most it): only ``max_micro_batch`` is tried, the
    answer it or nothing (see ``search_with_share``).

    ``session_type`` (trials on fake tensors only): the ``EstimateSession`` subclass (or a factory
    of one) that runs them; ``autotune.timing.recorded`` counts the steps it runs as it goes.
    """
    checkpointing = CheckpointingRequest.parse(checkpointing, option=option("checkpointing"), allow_auto=False)
    workload = with_compile(load_workload(workload), compile)
    precision = Precision.parse(precision)
    sharding = Sharding.parse(sharding)
    if max_micro_batch is not None and (not isinstance(max_micro_batch, int) or max_micro_batch < 1):
        raise ProbeError(f"max_micro_batch must be a positive int or None, got {max_micro_batch!r}")
    backend = _layout_backend(backend or backend_for(device, memory_limit), sharding, parallel)
    info = backend.info()
    started = time.perf_counter()
    estimating = isinstance(backend, EstimateMemoryBackend)
    seed = None
    one_trial = least is not None and max_micro_batch is not None and least >= max_micro_batch
    # One trial asks all there is to ask (search_with_share): an estimate's search would only seed it.
    if (use_estimate and not estimating and not one_trial and not sharding.sharded
            and (parallel is None or parallel.trivial)):
        seed = (seed_in_child if isolated(workload) else estimate_seed)(
            workload, backend, precision=precision, checkpointing=checkpointing,
            upper=max_micro_batch, share=share)
    # On the estimate backend the session's tensors are fake: the model is built inside the fake
    # mode, and a model that fake tensors cannot run raises EstimateUnavailable.
    run_workload = on_fake_tensors(workload, foreach=backend.for_cuda) if estimating else workload
    def limits():
        return fake_tensor_limits(workload) if estimating else contextlib.nullcontext()

    setting = setting_label(precision, checkpointing)
    # On fake tensors the estimate's session counts the same bytes for less work (see
    # EstimateSession): it sets up the optimizer state without a step and measures the
    # optimizer phase once per session; identical blocks are measured on few of them.
    with layout_session(run_workload, backend,
                        session_type=(session_type or EstimateSession) if estimating else TrialSession,
                        precision=precision, checkpointing=checkpointing, sharding=sharding,
                        world_size=world_size, shard_group=shard_group,
                        reduce_every_micro_step=reduce_every_micro_step, parallel=parallel) as session:

        def within_limit(n: int):
            # Past the limit, a micro-batch above 1 is as good as out of memory to the search
            # (the largest within the limit is its answer); at 1 the probe reports what fits.
            return _planning_within(backend, limit if n > 1 else None)

        def run_trial(n: int) -> Trial:
            with within_limit(n):
                return session.run(n, window=window_steps(n, share))

        def known(n: int) -> bool:  # a fake-tensor session's memo answers it
            knows = getattr(session, "knows", None)
            with within_limit(n):
                return knows is not None and knows(n, window=window_steps(n, share))

        try:
            with limits(), session, progress.bar(f"probe {setting}", unit=" trial") as shown:
                run = progress.watch_trials(run_trial, shown, fake=estimating)
                best, trials, model = search_with_share(
                    run, budget=info.budget_bytes, upper=max_micro_batch, share=share,
                    hint=seed.hint if seed is not None else hint,
                    estimate=seed.estimate if seed is not None else None,
                    # Real trials prove one step at the share unless the estimate, which ran
                    # that very step on fake tensors, found it past the budget.
                    try_share=seed is None or seed.share_fits is not False,
                    # A CUDA estimate's trials (a modelled allocator, each on a build of its
                    # own) cost tens of seconds at 70B: only the micro-batches that change the
                    # plan's accumulation steps.
                    steps_only=estimating and backend.allocator is not None,
                    # A pipeline plans equal micro-batches (policy.split_for): of those, the
                    # divisors of the share; any other is planned as the divisor below it.
                    even=parallel is not None and parallel.pp > 1,
                    limit=limit, least=least, known=known,
                )
        except SetupOutOfMemory as exc:
            detail, trials, best = str(exc), [], 0
        else:
            detail = None
        if best == 0:
            needed = None
            if explain:
                with limits():
                    needed = _peak_without_budget(session, backend)
            message = _does_not_fit_message(workload, info, precision, session,
                                            trials[0] if trials else None, needed, detail,
                                            sharding=sharding, world_size=world_size)
            raise (SetupOutOfMemory if detail is not None else ProbeError)(message)
    notes = []
    if parallel is not None and not parallel.trivial:
        notes.append(f"one rank of {world_size} under "
                     f"{parallel.describe(world_size, str(sharding).upper())}")
    elif sharding.sharded:
        notes.append(f"one rank of {world_size} under {sharding} (shard group "
                     f"{resolve_shard_group(shard_group, world_size)})")
    if estimating:
        notes.append(f"every trial ran on fake tensors ({info.name}): estimated, nothing allocated")
    if session.compiled:
        notes.append(compiled_note(workload, session.graphs_compiled, len(trials),
                                   estimated=seed is not None and seed.answer is not None))
    if seed is not None:
        notes.append(seed.note(best, trials))
        model = seed.memory_model(trials, model)
        if seed.share_fits is False and share is not None and best < share:
            notes.append(f"one step of the whole share ({share}) was estimated past the budget "
                         f"and not tried for real")
    if any(t.window for t in trials):
        notes.append(f"trials below the share of {share} measured accumulation windows (the "
                     f"micro-steps after the first start with every gradient alive)")
    elif share is None and trials and trials[-1].gradient_bytes:
        grads = format_bytes(trials[-1].gradient_bytes)
        notes.append(f"each trial is one step: with gradient accumulation every micro-step after a "
                     f"window's first also holds the gradients ({grads}), which autotune plan "
                     f"measures")
    return ProbeResult(
        max_micro_batch=best,
        upper_bound=max_micro_batch,
        capped=max_micro_batch is not None and best == max_micro_batch,
        trials=trials,
        memory_model=model,
        device=info,
        precision=precision.value,
        checkpointing=session.checkpointing,
        total_blocks=session.total_blocks,
        seconds=time.perf_counter() - started,
        oom_count=sum(not t.fits for t in trials),
        notes=notes,
        estimate_steps=seed.steps if seed is not None else 0,
        estimated_max_micro_batch=seed.answer if seed is not None else None,
        share=share,
        compiled=session.compiled,
        compile_backend=workload.compile if session.compiled else None,
        graphs_compiled=session.graphs_compiled if session.compiled else None,
    )


def _layout_backend(backend: MemoryBackend, sharding: Sharding, parallel=None) -> MemoryBackend:
    """The backend a layout's trials run on: a sharded or model-parallel step outside torchrun
    is counted on fake tensors (the other ranks are not there to run with), fsdp-offload's against
    the device's budget without what the rank holds in host memory."""
    info = backend.info()
    split = sharding.sharded or (parallel is not None and not parallel.trivial)
    if split and not torch.distributed.is_initialized() and not isinstance(
            backend, EstimateMemoryBackend):
        return EstimateMemoryBackend(info.budget_bytes, for_cuda=backend.device.type == "cuda",
                                     target=info, offload=sharding.offload)
    if sharding.offload and isinstance(backend, EstimateMemoryBackend) and not backend.offload:
        return EstimateMemoryBackend(info.budget_bytes, for_cuda=backend.for_cuda, target=info,
                                     offload=True)
    if sharding.offload and type(backend) is CPUMemoryBackend and not backend.offload:
        # Real ranks on the CPU (torchrun): host memory is the same memory, counted apart.
        return backend.offloading()
    return backend


def _planning_within(backend, limit: int | None):
    """An estimate's trials inside may stop once their tensors pass ``limit``
    (``EstimateMemoryBackend.limit_bytes``); real trials run to their answer."""
    limited = getattr(backend, "limited", None)
    return limited(limit) if limited is not None else contextlib.nullcontext()


def window_trial(workload, backend: MemoryBackend, *, micro_batch: int, window: int, precision,
                 checkpointing, sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                 reduce_every_micro_step: bool = False,
                 micro_batches: list[int] | None = None, parallel=None,
                 limit: int | None = None) -> Trial | None:
    """One trial of a plan's optimizer step: a window of ``window`` accumulation steps at most
    ``micro_batch`` each (see ``TrialSession.window_micro_batches``), in the layout the probe
    would run it in; None when parameters and optimizer state alone do not fit.

    The planner runs it for a sharded plan with accumulation, whose probe reduce-scattered
    every micro-step, to estimate holding the unsharded gradients until the last instead.
    ``micro_batches``: run exactly these micro-steps (``TrialSession.run``). ``limit``: what the
    caller plans within (a budget less its headroom): an estimate past it may stop early
    (``Trial.past_limit``)."""
    workload = load_workload(workload)
    precision = Precision.parse(precision)
    sharding = Sharding.parse(sharding)
    backend = _layout_backend(backend, sharding, parallel)
    estimating = isinstance(backend, EstimateMemoryBackend)
    run_workload = on_fake_tensors(workload, foreach=backend.for_cuda) if estimating else workload
    limits = fake_tensor_limits(workload) if estimating else contextlib.nullcontext()
    with layout_session(run_workload, backend, session_type=EstimateSession if estimating else TrialSession,
                        precision=precision,
                        checkpointing=CheckpointingRequest.parse(checkpointing, allow_auto=False),
                        sharding=sharding, world_size=world_size, shard_group=shard_group,
                        reduce_every_micro_step=reduce_every_micro_step, parallel=parallel) as session:
        try:
            with limits, session, _planning_within(backend, limit):
                return session.run(micro_batch, window=window, micro_batches=micro_batches)
        except SetupOutOfMemory:
            return None


def _peak_without_budget(session: TrialSession, backend) -> tuple[int, bool] | None:
    """On the CPU, measure the real need at micro-batch 1 with the budget lifted: (bytes, whether
    they are the tensors' alone). A CUDA estimate of identical blocks (``TensorFloorSession``)
    gives its small builds' tensors, a lower bound of the reserved need, instead of a full build
    of a model that is far over (70B without checkpointing: 1.61 TiB).

    Not possible on CUDA (the device is the limit), where the message gives a lower bound.
    """
    unlimited = getattr(backend, "unlimited", None)
    if unlimited is None:
        return None
    tensor_peak = session.tensor_peak if isinstance(session, TensorFloorSession) else None
    with unlimited(), session:
        if tensor_peak is not None:
            return tensor_peak(1), True
        trial = session.run(1)
    return (trial.peak_bytes, False) if trial.fits else None


def _does_not_fit_message(workload, info, precision, session: TrialSession, trial: Trial | None,
                          needed, detail: str | None, *, sharding=Sharding.DDP,
                          world_size: int = 1) -> str:
    budget = info.budget_bytes
    if needed is not None:
        needed, tensors_alone = needed
        what = (f"needs {format_bytes(needed)} of tensors alone (reserved memory holds more)"
                if tensors_alone else f"needs {format_bytes(needed)}")
        need = (f"one training step at micro-batch 1 {what}, "
                f"{needed / budget:.2f}x the {format_bytes(budget)} budget")
    elif trial is None:
        need = f"one training step at micro-batch 1 does not fit ({detail})"
    else:
        need = (f"one training step at micro-batch 1 ran out of memory with "
                f"{format_bytes(trial.peak_bytes)} in use against a {format_bytes(budget)} budget")
    blocks, total = session.checkpointed_blocks, session.total_blocks
    # Where the weights, gradients and optimizer state alone pass the budget, bf16 autocast
    # (it keeps them in fp32) and checkpointing (it saves activations) cannot help.
    state_bound = _state_alone_too_big(budget, session, trial, detail)
    helps = []
    if precision is Precision.FP32 and not state_bound:
        helps.append("--precision bf16 (or fp16)")
    if (blocks < total or not total) and not state_bound:
        helps.append("--checkpointing on")
    helps.append("a device with more memory (or a larger --memory-limit)")
    if sharding.sharded:
        helps.append(f"more ranks than --world-size {world_size} to shard over")
        if not sharding.offload:
            helps.append("the shards and optimizer state in host memory (--sharding fsdp-offload)")
        layout = f", one rank of {world_size} under {sharding}"
    else:
        helps.append("sharding weights, gradients and optimizer state over ranks with FSDP "
                     "(--world-size N --sharding fsdp) or DeepSpeed ZeRO-3")
        if state_bound:
            helps.append("the shards and optimizer state in host memory (--world-size N "
                         "--sharding fsdp-offload)")
        layout = ""
    if state_bound:
        helps.append("an optimizer with less state in build_optimizer (Adam and AdamW keep two "
                     "values per parameter, SGD with momentum one, plain SGD none)")
        need += ("; the weights, gradients and optimizer state alone pass the budget, which "
                 "--precision bf16 (autocast keeps them in fp32) and --checkpointing (it saves "
                 "activations) cannot change")
    return (f"{workload.source} does not fit on {info.name} "
            f"({setting_label(precision, session.checkpointing_label)}{layout}): {need}. "
            f"What would help: {'; '.join(helps)}.")


def _state_alone_too_big(budget: int, session: TrialSession, trial: Trial | None,
                         detail: str | None) -> bool:
    """Whether the weights, gradients and optimizer state alone pass the budget: set-up ran out
    of memory, or a trial's baseline (weights, buffers, optimizer state) plus the gradients does."""
    if detail is not None:
        return True
    if trial is None or trial.baseline_bytes is None:
        return False
    gradients = trial.gradient_bytes or getattr(session, "gradient_bytes", 0) or 0
    return trial.baseline_bytes + gradients >= budget


__all__ = ["MemoryModel", "ProbeResult", "Trial", "fit_memory_model", "probe", "search_largest_fitting",
           "window_trial"]
