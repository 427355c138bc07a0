"""FLOPs, bytes moved and collectives of one training step, counted on fake tensors.

The step is the estimate's (``probing.estimate.estimate_session``: the probe's steady-state step
on a fake model, sharded over a fake process group where asked), run once more with a
``TorchDispatchMode`` on top of the fake mode that records every op it sees: the ops eager
execution of the same step dispatches. FLOPs come from torch's own formulas
(``torch.utils.flop_counter``); bytes are what each op reads and writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from unittest import mock
from collections import Counter

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..compiled import eager_module
from ..distributed.context_parallel import inside_ring
from ..distributed.sharding.wrap import is_sharded
from ..memory.fake import checked_micro_batch
from ..probing.affine_blocks import built_whole_instead, small_builds
from ..probing.estimate import EstimateSession, _on_local_shards, estimate_session
from ..workload.contract import load_workload
from ..probing.trial import TrialSession
from .costs import CollectiveCall, OpCost, StepCosts, causal_share
from .extend import extend_checked_step_costs


def count_step_costs(workload, micro_batch: int, *, precision="fp32", checkpointing=False,
                     sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                     for_gpu: str | None = None, parallel=None) -> StepCosts:
    """What one steady-state training step at ``micro_batch`` costs, op by op (see ``StepCosts``).

    Arguments as ``estimate_peak``'s; raises ``EstimateUnavailable`` when the model cannot run on
    fake tensors. Under checkpointing the recomputed forward is counted (phase "recompute");
    sharded, every collective of this rank's step is recorded with its buffer's bytes.
    ``for_gpu`` (a CUDA device's name): the step a CUDA device runs, as the memory estimate for
    it runs it (optimizers left to choose take their foreach path); else this CPU's.
    ``parallel``: one rank's step under that model-parallel ``Layout``, its DTensor ops counted
    on the rank's local shards.
    """
    return count_steps_costs(workload, [micro_batch], precision=precision,
                             checkpointing=checkpointing, sharding=sharding,
                             world_size=world_size, shard_group=shard_group,
                             for_gpu=for_gpu, parallel=parallel)[micro_batch]


def count_steps_costs(workload, micro_batches, *, precision="fp32", checkpointing=False,
                      sharding="ddp", world_size: int = 1, shard_group: int | None = None,
                      for_gpu: str | None = None, parallel=None, few_blocks: bool = True) -> dict[int, StepCosts]:
    """``count_step_costs`` for several micro-batches, building the fake model once.
    ``parallel``: one rank's step under that model-parallel ``Layout``. ``few_blocks``: a model
    of many identical blocks is counted on three small builds and extended (the same counts,
    ``_extended_from_small_builds``); False counts the whole model."""
    if parallel is not None and parallel.pp > 1:
        return _slowest_stage_costs(workload, micro_batches, precision=precision,
                                    checkpointing=checkpointing, sharding=sharding,
                                    world_size=world_size, shard_group=shard_group, for_gpu=for_gpu,
                                    parallel=parallel)
    sizes = [checked_micro_batch(n) for n in micro_batches]
    settings = dict(precision=precision, checkpointing=checkpointing, sharding=sharding,
                    world_size=world_size, shard_group=shard_group, for_cuda=for_gpu, parallel=parallel)
    if few_blocks:
        extended = _extended_from_small_builds(workload, sizes, settings)
        if extended is not None:
            return extended
    return _counted(workload, sizes, settings)


def _counted(workload, sizes, settings, build=None) -> dict[int, StepCosts]:
    costs = {}
    with estimate_session(workload, session_type=_CountingSession, build=build, **settings) as session:
        for n in sizes:
            costs[n] = session.count(n)
    return costs


def _extended_from_small_builds(workload, sizes, settings) -> dict[int, StepCosts] | None:
    """The steps of a model of identical blocks, counted on three small builds and extended to the
    whole model (``timing.extend``): its blocks' ops, collectives and calls repeat per block.
    None where the builds do not apply (``affine_blocks.small_builds``), a cut block runs (the
    model keeps its blocks elsewhere too) or a step does not extend: count the whole model."""
    workload = load_workload(workload)
    found = small_builds(workload, settings["checkpointing"], parallel=settings["parallel"])
    if found is None:
        return None
    pattern, builds = found
    try:
        # The third build is the check, at the smallest size only (``extend_checked_step_costs``).
        counted = [_counted(workload, sizes if index < 2 else [min(sizes)], settings, build=build)
                   for index, build in enumerate(builds)]
    except Exception as exc:  # noqa: BLE001 - the whole model's count raises a genuine error again
        if not built_whole_instead(exc):
            raise
        return None
    return extend_checked_step_costs(counted, units=builds[0].units, repeats=pattern.repeats)


def _slowest_stage_costs(workload, micro_batches, **session) -> dict[int, StepCosts]:
    """A pipeline's step costs: ``slowest_stage`` of ``pipeline_rank_costs``."""
    per_rank = pipeline_rank_costs(workload, micro_batches, **session)
    return {n: slowest_stage([counts[n] for counts in per_rank]) for n in per_rank[0]}


def slowest_stage(ranks: list[StepCosts]) -> StepCosts:
    """The pipeline rank with the most work (FLOPs, then bytes moved) among ``ranks``' costs of
    one micro-step: the schedule runs at its slowest stage's pace."""
    return max(ranks, key=lambda c: (c.total_flops, c.total_bytes))


def pipeline_rank_costs(workload, micro_batches, *, precision="fp32", checkpointing=False,
                        sharding="fsdp", world_size: int, shard_group: int | None = None,
                        for_gpu: str | None = None, parallel, window: int = 1) -> list[dict[int, StepCosts]]:
    """[{n: one micro-step of pipeline rank r (its stages) and its optimizer phase}, for each
    pipeline rank r]: each rank counted in turn, in this one process, as the estimate takes each
    rank's peak. Its window of ``window`` micro-batches, at least ``pp`` (torch's schedules run at
    least that many), is counted after one unrecorded window that builds the schedule, and divided
    per micro-step (``_per_micro_step``)."""
    from ..probing.pipeline_trial import pipeline_fake_ranks

    sizes = [checked_micro_batch(n) for n in micro_batches]
    per_rank = []
    for fake_rank in pipeline_fake_ranks(parallel, world_size):
        with estimate_session(workload, precision=precision, checkpointing=checkpointing,
                              sharding=sharding, world_size=world_size, shard_group=shard_group,
                              session_type=_pipeline_counting_session(), for_cuda=for_gpu,
                              parallel=parallel, fake_rank=fake_rank) as counting:
            counts = {}
            for n in sizes:
                counting.run(n, window=window)  # the schedule's first window builds its buffers
                steps = len(counting.window_micro_batches(n, window))
                counts[n] = _per_micro_step(counting.count(n, window=window), steps)
            per_rank.append(counts)
    return per_rank


@functools.cache
def _pipeline_counting_session() -> type:
    """``_CountingSession`` running pipelined windows: the pipeline mixin's window (first in a
    pipelined type's order) runs the schedule itself, the recorder around its steady state
    (``_RecordsSteps.steady_state``)."""
    from ..probing.pipeline_trial import PipelineSessionMixin

    return type("_PipelineCountingSession", (PipelineSessionMixin, _CountingSession), {})


def _per_micro_step(costs: StepCosts, window: int) -> StepCosts:
    """``costs`` of a pipeline window of ``window`` micro-steps alike, as one micro-step and the
    optimizer phase: the micro-steps' ops, module calls and collectives divided among them. The
    backward's reduce-scatters stay whole: the schedule reduces a sharded stage's gradients once,
    on its last backward (time them with ``reduce_every_micro_step=False``)."""
    if window == 1:
        return costs
    micro = ("forward", "backward", "recompute")
    ops = []
    for op in costs.ops:
        if op.phase not in micro:
            ops.append(op)
        else:  # an op of fewer micro-steps than all (rare) still dispatches at least once
            ops.append(dataclasses.replace(op, flops=op.flops / window, bytes=op.bytes / window,
                                           fresh=op.fresh / window,
                                           count=max(1, round(op.count / window))))
    calls, seen = [], Counter()
    for call in costs.collectives:
        if call.phase not in micro or (call.phase == "backward" and call.kind == "reduce_scatter"):
            calls.append(call)
            continue
        seen[call] += 1
        if seen[call] % window == 0:  # one of every ``window`` alike
            calls.append(call)

    def per_phase(counts: dict) -> dict:
        return {p: (k // window if p in micro else k) for p, k in counts.items()}

    return dataclasses.replace(
        costs, ops=tuple(ops), collectives=tuple(calls), module_calls=per_phase(costs.module_calls),
        checkpoint_blocks=costs.checkpoint_blocks // window, dtensor_ops=per_phase(costs.dtensor_ops),
        dtensor_list_tensors=per_phase(costs.dtensor_list_tensors))


class _RecordsSteps:
    """A session mixin: while ``_recorder`` is set, every op of the window it runs is recorded
    (the micro-steps' phases, and the optimizer phase as such)."""

    _recorder: "_OpRecorder | None" = None
    warm_up_step = False
    """No warm-up step (a sharded session's first step, on fake tensors): what its first step
    does once (DTensor's first sharding propagation, FSDP2's lazy set-up and first all-gather
    outputs) the recorder passes uncounted (``_shadow_one_time_ops``), so the counted step is the
    steady-state one without a step before it; a warm-up cost a whole step, half of counting
    one (tests/test_recorded_steps.py holds the two equal)."""

    def _recorded(self, n: int, **run) -> tuple:
        """(the trial, the recorder) of one run at ``n``."""
        self._recorder = _OpRecorder()
        try:
            trial = super().run(n, **run)  # the session's own run, whatever a subclass adds
            return trial, self._recorder
        finally:
            self._recorder = None

    def _costs(self, recorder: "_OpRecorder", n: int) -> StepCosts:
        """What ``recorder`` saw of the step at ``n``, with the model's sharded units."""
        model = eager_module(self.model)
        return recorder.costs(n, units=sum(1 for m in model.modules() if is_sharded(m)),
                              sharded_params=sum(1 for p in model.parameters() if _is_dtensor(p)))

    def _window(self, sizes):
        if self._recorder is None:  # the sharded warm-up step: no steady state
            return super()._window(sizes)
        with self._recorder:
            return super()._window(sizes)

    def steady_state(self, *, pipelined: bool = False):
        # A pipeline's window (its mixin's, which records only from here: not the schedule's
        # first window, which builds its buffers once).
        if self._recorder is None:
            return super().steady_state(pipelined=pipelined)
        self._recorder.calls_start_forward = pipelined
        return self._recorder

    def _gradient_sync(self, enabled: bool) -> None:
        super()._gradient_sync(enabled)
        if self._recorder is not None:  # called as each micro-step starts: its forward
            self._recorder.backward_started = False


class _CountingSession(_RecordsSteps, EstimateSession):
    """The estimate's session with every op of the measured step recorded. Its optimizer phase
    runs whole each time (the estimate's shortcuts count bytes, not ops): the user's optimizer
    over every parameter, on each rank's local shards when sharded."""

    def count(self, n: int, *, window: int = 1) -> StepCosts:
        return self._costs(self._recorded(n, window=window)[1], n)

    def _optimizer_phase(self) -> int:
        if self._recorder is None:
            return super()._optimizer_phase()
        self._recorder.optimizer = True
        try:
            return TrialSession._optimizer_phase(self)
        finally:
            self._recorder.optimizer = False

    def _optimizer_step(self):
        if self._recorder is None:
            return super()._optimizer_step()
        if self.sharded:
            # The real step runs these ops on the DTensors whose local shards they are.
            self._recorder.mark_dtensors(_local_shards(self.optimizer))
            with _on_local_shards(self.optimizer):
                TrialSession._optimizer_step(self)
            return
        TrialSession._optimizer_step(self)


def _local_shards(optimizer):
    """The local shards of the optimizer's DTensors: parameters, gradients and state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in (p, p.grad, *optimizer.state.get(p, {}).values()):
                if _is_dtensor(t):
                    yield t._local_tensor


@functools.cache  # asked on every op the recorder sees
def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t) -> bool:
    return isinstance(t, _dtensor_type())


# c10d ops (and their functional forms) -> the collective they issue, and which argument holds
# the full buffer (the gathered output, the unscattered input).
_COLLECTIVES = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::alltoall_": ("all_to_all", 1),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
}

_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention")

# Allocate without writing, or alias without copying (``_unsafe_view``: a view whose schema
# does not say so, which matmul and autograd return their reshaped outputs through): no bytes moved.
_UNWRITTEN = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
              "aten::new_empty_strided", "aten::lift_fresh", "aten::_to_copy.fake",
              "aten::_unsafe_view"}

# The CPU's flash-attention kernels, which torch's flop counter does not list; their FLOPs are
# those of the other scaled_dot_product kernels (same arguments: query, key, value, ...).
_CPU_SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"
_CPU_SDPA_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"


class _OpRecorder(TorchDispatchMode):
    """Records (class, phase, FLOPs, bytes) of every op, and every collective, it sees.

    The phase: "optimizer" while the session's optimizer phase runs; otherwise ops run by the
    autograd engine (inside a backward node) are "backward", except those it runs with grad mode
    on, which is how ``torch.utils.checkpoint`` recomputes a checkpointed forward ("recompute");
    once the first backward node ran, ops outside nodes are still "backward" (the engine's final
    callbacks: FSDP2's last reduce-scatters) until the next micro-step starts
    (``backward_started`` reset); the rest are "forward".
    """

    def __init__(self):
        super().__init__()
        self.optimizer = False
        self.backward_started = False
        self.ops: Counter = Counter()
        self.collectives: list[CollectiveCall] = []
        self.module_calls: Counter = Counter()
        self.checkpoint_blocks = 0
        self.dtensor_ops: Counter = Counter()
        self.dtensor_list_tensors: Counter = Counter()
        self.optimizer_calls: list[tuple] = []
        self._as_dtensors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.optimizer_stepped = False
        self.optimizer_cut = False
        """Set by a session whose optimizer step ran, or ran on part of the parameters only."""
        self.calls_start_forward = False
        """A pipeline schedule interleaves micro-steps' forwards and backwards without a gradient
        sync call between them: a module called outside the autograd engine starts a forward."""
        self._recomputing_node = None
        self._hook = None
        self._shadowing = 0
        self._shadow_patch = None

    def __enter__(self):
        # Every module's __call__ while the step runs: a global pre-hook sees the calls the
        # model's own code makes (and checkpoint's recompute), whatever the model is.
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_called)
        self._shadow_patch = _shadow_one_time_ops(self)
        self._shadow_patch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        self._shadow_patch.__exit__(*exc)
        return super().__exit__(*exc)

    def _count_checkpoint_block(self) -> None:
        # Non-reentrant checkpoint recomputes a whole block inside the one backward node whose
        # saved tensor was unpacked first: a new node recomputing is a new block.
        node = torch._C._current_autograd_node()
        if node is not self._recomputing_node:
            self._recomputing_node = node
            self.checkpoint_blocks += 1

    def mark_dtensors(self, tensors) -> None:
        """Plain tensors standing for DTensors (local shards the fake step updates in place of
        the DTensors): ops on them, and on what those ops return, count as DTensor ops."""
        for t in tensors:
            self._as_dtensors[id(t)] = t

    def _dtensor_like(self, t) -> bool:
        return _is_dtensor(t) or self._as_dtensors.get(id(t)) is t

    def _count_dtensor_op(self, phase: str, args, kwargs, out) -> None:
        listed = sum(self._dtensor_like(t) for a in (*args, *kwargs.values())
                     if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor))
        if not listed and not any(self._dtensor_like(t) for t in tree_leaves((args, kwargs))
                                  if isinstance(t, torch.Tensor)):
            return
        self.dtensor_ops[phase] += 1
        self.dtensor_list_tensors[phase] += listed
        if self._as_dtensors:
            self.mark_dtensors(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                               and not _is_dtensor(t))

    def _module_called(self, module, args):
        if (self.calls_start_forward and not self.optimizer
                and torch._C._current_autograd_node() is None):
            self.backward_started = False  # a pipeline's next forward, after another's backward
        self.module_calls[self._phase()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _dtensor_type() in types and not isinstance(func, torch._ops.HigherOrderOperator):
            # Modes see an op before tensor subclasses do: its arguments still have their global
            # shapes. Declined, it goes to DTensor, whose ops on this rank's local shards (and
            # the collectives of its redistributions) come back through here to be counted.
            # Those collectives are functional ones (FSDP2, DDP and pipelines issue c10d's) and
            # are recorded in the optimizer phase (a sharded gradient norm's all-reduce) and in
            # context parallel's ring attention; forward and backward's others are the
            # tensor-parallel ones ``timing.layout`` times per block.
            if not self._shadowing:
                self._count_dtensor_op(self._phase(), args, kwargs, ())
            return NotImplemented
        out = func(*args, **kwargs)
        if func.namespace == "prim" or self._shadowing:  # metadata queries, not work
            return out
        phase = self._phase()
        if phase == "recompute":
            self._count_checkpoint_block()
        self._count_dtensor_op(phase, args, kwargs, out)
        name = func._schema.name
        collective = _COLLECTIVES.get(name)
        if collective is not None:
            ring = func.namespace == "_c10d_functional" and inside_ring()
            if ring or not (func.namespace == "_c10d_functional" and phase != "optimizer"):
                self.collectives.append(_collective_call(collective, args, kwargs, out, phase, ring=ring))
            return out
        if func.namespace == "_c10d_functional":  # waits: no work of their own
            return out
        attention = _attention_arguments(func, args, kwargs)
        flops = _dense_flops(func, args, kwargs, out) * _causal_share(attention)
        moved, fresh = _traffic(func, args, kwargs, out)
        op_class = _op_class(func, name, flops, moved, phase)
        kernel = _kernel(name, flops, causal=_is_causal(attention))
        self.ops[(op_class, phase, flops, moved, kernel, fresh)] += 1
        if phase == "optimizer":
            self.optimizer_calls.append((name, op_class, flops, moved, kernel, fresh))
        return out

    def _phase(self) -> str:
        if self.optimizer:
            return "optimizer"
        if torch._C._current_autograd_node() is None:
            return "backward" if self.backward_started else "forward"
        self.backward_started = True
        return "recompute" if torch.is_grad_enabled() else "backward"

    def costs(self, micro_batch: int, *, units: int = 0, sharded_params: int = 0) -> StepCosts:
        ops = tuple(OpCost(op_class=c, phase=p, flops=f * k, bytes=b * k, count=k, kernel=kernel,
                           fresh=fresh * k)
                    for (c, p, f, b, kernel, fresh), k in self.ops.items())
        return StepCosts(ops=ops, collectives=tuple(self.collectives), micro_batch=micro_batch,
                         module_calls=dict(self.module_calls),
                         checkpoint_blocks=self.checkpoint_blocks, sharded_units=units,
                         sharded_params=sharded_params, dtensor_ops=dict(self.dtensor_ops),
                         dtensor_list_tensors=dict(self.dtensor_list_tensors),
                         optimizer_calls=tuple(self.optimizer_calls))


@contextlib.contextmanager
def _shadow_one_time_ops(recorder: _OpRecorder):
    """What the host runs once, not every step, passed uncounted by ``recorder``:

    - DTensor deriving an op's output shape runs the op once on fake tensors of the global shapes
      (``ShardingPropagator._propagate_tensor_meta_non_cached``, once per distinct op and
      placements): no work of the rank's;
    - FSDP2's lazy set-up on the first forward (``FSDPState._lazy_init``) and its first
      all-gather's, which makes the all-gather outputs and the unsharded parameters as views of
      them (``FSDPParam.init_all_gather_outputs``, ``init_unsharded_param``): later steps reuse
      them. Only their first calls are passed (each returns at once after), so a step counted
      without a warm-up step before it counts what one after it counts (tests/test_recorded_steps.py).

    A torch without one of these methods runs none of it to hide."""
    patches = []
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        ShardingPropagator = None
    if getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None) is not None:
        patches.append((ShardingPropagator, "_propagate_tensor_meta_non_cached", lambda _self: True))
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        FSDPParam = FSDPState = None
    for owner, name, first in ((FSDPState, "_lazy_init", lambda s: s._is_root is None),
                               (FSDPParam, "init_all_gather_outputs", lambda s: not s.all_gather_outputs),
                               (FSDPParam, "init_unsharded_param", lambda s: not hasattr(s, "_unsharded_param"))):
        if getattr(owner, name, None) is not None:
            patches.append((owner, name, first))
    with contextlib.ExitStack() as stack:
        for owner, name, once in patches:
            stack.enter_context(mock.patch.object(owner, name, _shadowed(recorder, getattr(owner, name), once)))
        yield


def _shadowed(recorder: _OpRecorder, method, once):
    """``method`` with its ops uncounted where ``once(self)`` says this call is the one-time one."""

    @functools.wraps(method)
    def shadowed(self, *args, **kwargs):
        if not once(self):
            return method(self, *args, **kwargs)
        recorder._shadowing += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            recorder._shadowing -= 1

    return shadowed


def _op_class(func, name: str, flops: float, moved: float, phase: str) -> str:
    if phase == "optimizer":
        return "optimizer"
    if any(word in name for word in _ATTENTION_WORDS):
        return "attention"
    if flops:
        return "matmul"  # the flop counter's other ops: mm, addmm, bmm, baddbmm, convolutions
    return "elementwise" if moved else "other"


def _kernel(name: str, flops: float, *, causal: bool = False) -> str:
    """The op's family in ``costs.KERNELS``, or "" (an elementwise op like any other).
    ``causal``: an attention kernel run under ``is_causal``, whose rate per FLOP counted
    (``_causal_share``) is its own: a CPU's flash kernel skips no work at 128 tokens, so its rate
    per kept pair is half a masked or unmasked kernel's there."""
    suffix = "_backward" if "backward" in name else ""
    if any(word in name for word in _ATTENTION_WORDS):
        return ("attention_causal" if causal else "attention") + suffix
    if flops:
        return "convolution" + suffix if "conv" in name else "mm"
    if "pool" in name:
        return "pooling" + suffix
    for family in _BYTE_FAMILIES:
        if family in name:
            return family + suffix
    if name.endswith("_"):
        # torch's in-place ops (add_, mul_, addcmul_, lerp_, _foreach_*_, copy_): they write
        # where they read, where an out-of-place op first reads its output's lines into the
        # cache to write them (a third more traffic than an add's count of its bytes).
        return "inplace"
    return ""


# Memory-bound families by a word of their aten names (native_batch_norm, native_layer_norm,
# _softmax / _log_softmax and their _backward_data, embedding / embedding_dense_backward,
# nll_loss_forward / nll_loss_backward), and the activations whose arithmetic per element (erf,
# exp) keeps a CPU core below its bandwidth: gelu / gelu_backward, silu / silu_backward.
_BYTE_FAMILIES = ("batch_norm", "layer_norm", "softmax", "embedding", "nll_loss", "gelu", "silu")


def _dense_flops(func, args, kwargs, out) -> float:
    formula = flop_counter.flop_registry.get(func._overloadpacket)
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out))
    name = func._schema.name
    if name == _CPU_SDPA:
        query, key, value = args[:3]
        return float(flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape))
    if name == _CPU_SDPA_BACKWARD:
        grad_out, query, key, value = args[:4]
        return float(flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape,
                                                           value.shape))
    return 0.0


