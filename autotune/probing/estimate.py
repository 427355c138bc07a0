"""Peak memory of the probe's training step, estimated on fake tensors (no memory allocated).

``EstimateSession`` is the probe's ``TrialSession`` run on ``memory.fake.EstimateMemoryBackend``,
made cheaper where that changes no byte it counts. ``estimate_peak`` is the public entry.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..errors import option
from ..memory.base import DeviceInfo
from ..memory.fake import EstimateMemoryBackend, checked_micro_batch, fake_tensor_limits, on_fake_tensors
from ..precision import Precision
from ..distributed.sharding.settings import Sharding
from ..workload.checkpoint_count import CheckpointingRequest
from ..workload.contract import load_workload
from .affine_blocks import checkpoint_first_blocks, first_blocks, layout_session
from .trial import TrialSession, optimizer_state_tensors


def estimate_peak(workload, micro_batch: int, *, precision="fp32", checkpointing=False,
                  sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                  accumulation_steps: int = 1, reduce_every_micro_step: bool = False,
                  parallel=None) -> int:
    """Bytes of one steady-state training step at ``micro_batch`` samples, without allocating.

    The step is the probe's (``TrialSession``): parameters, buffers and optimizer state, then
    batch, forward under autocast, backward, unscale, clip, optimizer step, zero_grad.
    ``workload`` is a path to a model file or an ``autotune.Workload``; ``checkpointing`` is
    off/on (or a bool), a count K of the repeated blocks, a fraction of them or a
    ``Checkpointing``. Raises
    ``EstimateUnavailable`` when the model cannot run under fake tensors (use ``probe`` then).

    ``sharding="fsdp"`` gives the peak of one rank of ``world_size`` under FSDP2, in shard
    groups of ``shard_group`` ranks (default: all of them), counted in this one process with a
    fake process group (see ``autotune.distributed.sharding.ranks``). ``"fsdp-offload"`` gives that rank's
    *device* peak: its shards, sharded gradients, optimizer state and optimizer step live in
    host memory (``estimate_offload_host_peaks`` says how much).

    ``accumulation_steps`` > 1 gives the peak of an accumulation window of that many
    micro-steps at ``micro_batch`` (the micro-steps after the first start with every gradient
    alive, see ``TrialSession.window_micro_batches``); sharded, its micro-steps hold this rank's
    unsharded gradients until the last, or reduce-scatter each (``reduce_every_micro_step``).

    ``parallel`` (an ``autotune.Layout``): one rank's peak under that tensor/context/pipeline
    split of ``world_size`` ranks; ``shard_group`` then counts data-parallel ranks.
    """
    return estimate_peaks(workload, [micro_batch], precision=precision, checkpointing=checkpointing,
                          sharding=sharding, world_size=world_size, shard_group=shard_group,
                          accumulation_steps=accumulation_steps,
                          reduce_every_micro_step=reduce_every_micro_step, parallel=parallel)[micro_batch]


def estimate_peaks(workload, micro_batches, *, precision="fp32", checkpointing=False,
                   sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                   accumulation_steps: int = 1, reduce_every_micro_step: bool = False,
                   parallel=None) -> dict[int, int]:
    """``estimate_peak`` for several micro-batches, building the fake model and its state once.

    The optimizer phase (unscale, clip, step) is measured at the first size and its transient
    reused at the others while every gradient has the same layout (see ``EstimateSession``).
    """
    trials = _estimate_trials(workload, micro_batches, precision=precision, checkpointing=checkpointing,
                              sharding=sharding, world_size=world_size, shard_group=shard_group,
                              window=accumulation_steps, reduce_every=reduce_every_micro_step,
                              parallel=parallel)
    return {n: trial.peak_bytes for n, trial in trials.items()}


def estimate_offload_host_peaks(workload, micro_batches, *, precision="fp32", checkpointing=False,
                                world_size: int, shard_group: int | None = None,
                                parallel=None) -> dict[int, int]:
    """Host memory one rank of ``world_size`` needs under ``fsdp-offload`` at each micro-batch:
    its parameter shards, sharded gradients, optimizer state and optimizer step (the device's
    peak is ``estimate_peaks(..., sharding="fsdp-offload")``)."""
    trials = _estimate_trials(workload, micro_batches, precision=precision, checkpointing=checkpointing,
                              sharding=Sharding.FSDP_OFFLOAD, world_size=world_size,
                              shard_group=shard_group, parallel=parallel)
    return {n: trial.host_peak_bytes for n, trial in trials.items()}


def estimate_cuda_peaks(workload, micro_batches, *, gpu_name: str = "", precision="fp32",
                        checkpointing=False, sharding="ddp", world_size: int = 1,
                        shard_group: int | None = None, parallel=None) -> dict[int, tuple[int, int]]:
    """``estimate_peaks`` for a CUDA device: {micro_batch: (tensor bytes, reserved bytes)}, the
    tensors' peak and what torch's caching allocator would reserve for them (modelled, see
    ``autotune.memory.cuda_allocator``; ``PYTORCH_CUDA_ALLOC_CONF`` is honoured), cuBLAS
    workspaces included (larger on Hopper: ``gpu_name`` such as "H100"). The tensor bytes leave
    the workspaces out, which ``torch.cuda.max_memory_allocated`` counts: on an H200 it read
    64.5-66.5 MiB above them (two handles' 66 MiB). Optimizers left to choose take their
    foreach path, as on CUDA."""
    trials = _estimate_trials(workload, micro_batches, precision=precision, checkpointing=checkpointing,
                              sharding=sharding, world_size=world_size, shard_group=shard_group,
                              for_cuda=gpu_name or "CUDA", parallel=parallel)
    return {n: (trial.allocated_peak_bytes, trial.reserved_peak_bytes) for n, trial in trials.items()}


def _estimate_trials(workload, micro_batches, *, precision, checkpointing, sharding, world_size,
                     shard_group, window: int = 1, reduce_every: bool = False,
                     for_cuda: str | None = None, parallel=None) -> dict:
    sizes = [checked_micro_batch(n) for n in micro_batches]
    if parallel is not None and parallel.pp > 1:
        # Each pipeline rank holds other stages: every one is estimated, the worst one counts.
        from .pipeline_trial import check_pipeline_window, worst_pipeline_trials

        check_pipeline_window(window, parallel)

        return worst_pipeline_trials(
            lambda fake_rank: estimate_session(workload, precision=precision, checkpointing=checkpointing,
                                               sharding=sharding, world_size=world_size,
                                               shard_group=shard_group, reduce_every=reduce_every,
                                               for_cuda=for_cuda, parallel=parallel, fake_rank=fake_rank),
            sizes, window=window, parallel=parallel, world_size=world_size)
    with estimate_session(workload, precision=precision, checkpointing=checkpointing,
                          sharding=sharding, world_size=world_size, shard_group=shard_group,
                          reduce_every=reduce_every, for_cuda=for_cuda, parallel=parallel) as session:
        return {n: session.run(n, window=window) for n in sizes}


@contextlib.contextmanager
def estimate_session(workload, *, precision, checkpointing, sharding, world_size, shard_group,
                     reduce_every: bool = False, session_type: type | None = None,
                     for_cuda: str | None = None, parallel=None, fake_rank: int = 0, build=None):
    """The estimate's session (``session_type``, default ``EstimateSession``) on the fake model,
    set up and entered: ``run(n)`` on it is one fake training step. Other counts of the same
    step (``autotune.timing``) run their own subclass here. ``for_cuda``: the CUDA device's
    name; its caching allocator is modelled (see ``EstimateMemoryBackend``). ``build``: an
    ``affine_blocks.SmallBuild``, the model cut to its first blocks, those it names checkpointed
    (``checkpointing`` is then the whole model's, only the build's checkpointed blocks count)."""
    checkpointing = CheckpointingRequest.parse(checkpointing, option=option("checkpointing"),
                                               allow_auto=False)
    workload = load_workload(workload)
    precision = Precision.parse(precision)
    sharding = Sharding.parse(sharding)
    target = DeviceInfo(kind="cuda", name=for_cuda, budget_bytes=0) if for_cuda else None
    backend = EstimateMemoryBackend(offload=sharding.offload, for_cuda=bool(for_cuda), target=target)
    fake = on_fake_tensors(workload, foreach=backend.for_cuda)
    if build is not None:  # checkpointed as the build says once set up
        fake, checkpointing = first_blocks(fake, build), CheckpointingRequest.parse("off")
    # Other counts of the step (a subclass) see every block: only the bytes are extended.
    with layout_session(fake, backend,
                        session_type=session_type or EstimateSession, few_blocks=session_type is None,
                        precision=precision, checkpointing=checkpointing, sharding=sharding,
                        world_size=world_size, shard_group=shard_group,
                        reduce_every_micro_step=reduce_every, parallel=parallel,
                        fake_rank=fake_rank) as session:
        with fake_tensor_limits(workload), session:
            if build is not None:
                checkpoint_first_blocks(session, build.checkpointed, build.blocks, workload.source)
            yield session


class EstimateSession(TrialSession):
    """The probe's session, made cheaper where that changes no byte it counts.

    - Optimizer state: the zero-gradient step that allocates Adam-like state only needs the
      state tensors it leaves behind (run() resets the peak before the measured step). For
      torch's Adam/AdamW the optimizer's own lazy initialisation (``_init_group``) allocates
      exactly that state without the update math; other built-in torch optimizers take their
      foreach path for that one step (same state, a few multi-tensor ops instead of a dozen
      ops per parameter). The measured step keeps the implementation the user (or the
      device) chose, so its transient is the real one.
    - The optimizer phase of the measured step is measured once per session (see
      ``_optimizer_phase``).
    """

    warm_up_step = False
    """A sharded session's warm-up step (``TrialSession._warm_up``), skipped: on fake tensors its
    one-time work leaves nothing the measured steps would count otherwise (DTensor's first
    sharding propagation runs in a fake mode of its own, uncounted since commit c202f4b; FSDP2's
    lazy set-up holds no memory), and it cost a full step per session, about a third of a
    one-trial estimate. tests/test_sharded_estimate.py holds the trials without it to those after
    it. Sessions that count a step's ops keep it (``timing.count``)."""

    _step_cost = None
    """(gradient layout, bytes the optimizer phase adds to the live bytes, and to the host's under
    fsdp-offload) of the first step."""

    def _setup(self):
        super()._setup()
        self._step_cost = None  # a warm-up step's optimizer phase is no steady-state one

    def _warm_up(self):
        if self.warm_up_step:
            super()._warm_up()

    def _optimizer_phase(self) -> int:
        # Measured once per session: its transient depends only on the gradients, parameters
        # and optimizer state, which are the same at every micro-batch when every parameter
        # gets a gradient of the same layout. Otherwise it is measured again.
        before = self.backend.current_bytes()
        host = self.backend.tracker if self.offload else None  # fsdp-offload: the step is the host's
        layout = _gradient_layout(self.params)
        # With the CUDA allocator modelled the phase is replayed every time: where its blocks
        # land depends on the cache the step before it left.
        if (self._step_cost is not None and self._step_cost[0] == layout
                and getattr(self.backend, "allocator", None) is None):
            # A budgeted search (the probe's) must still see the phase run out of memory.
            self.backend.tracker.check_growth(self._step_cost[1])
            if host is not None:
                host.host_peak = max(host.host_peak, host.host_current + self._step_cost[2])
            self.optimizer.zero_grad(set_to_none=True)
            return before + self._step_cost[1]
        if host is not None:
            host_before, earlier = host.host_current, host.host_peak
            host.host_peak = host_before
        step_peak = super()._optimizer_phase()
        host_cost = 0
        if host is not None:
            host_cost = host.host_peak - host_before
            host.host_peak = max(host.host_peak, earlier)
        self._step_cost = (layout, step_peak - before, host_cost)
        return step_peak

    def _optimizer_step(self):
        if self.sharded and _grads_placed_as_params(self.params):
            # On DTensors every multi-tensor op of the update pays DTensor's uncached sharding
            # propagation (seconds per op for an 80-layer model); the update is elementwise on
            # each rank's shard, so stepping the local shards allocates the same bytes.
            with _on_local_shards(self.optimizer):
                self._step_by_runs()
            return
        self._step_by_runs()

    def _step_by_runs(self):
        # A per-parameter (single-tensor) update frees a parameter's temporaries by the end
        # of the next parameter's update (the loop rebinds its locals), so the step's peak is
        # set by pairs of neighbouring parameters, and alike pairs give alike peaks: stepping
        # each distinct pair once, in order, reaches the full step's peak.
        runs = _distinct_neighbour_runs(self.optimizer)
        if runs is None:
            super()._optimizer_step()
            return
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for index, run in runs:
                for i, group in enumerate(groups):
                    group["params"] = run if i == index else []
                super()._optimizer_step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def _release_memory(self):
        # Fake tensors hold no memory, and a full garbage collection costs 0.1-0.2 s on a
        # large heap: collect only when reference cycles kept some fake storage alive.
        if self.backend.current_bytes() > self.start_bytes:
            super()._release_memory()

    def _allocate_optimizer_state(self):
        if _init_adam_state(self.optimizer):
            self.backend.adopt(optimizer_state_tensors(self.optimizer))
            return
        with _foreach_path(self.optimizer):
            super()._allocate_optimizer_state()




EstimateSession.plain_type = EstimateSession
"""The session type that counts bytes and nothing else, inherited by the subclasses that also
count a step's costs (timing.recorded): small builds whose steps are not extended run it (a
tensor floor's, affine_blocks.TensorFloorSession; untraced ones), so that what is recorded is
the whole model's step or the traced small builds' extended to it."""

def _gradient_layout(params) -> tuple:
    """What the optimizer phase's memory depends on: each gradient's layout and storage sharing."""
    storages: dict[int, int] = {}
    layout = []
    for p in params:
        grad = p.grad
        if grad is None:
            layout.append(None)
            continue
        storage = grad.untyped_storage()
        shared = storages.setdefault(storage._cdata, len(storages))
        layout.append((shared, storage.nbytes(), tuple(grad.shape), grad.stride(),
                       grad.storage_offset(), grad.dtype, grad.layout))
    return tuple(layout)


# torch optimizers whose single-tensor path updates one parameter at a time, keeping nothing
# between parameters but the parameter's own state.
_PER_PARAMETER_OPTIMIZERS = tuple(
    getattr(torch.optim, name) for name in (
        "Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
        "Rprop", "ASGD", "Adafactor",
    ) if hasattr(torch.optim, name)
)


def _distinct_neighbour_runs(optimizer: torch.optim.Optimizer) -> list[tuple[int, list]] | None:
    """Short runs of parameters, as (group index, parameters), that hold every pair of
    neighbouring parameter kinds (layout, gradient layout, state layout) of each group in their
    order, the group's first parameter first; None when the optimizer may not update parameters
    one at a time (foreach or fused kernels work on all of them at once; other optimizers are
    unknown)."""
    if type(optimizer) not in _PER_PARAMETER_OPTIMIZERS:
        return None
    runs = []
    for index, group in enumerate(optimizer.param_groups):
        with_grad = [p for p in group["params"] if p.grad is not None]
        if group.get("fused") or _takes_foreach_path(group, with_grad):
            return None
        # Parameters without a gradient are skipped by the update, so they are no neighbours.
        kinds = [_parameter_kind(p, optimizer.state.get(p, {})) for p in with_grad]
        seen = set()
        for i, p in enumerate(with_grad):
            pair = (kinds[i - 1] if i else None, kinds[i])
            if pair in seen:
                continue
            seen.add(pair)
            if i and runs and runs[-1][0] == index and runs[-1][1][-1] is with_grad[i - 1]:
                runs[-1][1].append(p)
            else:
                runs.append((index, [with_grad[i - 1], p] if i else [p]))
    return runs


def _takes_foreach_path(group: dict, params: list) -> bool:
    foreach = group.get("foreach")
    if foreach is not None:
        return bool(foreach)
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:
        return True  # cannot tell: assume it may
    # The optimizer's own choice when left to torch (the same call its step makes).
    return bool(_default_to_fused_or_foreach(params, bool(group.get("differentiable")),
                                             use_fused=False)[1])


def _parameter_kind(p: torch.Tensor, state: dict) -> tuple:
    def layout(t):
        if not isinstance(t, torch.Tensor):
            return repr(t)
        return (tuple(t.shape), t.stride() if t.layout == torch.strided else None, t.dtype,
                t.layout, t.device)

    grad = None if p.grad is None else layout(p.grad)
    return (layout(p), grad, tuple(sorted((str(k), layout(v)) for k, v in state.items())))


_ADAM_INIT_GROUP_ARGS = ("group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs",
                         "max_exp_avg_sqs", "state_steps")


def _init_adam_state(optimizer: torch.optim.Optimizer) -> bool:
    """Allocates torch's Adam/AdamW state with the optimizer's own lazy initialisation, the part of
    the first step that creates it, and none of the update math. False (nothing done) for any
    other optimizer, or a torch whose ``Adam._init_group`` takes other arguments."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    init_group = getattr(optimizer, "_init_group", None)
    try:
        names = tuple(inspect.signature(init_group).parameters) if init_group else ()
    except (TypeError, ValueError):
        return False
    if names != _ADAM_INIT_GROUP_ARGS:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p.grad for p in params]
    try:
        with torch.no_grad():
            for p in params:
                if p.requires_grad:  # the zero-gradient step gives every trainable parameter a grad
                    p.grad = p.detach()  # a view: _init_group only checks that a gradient exists
            for group in optimizer.param_groups:
                init_group(group, [], [], [], [], [], [])
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad
    return True


def _grads_placed_as_params(params) -> bool:
    """Every DTensor gradient laid out as its parameter, so the local shards step alike (a
    tensor-parallel embedding's gradient comes back replicated: DTensor's update redistributes
    it op by op, which the estimate then runs as it is)."""
    return all(getattr(p.grad, "placements", None) == getattr(p, "placements", None)
               for p in params if p.grad is not None)


@contextlib.contextmanager
def _on_local_shards(optimizer: torch.optim.Optimizer):
    """The optimizer steps each DTensor parameter's local shard, its gradient's and its state's,
    in place: the same tensors the DTensor update would write, without the DTensor dispatch."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    groups, state = optimizer.param_groups, optimizer.state
    saved_params = [group["params"] for group in groups]
    locals_ = []
    try:
        for group in groups:
            shards = []
            for p in group["params"]:
                shard = local(p)
                if shard is not p:
                    shard.grad = None if p.grad is None else local(p.grad)
                    state[shard] = {k: local(v) for k, v in state.get(p, {}).items()}
                    locals_.append((p, shard))
                shards.append(shard)
            group["params"] = shards
        yield
    finally:
        for group, params in zip(groups, saved_params):
            group["params"] = params
        for _, shard in locals_:
            # The step updated the shards' state in place (the session allocated all of it).
            state.pop(shard, None)
            shard.grad = None


@contextlib.contextmanager
def _foreach_path(optimizer: torch.optim.Optimizer):
    """Built-in torch optimizers take their foreach path inside; the groups are restored after."""
    saved = []
    if type(optimizer).__module__.startswith("torch.optim."):
        for group in optimizer.param_groups:
            if ("foreach" in group and not group["foreach"] and not group.get("fused")
                    and not group.get("differentiable") and not group.get("capturable")
                    and not isinstance(group.get("lr"), torch.Tensor)):
                saved.append((group, group["foreach"]))
                group["foreach"] = True
    try:
        yield
    finally:
        for group, value in saved:
            group["foreach"] = value


__all__ = ["EstimateSession", "estimate_cuda_peaks", "estimate_offload_host_peaks", "estimate_peak",
           "estimate_peaks", "estimate_session"]
