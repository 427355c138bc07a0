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
import copy
import dataclasses
import logging
import os
import traceback
import weakref

import torch
from torch._subclasses import fake_tensor
from torch.utils import _pytree as pytree

from ..errors import ConfigError, EstimateUnavailable
from .base import DeviceInfo
from .cpu import CPUMemoryBackend, StorageTracker, tracking_resizes

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
    """

    kind = "estimate"

    def __init__(self, budget_bytes: int | None = None, *, for_cuda: bool = False,
                 target: DeviceInfo | None = None):
        # Not CPUMemoryBackend.__init__: its budget comes from this machine's RAM, which has
        # nothing to do with the device being estimated. Counting (adopt, peaks) is inherited.
        self.device = torch.device("cpu")
        self.tracker = StorageTracker(budget_bytes)
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

    @contextlib.contextmanager
    def tracking(self):
        gloo = None if self.for_cuda else _GlooCollectiveBuffers(self.tracker)
        self._mode = _CountingFakeTensorMode(self.tracker, gloo)
        try:
            with tracking_resizes(self.tracker), self._mode:
                yield
        finally:
            self._mode = None

    def release(self) -> None:
        # Between trials gloo's worker threads have long let go of the last collective.
        if self._mode is not None and self._mode.gloo is not None:
            self._mode.gloo.release()


_DEVICE_QUERY = torch.ops.prim.device.default
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_WAITS = (torch.ops._c10d_functional.wait_tensor.default,)

# Where each reduce-scatter takes its input: gloo reduces a full-size copy of it (an all-reduce
# of the copy, then this rank's chunk is copied to the output); NCCL writes to the output.
_REDUCE_SCATTER_INPUT = {"c10d::_reduce_scatter_base_": 1, "_c10d_functional::reduce_scatter_tensor": 0}


class _GlooCollectiveBuffers:
    """What a real gloo collective holds on the CPU that a fake process group (which completes
    every collective at once) does not, found by recording the live storages at the peaks of
    real 2- and 4-rank gloo runs (bench/README.md, "FSDP2 estimate"):

    - a reduce-scatter works on a copy of its whole input (FSDP2's flat unsharded gradients);
    - gloo's worker thread keeps the finished work, and with it the collective's tensors (that
      copy, the all-gather output FSDP2 has already copied out and dropped), until it gets the
      work queue's lock and the GIL back; the main thread goes on meanwhile, e.g. to copy out
      the next block's gathered parameters. Seen freed as late as that, never past the next
      collective (whose call releases the GIL): the estimate holds them until then, the larger
      of the peaks a real run shows.
    """

    released_late = True
    """Hold each collective's tensors until the next collective (False: free them as the call
    returns, the smaller peak a real run shows when every worker thread is prompt)."""

    def __init__(self, tracker: StorageTracker):
        self.tracker = tracker
        self._held: list[torch.Tensor] = []

    def collective(self, func, args, out, make_staging) -> None:
        self._held = []  # freed by the time the next collective is issued
        held = [t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
        index = _REDUCE_SCATTER_INPUT.get(func._schema.name)
        if index is not None and isinstance(args[index], torch.Tensor):
            staging = make_staging(args[index])
            self.tracker.add(staging)
            held.append(staging)
        if self.released_late:
            self._held = held

    def release(self) -> None:
        self._held = []


class _CountingFakeTensorMode(fake_tensor.FakeTensorMode):
    """A ``FakeTensorMode`` that counts the storages its ops return.

    One mode rather than the CPU backend's counting mode stacked on a fake one: every op then
    passes through one Python dispatch layer instead of two, about a fifth of an estimate's time.
    """

    def __init__(self, tracker: StorageTracker, gloo: "_GlooCollectiveBuffers | None" = None):
        # Real tensors that reach an op (constants a model file made at import) are converted,
        # rather than refused: they are part of what a real step would touch.
        super().__init__(allow_non_fake_inputs=True)
        self.tracker = tracker
        self.gloo = gloo
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and len(args) == 1 and isinstance(args[0], fake_tensor.FakeTensor):
            # Asked for nearly every tensor by the autograd engine and the optimizers, and answered
            # from the tensor itself as the fake mode answers it, without the fake mode's layers
            # of dispatch: it was two thirds of the estimate's ops.
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        # Ops the fake mode decomposes re-enter it. Only the outermost op's outputs count: those
        # are the ops the CPU backend's mode sees on real tensors, whose kernels allocate no
        # decomposition temporaries.
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs if kwargs is not None else {})
        finally:
            self._depth -= 1
        if self._depth == 0:
            try:
                self.tracker.add_outputs(out)
                if self.gloo is not None and func.namespace in _COLLECTIVE_NAMESPACES \
                        and func not in _WAITS:
                    self.gloo.collective(func, args, out, self._uncounted_copy)
            except torch.OutOfMemoryError:
                del out  # the traceback keeps this frame alive: drop the refused output now
                raise
        return out

    def _uncounted_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        self._depth += 1  # made here, counted by the caller
        try:
            return tensor.new_empty(tensor.shape)
        finally:
            self._depth -= 1


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
        if not _is_fake_tensor_limit(exc):
            raise
        raise EstimateUnavailable(_unavailable_message(workload, exc)) from exc
    finally:
        logger.setLevel(level)


def checked_micro_batch(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"micro-batch {n!r} is not a micro-batch size; give a positive int, e.g. 32")
    return n


def on_fake_tensors(workload, *, foreach: bool = False):
    """The workload with a model factory that the session calls inside the fake mode.

    ``foreach``: optimizers left to choose their implementation (``foreach=None``) take the
    foreach path, as they do on CUDA; on CPU tensors they would loop per parameter, and the
    foreach path's transient (about one parameter-size buffer for AdamW) would be missed.
    """
    original = workload
    if foreach:
        workload = dataclasses.replace(workload, build_optimizer=_foreach_optimizer(workload))

    def build_fake_model() -> torch.nn.Module:
        if original.model_is_instance:
            # A fake copy: the user's module and its real tensors stay untouched.
            model = _fake_copy(original.model, original.source)
        else:
            model = original.new_model()
        # Module.to() swaps fake parameters for new ones, and torch refuses the swap because the
        # fake mode keeps weak references to them. Fake CPU tensors are already where the step
        # runs, so the move is a no-op by definition.
        # A weak reference, so the fake model dies with its last user rather than at the next
        # garbage collection.
        model_ref = weakref.ref(model)
        model.to = lambda *args, **kwargs: model_ref()
        return model

    return dataclasses.replace(workload, model=build_fake_model)


def _foreach_optimizer(workload):
    def build(params) -> torch.optim.Optimizer:
        optimizer = workload.new_optimizer(params)
        for group in optimizer.param_groups:
            # Only where the user left the choice to torch (None) and did not ask for fused.
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
        return optimizer

    return build


def _fake_copy(model: torch.nn.Module, source: str) -> torch.nn.Module:
    try:
        return copy.deepcopy(model)
    except (TypeError, RuntimeError, copy.Error) as exc:
        raise EstimateUnavailable(
            f"{source}: the model instance cannot be copied onto fake tensors "
            f"({type(exc).__name__}: {exc}); pass the model file (a build_model() factory) or "
            f"measure with real trials (autotune probe)"
        ) from exc


def _is_fake_tensor_limit(exc: BaseException) -> bool:
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
    where = _where(exc, workload.source)
    return (f"{workload.source}: peak memory cannot be estimated under fake tensors, because {why}"
            f"{where}. Measure it with real trials instead (autotune probe), which need the device.")


# The phase of the probe's step that a frame of autotune's own code is in (innermost wins).
_PHASES = {
    "new_model": "building the model",
    "_fake_copy": "copying the model instance",
    "_allocate_optimizer_state": "allocating the optimizer state",
    "batch": "making the batch",
    "_forward_backward": "the forward and backward pass",
    "_optimizer_phase": "the optimizer step",
}
_AUTOTUNE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _where(exc: BaseException, source: str) -> str:
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


__all__ = ["EstimateMemoryBackend", "checked_micro_batch", "fake_tensor_limits", "on_fake_tensors"]