def _is_causal(attention: dict) -> bool:
    """An attention kernel (its ``_attention_arguments``) called with ``is_causal``, with its
    query and key."""
    return (bool(attention.get("is_causal")) and attention.get("query") is not None
            and attention.get("key") is not None)


def _attention_arguments(func, args, kwargs) -> dict:
    """An attention kernel's query, key and is_causal as called; {} for any other op."""
    if not any(word in func._schema.name for word in _ATTENTION_WORDS):
        return {}
    given = {}
    for i, argument in enumerate(func._schema.arguments):
        if argument.name in ("query", "key", "is_causal"):
            given[argument.name] = args[i] if i < len(args) else kwargs.get(argument.name)
    return given


def _causal_share(attention: dict) -> float:
    """The share of an attention kernel's (query, key) pairs it computes (``attention``: its
    ``_attention_arguments``): 1, or under
    ``is_causal`` those torch's causal mask keeps (``torch.ones(L, S).tril()``, the
    scaled_dot_product_attention docs). torch's flop counter counts the whole L × S square
    ("NB: We aren't accounting for causal attention here", torch/utils/flop_counter.py), where
    flash and memory-efficient kernels skip the masked blocks: FlashAttention-2's own benchmark
    counts causal attention at half the FLOPs (benchmarks/benchmark_flash_attention.py,
    ``flops(..., causal)``), and the attention rates here (``roofline.GPU_FRACTIONS``, this CPU's
    ``cpu_profile``) are rates of the FLOPs so counted. Context parallelism's ring runs its
    diagonal chunks causal and the others whole: both counted as they run."""
    if not _is_causal(attention):
        return 1.0
    return causal_share(attention["query"].shape[-2], attention["key"].shape[-2])


