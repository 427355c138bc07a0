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
import functools
import inspect
import weakref

import torch
from torch._subclasses import fake_tensor

from ..errors import ConfigError, EstimateUnavailable
from ..precision import Precision
from .base import DeviceInfo
from .cpu import CPUMemoryBackend, StorageTracker

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
        """Estimating for a CUDA device: optimizers take their foreach path, as they do there."""
        self._info = target or DeviceInfo(
            kind="estimate",
            name="fake CPU tensors (estimate, nothing allocated)",
            budget_bytes=budget_bytes if budget_bytes is not None else 0,
            budget_source="estimate budget" if budget_bytes is not None else "none (estimate only)",
        )

    @contextlib.contextmanager
    def tracking(self):
        with _CountingFakeTensorMode(self.tracker):
            yield


_DEVICE_QUERY = torch.ops.prim.device.default


class _CountingFakeTensorMode(fake_tensor.FakeTensorMode):
    """A ``FakeTensorMode`` that counts the storages its ops return.

    One mode rather than the CPU backend's counting mode stacked on a fake one: every op then
    passes through one Python dispatch layer instead of two, about a fifth of an estimate's time.
    """

    def __init__(self, tracker: StorageTracker):
        # Real tensors that reach an op (constants a model file made at import) are converted,
        # rather than refused: they are part of what a real step would touch.
        super().__init__(allow_non_fake_inputs=True)
        self.tracker = tracker
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
            except torch.OutOfMemoryError:
                del out  # the traceback keeps this frame alive: drop the refused output now
                raise
        return out


def estimate_peak(workload, micro_batch: int, *, precision="fp32", checkpointing: bool = False) -> int:
    """Bytes of one steady-state training step at ``micro_batch`` samples, without allocating.

    The step is the probe's (``TrialSession``): parameters, buffers and optimizer state, then
    batch, forward under autocast, backward, unscale, clip, optimizer step, zero_grad.
    ``workload`` is a path to a model file or an ``autotune.Workload``. Raises
    ``EstimateUnavailable`` when the model cannot run under fake tensors (use ``probe`` then).
    """
    return estimate_peaks(workload, [micro_batch], precision=precision,
                          checkpointing=checkpointing)[micro_batch]


def estimate_peaks(workload, micro_batches, *, precision="fp32",
                   checkpointing: bool = False) -> dict[int, int]:
    """``estimate_peak`` for several micro-batches, building the fake model and its state once.

    The optimizer phase (unscale, clip, step) is measured at the first size and its transient
    reused at the others while every gradient has the same layout (see ``EstimateSession``).
    """
    from ..workload import load_workload

    workload = load_workload(workload)
    precision = Precision.parse(precision)
    sizes = [_checked_micro_batch(n) for n in micro_batches]
    session = _EstimateSession(on_fake_tensors(workload), EstimateMemoryBackend(),
                               precision=precision, checkpointing=bool(checkpointing))
    peaks: dict[int, int] = {}
    with fake_tensor_limits(workload), session:
        for n in sizes:
            peaks[n] = session.run(n).peak_bytes
    return peaks


@functools.cache
def _estimate_session_class():
    # The probe imports memory/, not the other way round.
    from ..probe.trial import TrialSession, _state_tensors

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

        _step_cost = None
        """(gradient layout, bytes the optimizer phase adds to the live bytes) of the first step."""

        def _optimizer_phase(self) -> int:
            # Measured once per session: its transient depends only on the gradients, parameters
            # and optimizer state, which are the same at every micro-batch when every parameter
            # gets a gradient of the same layout. Otherwise it is measured again.
            before = self.backend.current_bytes()
            layout = _gradient_layout(self.params)
            if self._step_cost is not None and self._step_cost[0] == layout:
                self.optimizer.zero_grad(set_to_none=True)
                return before + self._step_cost[1]
            step_peak = super()._optimizer_phase()
            self._step_cost = (layout, step_peak - before)
            return step_peak

        def _optimizer_step(self):
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
                self.backend.adopt(_state_tensors(self.optimizer))
                return
            with _foreach_path(self.optimizer):
                super()._allocate_optimizer_state()

    return EstimateSession


def _EstimateSession(*args, **kwargs):
    return _estimate_session_class()(*args, **kwargs)


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


@contextlib.contextmanager
def fake_tensor_limits(workload):
    """Turns "this model cannot run on fake tensors" into ``EstimateUnavailable``; any other
    failure (a bug in the model fails the same way on real tensors) propagates untouched."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised untouched unless it is a fake-tensor limit
        if not _is_fake_tensor_limit(exc):
            raise
        raise EstimateUnavailable(_unavailable_message(workload, exc)) from exc


def _checked_micro_batch(n) -> int:
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
        why = f"the step reads a tensor's value in Python ({detail}: .item(), .tolist(), `if tensor:`)"
    elif isinstance(exc, fake_tensor.UnsupportedOperatorException):
        why = f"the op {detail} has no fake-tensor (meta) implementation, e.g. a custom kernel"
    else:
        why = f"{type(exc).__name__}: {detail}"
    return (f"{workload.source}: peak memory cannot be estimated under fake tensors, because {why}. "
            f"Measure it with real trials instead (autotune probe), which need the device.")


__all__ = ["EstimateMemoryBackend", "estimate_peak", "estimate_peaks", "fake_tensor_limits",
           "on_fake_tensors"]
