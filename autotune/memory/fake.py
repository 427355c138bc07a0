"""Peak memory of a training step without allocating it: the step runs on fake tensors.

``EstimateMemoryBackend`` is a memory backend like the CPU one, except that inside ``tracking()``
every tensor is a ``FakeTensor`` (shape, dtype and storage size, no data). The CPU backend's
``StorageTracker`` counts the fake storages exactly as it counts real ones, so running the probe's
own ``TrialSession`` on this backend measures the very step a real trial measures (optimizer state,
precision, checkpointing included) in a fraction of the time and with no memory.

The tensors are fake *CPU* tensors: fake CUDA tensors can abort a CPU-only build, and the byte
counts of a step do not depend on the device (the CUDA caching allocator's rounding aside).

Models that need real values (``.item()``, ``if tensor:``, ``torch.nonzero``, boolean masks) or
that call kernels without a fake implementation cannot run like this; ``estimate_peak`` then
raises ``EstimateUnavailable`` and callers fall back to real trials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import traceback
import weakref

import torch
from torch._subclasses import fake_tensor
from torch.utils import _pytree as pytree

from ..errors import ConfigError, EstimateUnavailable
from .base import DeviceInfo
from ..compiled import eager_module
from .cpu import CPUMemoryBackend, StorageTracker, tracking_resizes
from .cuda_allocator import AllocatorConfig, CachingAllocatorModel, cublas_workspaces
from .fake_build import build_fake_model

# Failures that mean "this model cannot run on fake tensors", as opposed to a bug in the model
# (which fails the same way on real tensors and must reach the user untouched).
_FAKE_LIMITS = (
    fake_tensor.DataDependentOutputException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.UnsupportedOperatorException,
    fake_tensor.UnsupportedFakeTensorException,
)
# The same limits, raised as plain RuntimeErrors by torch.library custom ops and Tensor.numpy().
_FAKE_LIMIT_MESSAGES = (
    "no fake impl registered",
    "is not supported for tensor subclasses",
)


class EstimateMemoryBackend(CPUMemoryBackend):
    """The CPU backend on fake tensors: storage bytes are counted, nothing is allocated.

    With ``budget_bytes`` the tracker raises the same out-of-memory error as the CPU backend when
    the step passes it, so a probe search can run on estimates alone.

    ``for_cuda``: the storages are also replayed, in order, on a model of torch's CUDA caching
    allocator (``memory.cuda_allocator``, configured as ``PYTORCH_ALLOC_CONF`` or
    ``PYTORCH_CUDA_ALLOC_CONF`` configure torch's, or by ``allocator_config``), with the cuBLAS
    workspaces torch takes from it. Then, as on CUDA, the peak is what the allocator reserves
    (``peak_bytes``, what ``torch.cuda.max_memory_reserved()`` would show) and the budget holds
    reserved memory; ``memory_picture`` also gives the tensors' own peak (``allocated_peak_bytes``).
    """

    kind = "estimate"

    def __init__(self, budget_bytes: int | None = None, *, for_cuda: bool = False,
                 target: DeviceInfo | None = None, offload: bool = False,
                 allocator_config: AllocatorConfig | None = None):
        # Not CPUMemoryBackend.__init__: its budget comes from this machine's RAM, which has
        # nothing to do with the device being estimated. Counting (adopt, peaks) is inherited.
        self.device = torch.device("cpu")
        # fsdp-offload: peaks and budget are the device's, host memory apart (host_peak_bytes).
        self._count(budget_bytes, offload=offload)
        self.for_cuda = for_cuda
        """Estimating for a CUDA device: optimizers take their foreach path, as they do there.
        Otherwise the collectives of a sharded step (fake process group) hold memory as gloo's do
        on the CPU (see ``_GlooCollectiveBuffers``)."""
        self._mode = None
        self._info = target or DeviceInfo(
            kind="estimate",
            name="fake CPU tensors (estimate, nothing allocated)",
            budget_bytes=budget_bytes if budget_bytes is not None else 0,
            budget_source="estimate budget" if budget_bytes is not None else "none (estimate only)",
        )
        self.allocator = None
        if for_cuda:
            config = allocator_config or AllocatorConfig.parse(
                os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
            self.allocator = self.tracker.allocator = CachingAllocatorModel(config)
            for index, nbytes in enumerate(cublas_workspaces(hopper=is_hopper(self._info.name))):
                # Taken at the first matmul and kept: they are in every step's reserved memory.
                self.allocator.malloc(("cublas workspace", index), nbytes)
        self._trial_reserved = self._trial_tensors = 0
        self.limit_bytes: int | None = None
        """Where set (``limited``), what the caller plans within (a budget less its headroom):
        a trial whose tensors alone pass it may stop before its last small build, answered as not
        fitting (``Trial.past_limit``)."""
        self.trials_memo: dict | None = None
        """Where set (a dict: a --gpu planner's backend, one workload), the CUDA estimates' fresh
        trials (``probing.fresh_trials``) run on this backend's copies keep their answers here by
        setting, and one asked again is not run again."""

    @contextlib.contextmanager
    def limited(self, limit: int | None):
        """Inside, trials may stop once their tensors pass ``limit`` (see ``limit_bytes``)."""
        saved, self.limit_bytes = self.limit_bytes, limit
        try:
            yield self
        finally:
            self.limit_bytes = saved

    def fresh(self) -> "EstimateMemoryBackend":
        """A backend like this one (its target, the budget in force, offload, the allocator's
        configuration) whose tracker and modelled allocator have seen nothing yet."""
        return EstimateMemoryBackend(self.tracker.budget_bytes, for_cuda=self.for_cuda, target=self._info,
                                     offload=self.offload,
                                     allocator_config=self.allocator.config if self.allocator is not None else None)

    def counting_mode(self) -> fake_tensor.FakeTensorMode:
        """A fresh fake-tensor mode that counts into this backend's tracker."""
        gloo = None if self.for_cuda else _GlooCollectiveBuffers(self.tracker)
        return _CountingFakeTensorMode(self.tracker, gloo, uploads=self.offload)

    @contextlib.contextmanager
    def tracking(self):
        self._mode = self.counting_mode()
        try:
            # torch.compile'd code (a module or function the model compiled) runs eagerly here:
            # tracing a compiled graph on fake tensors can crash the process.
            with torch._dynamo.config.patch(disable=True), tracking_resizes(self.tracker), \
                    self._mode, uncounted_sharding_propagation():
                yield
        finally:
            self._mode = None

    @property
    def fake_mode(self):
        """The fake-tensor mode of the tracking in force (None outside it)."""
        return self._mode

    def release(self) -> None:
        # Between trials gloo's worker threads have long let go of the last collective.
        if self._mode is not None and self._mode.gloo is not None:
            self._mode.gloo.release()
        if self.allocator is not None:
            self.allocator.empty_cache()  # as the CUDA backend's release does

    def release_cached(self) -> None:
        if self.allocator is not None:
            self.allocator.empty_cache()

    def peak_bytes(self) -> int:
        return self.allocator.peak_reserved if self.allocator is not None else self.tracker.peak

    def reset_peak(self) -> None:
        if self.allocator is not None:
            # A trial's reserved and tensor peaks span its phases (as the CUDA backend's).
            self._trial_reserved = max(self._trial_reserved, self.allocator.peak_reserved)
            self._trial_tensors = max(self._trial_tensors, self.tracker.peak)
            self.allocator.reset_peak()
        self.tracker.reset_peak()

    def begin_trial(self) -> None:
        super().begin_trial()
        if self.allocator is not None:
            # The trial's peaks start here, not with what setup and warm-up reached before.
            self._trial_reserved = self._trial_tensors = 0
            self.allocator.reset_peak()
            self.tracker.reset_peak()

    def memory_picture(self) -> dict:
        picture = super().memory_picture()
        if self.allocator is not None:
            picture["reserved_peak_bytes"] = max(self._trial_reserved, self.allocator.peak_reserved)
            picture["allocated_peak_bytes"] = max(self._trial_tensors, self.tracker.peak)
        return picture


def is_hopper(name: str) -> bool:
    """Whether a device (or GPU profile) name is a Hopper GPU (sm90), whose cuBLAS workspace
    torch makes larger."""
    return re.search(r"\b(G?H(100|200|800)|H20)\b", name or "") is not None


_DEVICE_QUERY = torch.ops.prim.device.default


@functools.cache
def _decomposes_plainly(func) -> bool:
    """Whether the fake mode runs ``func`` as its CompositeImplicitAutograd decomposition, with
    nothing before that but checks a plain fake tensor passes (``_dispatch_impl``'s last
    resort: no Python meta, decomposition or C++ meta kernel of its own).

    Ops reach a mode undecomposed below autograd (inside DTensor's dispatch: ring attention's
    chunk, flatten and reshape on every ring step), where the fake mode first hashes their
    arguments for its cache, then bypasses it (a composite view may or may not alias), then
    walks its other paths, for the same outputs as calling the decomposition in the mode. Planning
    8B at sequence 131072, those three were 30% of the ring's ops and 10.6 of the 36.2 s the fake
    mode took (19,116 chunks, 8,924 flattens and reshapes); 6.2 s afterwards."""
    from torch._decomp import decomposition_table, meta_table

    return (isinstance(func, torch._ops.OpOverload)
            and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
            and func not in meta_table and func not in decomposition_table
            and torch.Tag.view_copy not in func.tags
            and func not in fake_tensor.FakeTensorMode._cpp_meta_supports_symint
            and func not in fake_tensor._DISPATCH_META_HANDLERS
            and func not in fake_tensor._DISPATCH_HANDLE_DIRECTLY
            and func not in fake_tensor.FakeTensorMode.lift_fns
            and func not in fake_tensor.FakeTensorMode._unbacked_special_fake_handling_ops)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_ALL_GATHER_COPY_IN = "fsdp::all_gather_copy_in"
_WAITS = (torch.ops._c10d_functional.wait_tensor.default,)

# Where each reduce-scatter takes its input: gloo reduces a full-size copy of it (an all-reduce
# of the copy, then this rank's chunk is copied to the output); NCCL writes to the output.
# DTensor's all-gather (tensor parallel: a colwise_gather_output head gathers the logits); gloo's
# worker thread holds its input and output like a reduce-scatter's (see _GlooCollectiveBuffers).
_FUNCTIONAL_ALL_GATHER = "_c10d_functional::all_gather_into_tensor"
_REDUCE_SCATTER_INPUT = {"c10d::_reduce_scatter_base_": 1, "_c10d_functional::reduce_scatter_tensor": 0}


class _GlooCollectiveBuffers:
    """What a real gloo reduce-scatter holds on the CPU that a fake process group (which completes
    every collective at once) does not, found by recording the live storages, with where they
    were allocated, at the peaks of real 2- and 4-rank gloo runs (bench/README.md, "FSDP2
    estimate"):

    - gloo reduce-scatters a copy of the whole input (FSDP2's flat unsharded gradients): an
      all-reduce of the copy, then this rank's chunk is copied to the output;
    - gloo's worker thread keeps the finished work, and with it that copy, until it gets the work
      queue's lock (and the GIL) back, while the main thread goes on, e.g. to copy out the next
      block's gathered parameters. Seen freed as late as that, never past the next collective:
      the estimate holds it until then, the larger of the peaks a real run shows.

    Finished all-gathers are let go late too (their output, already copied out), but only across
    a few small ops: held until the next collective, the last block's output would stay through
    a language model's head and loss, above any real peak (bench/README.md). DTensor's functional
    all-gather (tensor parallel) is held, input and output: the Llama head's gathered logits were
    seen held through the loss, to the byte (bench/README.md, "tp_estimate_accuracy.py").
    """

    released_late = True
    """Hold each reduce-scatter's tensors until the next collective (False: free the copy as the
    call returns, the smaller peak a real run shows when every worker thread is prompt)."""

    def __init__(self, tracker: StorageTracker):
        self.tracker = tracker
        self._held: list[torch.Tensor] = []

    def collective(self, func, args, out, make_staging) -> None:
        self._held = []  # freed by the time the next collective is issued
        if self.released_late and func._schema.name == _FUNCTIONAL_ALL_GATHER:
            self._held = [t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
            return
        index = _REDUCE_SCATTER_INPUT.get(func._schema.name)
        if index is None or not isinstance(args[index], torch.Tensor):
            return
        staging = make_staging(args[index])
        self.tracker.add(staging)
        if self.released_late:
            self._held = [*(t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)),
                          staging]

    def release(self) -> None:
        self._held = []


class _CountingFakeTensorMode(fake_tensor.FakeTensorMode):
    """A ``FakeTensorMode`` that counts the storages its ops return.

    One mode rather than the CPU backend's counting mode stacked on a fake one: every op then
    passes through one Python dispatch layer instead of two, about a fifth of an estimate's time.
    """

    def __init__(self, tracker: StorageTracker, gloo: "_GlooCollectiveBuffers | None" = None, *,
                 uploads: bool = False):
        # Real tensors that reach an op (constants a model file made at import) are converted,
        # rather than refused: they are part of what a real step would touch.
        super().__init__(allow_non_fake_inputs=True)
        self.tracker = tracker
        self.gloo = gloo
        self.uploads = uploads
        """fsdp-offload: FSDP2 copies each host shard to the device to all-gather it."""
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and len(args) == 1 and isinstance(args[0], fake_tensor.FakeTensor):
            # Asked for nearly every tensor by the autograd engine and the optimizers, and answered
            # from the tensor itself as the fake mode answers it, without the fake mode's layers
            # of dispatch: it was two thirds of the estimate's ops.
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        if func in _WAITS and self._depth == 0 and isinstance(args[0], fake_tensor.FakeTensor):
            # A real wait returns its input tensor (DTensor's functional collectives: tensor
            # parallel); the fake op would make a new one, counted twice.
            return args[0]
        # Ops the fake mode decomposes re-enter it. Only the outermost op's outputs count: those
        # are the ops the CPU backend's mode sees on real tensors, whose kernels allocate no
        # decomposition temporaries.
        kwargs = kwargs if kwargs is not None else {}
        self._depth += 1
        try:
            if _decomposes_plainly(func) and self._plain_fakes(args, kwargs):
                with self:
                    out = func.decompose(*args, **kwargs)
            else:
                out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if self._depth == 0:
            try:
                if self.uploads and func._schema.name == _ALL_GATHER_COPY_IN:
                    # The device copies of the host shards (copied in, then dropped) live while
                    # the all-gather output is allocated; on fake CPU tensors they are no copies.
                    self.tracker.count_transient(sum(t.untyped_storage().nbytes() for t in args[0]))
                self.tracker.add_outputs(out)
                if self.gloo is not None and func.namespace in _COLLECTIVE_NAMESPACES \
                        and func not in _WAITS:
                    self.gloo.collective(func, args, out, self._uncounted_copy)
            except torch.OutOfMemoryError:
                del out  # the traceback keeps this frame alive: drop the refused output now
                raise
        return out

    def _plain_fakes(self, args, kwargs) -> bool:
        """Whether every tensor among the arguments is this mode's fake tensor, without a constant
        (the fake mode would propagate one) or symbolic sizes, and nothing else is a tensor."""
        if self.shape_env is not None or self.propagate_real_tensors:
            return False
        for value in pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor):
                if (type(value) is not fake_tensor.FakeTensor or value.fake_mode is not self
                        or value.constant is not None):
                    return False
            elif isinstance(value, torch.SymInt):
                return False
        return True

    @contextlib.contextmanager
    def uncounted(self):
        """Ops run inside count nothing: work a real run does on fake tensors of its own (a
        pipeline's shape inference, a forward of the whole model), which allocates nothing."""
        self._depth += 1  # only the outermost op's outputs count: none is outermost here
        try:
            yield
        finally:
            self._depth -= 1

    def _uncounted_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.uncounted():  # made here, counted by the caller
            return tensor.new_empty(tensor.shape)


@contextlib.contextmanager
def uncounted_sharding_propagation():
    """DTensor's sharding propagation counts nothing.

    The first propagation of an op at a new shape runs the op on fake tensors of the global
    shape, in the fake mode it finds (``detect_fake_mode``: the counting mode here; a real run's
    DTensor makes a fake mode of its own, so those tensors take no memory on any device); later
    propagations hit caches that live as long as the process. Counted, they were phantom
    transients the modelled allocator grew segments around, and how many depended on what ran
    before in the process (found by the trace-synthesis prototype, branch trace-synthesis). On
    bench/llama_like.py's decoder at 12 blocks of width 1024, FSDP 8, bf16, every block
    checkpointed, micro-batch 2: 1.323 GB reserved counted, 1.208 GB not; the tensors' peak is
    870.6 MB either way."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # a torch without DTensor propagates nothing
        yield
        return
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(original)
    def propagate(self, *args, **kwargs):
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        uncounted = getattr(mode, "uncounted", None)
        with uncounted() if uncounted is not None else contextlib.nullcontext():
            return original(self, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def fake_tensor_limits(workload):
    """Turns "this model cannot run on fake tensors" into ``EstimateUnavailable``; any other
    failure (a bug in the model fails the same way on real tensors) propagates untouched."""
    # torch logs every failed meta kernel at ERROR (19 lines of its own traceback) before raising;
    # the exception itself is what the user needs, once.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised untouched unless it is a fake-tensor limit
        if not is_fake_tensor_limit(exc):
            raise
        raise EstimateUnavailable(_unavailable_message(workload, exc)) from exc
    finally:
        logger.setLevel(level)


def checked_micro_batch(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"micro-batch {n!r} is not a micro-batch size; give a positive int, e.g. 32")
    return n


def on_fake_tensors(workload, *, foreach: bool = False):
    """The workload with a model factory that the session calls inside the fake mode (see
    ``fake_build``: a model that cannot be built on fake tensors is built on the meta device, or
    for real, and converted).

    ``foreach``: optimizers left to choose their implementation (``foreach=None``) take the
    foreach path, as they do on CUDA; on CPU tensors they would loop per parameter, and the
    foreach path's transient (about one parameter-size buffer for AdamW) would be missed.
    """
    original = workload
    if foreach:
        workload = dataclasses.replace(workload, build_optimizer=_foreach_optimizer(workload))

    def fake_model(cut=None) -> torch.nn.Module:
        model = build_fake_model(original, cut)
        # build_model()'s torch.compile: the eager module it wraps (see autotune/compiled.py).
        model = eager_module(model)
        # Module.to() swaps fake parameters for new ones, and torch refuses the swap because the
        # fake mode keeps weak references to them. Fake CPU tensors are already where the step
        # runs, so the move is a no-op by definition.
        # A weak reference, so the fake model dies with its last user rather than at the next
        # garbage collection.
        model_ref = weakref.ref(model)
        model.to = lambda *args, **kwargs: model_ref()
        return model

    fake_model.takes_cut = True  # see build_fake_model

    return dataclasses.replace(workload, model=fake_model, compile=None)


def _foreach_optimizer(workload):
    def build(params) -> torch.optim.Optimizer:
        optimizer = workload.new_optimizer(params)
        for group in optimizer.param_groups:
            # Only where the user left the choice to torch (None) and did not ask for fused.
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
        return optimizer

    return build


def is_fake_tensor_limit(exc: BaseException) -> bool:
    if isinstance(exc, _FAKE_LIMITS):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _FAKE_LIMIT_MESSAGES)


def _unavailable_message(workload, exc: BaseException) -> str:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, fake_tensor.DynamicOutputShapeException):
        why = f"an op's output shape depends on the data ({detail}: torch.nonzero, a boolean mask, unique)"
    elif isinstance(exc, fake_tensor.DataDependentOutputException):
        why = f"the code reads a tensor's value in Python ({detail}: .item(), .tolist(), `if tensor:`)"
    elif isinstance(exc, fake_tensor.UnsupportedOperatorException):
        why = f"the op {detail} has no fake-tensor (meta) implementation, e.g. a custom kernel"
    else:
        why = f"{type(exc).__name__}: {detail}"
    return (f"{workload.source}: peak memory cannot be estimated under fake tensors, because {why}"
            f"{failure_site(exc, workload.source)}. Measure it with real trials instead (autotune "
            f"probe), which need the device.")


# The phase of the probe's step that a frame of autotune's own code is in (innermost wins).
_PHASES = {
    "new_model": "building the model",
    "fake_copy": "copying the model onto fake tensors",
    "_allocate_optimizer_state": "allocating the optimizer state",
    "batch": "making the batch",
    "_forward_backward": "the forward and backward pass",
    "_optimizer_phase": "the optimizer step",
}
_AUTOTUNE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def failure_site(exc: BaseException, source: str) -> str:
    """", while building the model, at model.py:12 (in build_model) via timm/vit.py:40" for the
    message: the phase, the innermost frame of the model file, and the innermost frame of other
    code (a library the file uses), whichever are found in the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    phase = next((_PHASES[f.name] for f in reversed(frames)
                  if f.name in _PHASES and f.filename.startswith(_AUTOTUNE_DIR)), None)
    user_file = os.path.abspath(source) if os.path.isfile(source) else None
    own = next((f for f in reversed(frames) if user_file and os.path.abspath(f.filename) == user_file), None)
    other = next((f for f in reversed(frames) if not f.filename.startswith((_AUTOTUNE_DIR, _TORCH_DIR))
                  and f is not own and "<frozen" not in f.filename), None)
    if own is not None and other is not None and frames.index(other) < frames.index(own):
        other = None  # a caller of the model file (a test runner, say), not a library it calls
    parts = [f"while {phase}"] if phase else []
    if own is not None:
        parts.append(f"at {own.filename}:{own.lineno} (in {own.name}: {own.line.strip()})")
    if other is not None:
        parts.append(f"{'via' if own is not None else 'at'} {other.filename}:{other.lineno} "
                     f"(in {other.name}: {other.line.strip()})")
    return (", " + " ".join(parts)) if parts else ""


__all__ = ["EstimateMemoryBackend", "checked_micro_batch", "is_hopper", "failure_site", "fake_tensor_limits",
           "is_fake_tensor_limit", "on_fake_tensors"]