def _bytes_moved(func, args, kwargs, out) -> float:
    """Bytes an op reads (its tensor inputs, each once: ``addcmul_(grad, grad)`` reads the
    gradient once) and writes (its outputs); none for views, which alias their input, and for
    allocations that write nothing."""
    return _traffic(func, args, kwargs, out)[0]


def _traffic(func, args, kwargs, out) -> tuple[float, float]:
    """(``_bytes_moved``, of them the bytes of outputs that are new tensors: not an input written
    in place, as ``add_`` or an ``out=`` argument, and not a view)."""
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return 0.0, 0.0
    if func._schema.name in _UNWRITTEN:
        return 0.0, 0.0
    inputs = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    read = sum(_tensor_bytes(t) for t in inputs.values())
    written = fresh = 0
    for i, value in enumerate(out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)):
        size = sum(_tensor_bytes(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
        written += size
        if i < len(returns) and returns[i].alias_info is None:
            fresh += size
    return float(read + written), float(fresh)


def _tensor_bytes(t: torch.Tensor) -> int:
    # A view reads its own elements, not its base's whole storage; an expanded tensor (stride 0)
    # reads no more than its storage holds.
    own = t.numel() * t.element_size()
    try:
        return min(own, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
        return own


def _collective_call(collective, args, kwargs, out, phase: str, *, ring: bool = False) -> CollectiveCall:
    kind, where = collective
    buffer = out if where == "out" else args[where]
    size = sum(_tensor_bytes(t) for t in tree_leaves(buffer) if isinstance(t, torch.Tensor))
    return CollectiveCall(kind=kind, bytes=int(size), group_size=_group_size(args, kwargs),
                          phase=phase, ring=ring)


def _group_size(args, kwargs) -> int:
    import torch.distributed as dist

    for value in tree_leaves((args, kwargs)):
        if isinstance(value, dist.ProcessGroup):
            return value.size()
        if isinstance(value, str) and value:  # functional collectives name their group
            try:
                return dist.distributed_c10d._resolve_process_group(value).size()
            except (RuntimeError, ValueError, KeyError):
                continue
    return dist.get_world_size() if dist.is_initialized() else 1


__all__ = ["count_step_costs", "count_steps_costs", "pipeline_rank_costs"]
