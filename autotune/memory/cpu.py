"""The CPU memory backend: live tensor-storage bytes tracked against a budget.

A ``TorchDispatchMode`` sees every tensor an op returns; each new storage is counted once and
uncounted by a ``weakref.finalize`` when it dies. Parameters, buffers, gradients and optimizer
state created before tracking are adopted explicitly. Passing the budget raises
``torch.OutOfMemoryError``, so a probe on the CPU takes the very code path it takes on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError
from ..units import format_bytes, parse_bytes
from .base import DeviceInfo, MemoryBackend
from .cuda_allocator import AllocatorOutOfMemory

DEFAULT_RAM_FRACTION = 0.5
"""Without --memory-limit, the CPU budget is this share of the RAM psutil reports available."""


class StorageTracker:
    """Live bytes of distinct tensor storages, with a peak and an optional budget."""

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self._live: dict[int, int] = {}
        self._watch: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.allocator = None
        """A ``cuda_allocator.CachingAllocatorModel`` that every allocation, resize and free is
        replayed on, in order (estimates for a CUDA device); None: storages are only counted. Its
        limit is this tracker's budget: a segment past it is refused like a byte past it."""

    def add(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(tensor):
            # A DTensor (FSDP2's sharded parameters) holds no storage itself: its local shard does.
            for name in tensor.__tensor_flatten__()[0]:
                self.add(getattr(tensor, name))
            return
        # A FakeTensor answers .device with a dispatched op (prim.device) that costs as much as a
        # real op, and the estimate would pay it for every output; its fake_device is free.
        device = getattr(tensor, "fake_device", None) or tensor.device
        if device.type != "cpu":  # meta tensors included: they have no storage to count
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse and other storage-less tensors: nothing we can attribute
        self.add_storage(storage)

    def add_storage(self, storage: torch.UntypedStorage) -> None:
        """Counts a storage at its current size (again after it was resized)."""
        key = storage._cdata
        nbytes = storage.nbytes()
        known = self._live.get(key)
        delta = nbytes if known is None else nbytes - known
        if delta > 0:
            self.check_growth(delta)
        if self.allocator is not None and (delta or known is None):
            self._replay(key, known, nbytes)
        if known is None:
            # A plain weak reference with a callback: weakref.finalize costs several times more,
            # and the fake-tensor estimate pays it for every storage of the step.
            self._watch[key] = weakref.ref(storage, functools.partial(self._forget, key))
        if delta or known is None:
            self._live[key] = nbytes
            self.current += delta
            self.peak = max(self.peak, self.current)

    def add_outputs(self, out) -> None:
        """Counts the tensors an op returned."""
        # Most ops return one tensor; flattening every output shows in the per-op cost.
        if isinstance(out, torch.Tensor):
            leaves = [out]
        else:
            leaves = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        del out
        try:
            for leaf in leaves:
                self.add(leaf)
        except torch.OutOfMemoryError:
            del leaves, leaf  # as in the caller: the traceback must not keep the refused output
            raise

    def check_growth(self, delta: int) -> None:
        """Refuses ``delta`` more bytes past the budget, before they are allocated.

        Refused before counting, as a real allocator holds nothing after a failed request: code
        that handles the OOM (ours, Lightning's, Accelerate's) can allocate again."""
        if self.budget_bytes is not None and self.current + delta > self.budget_bytes:
            self.peak = max(self.peak, self.current + delta)
            raise self._out_of_memory(delta)

    def _replay(self, key: int, known: int | None, nbytes: int) -> None:
        self.allocator.limit = self.budget_bytes
        try:
            if known is None:
                self.allocator.malloc(key, nbytes)
            else:
                self.allocator.resize(key, nbytes)
        except AllocatorOutOfMemory as exc:
            self.peak = max(self.peak, self.current + max(nbytes - (known or 0), 0))
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (modelled caching allocator): tried to allocate "
                f"{format_bytes(nbytes)} needing a new {format_bytes(exc.requested)} of reserved "
                f"memory with {format_bytes(exc.reserved)} reserved, for "
                f"{format_bytes(self.current)} of tensors, of the {format_bytes(exc.limit)} "
                f"autotune budget") from None

    def count_transient(self, nbytes: int) -> None:
        """An allocation freed before the next op: moves the peaks, leaves nothing."""
        self.check_growth(nbytes)
        if self.allocator is not None:
            key = ("transient", self)
            self._replay(key, None, nbytes)
            self.allocator.free(key)
        self.peak = max(self.peak, self.current + nbytes)

    def _out_of_memory(self, delta: int) -> torch.OutOfMemoryError:
        # Worded as torch's own CPU allocator failure, so every OOM handler (ours, Lightning's,
        # Accelerate's) recognises it the same way it recognises a real one.
        return torch.OutOfMemoryError(
            f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {delta} bytes "
            f"({format_bytes(delta)}) with {format_bytes(self.current)} already in use "
            f"of the {format_bytes(self.budget_bytes)} autotune CPU budget"
        )

    def _forget(self, key: int, _ref=None) -> None:
        self._watch.pop(key, None)
        nbytes = self._live.pop(key, 0)
        self.current -= nbytes
        if self.allocator is not None:
            self.allocator.free(key)

    def reset_peak(self) -> None:
        self.peak = self.current

    def live_keys(self) -> frozenset:
        return frozenset(self._live)

    def disown(self, keys) -> int:
        """Stop counting these storages (they stay watched: freeing one later changes nothing)."""
        dropped = sum(self._live.pop(key, 0) for key in keys)
        self.current -= dropped
        if self.allocator is not None:
            for key in keys:
                self.allocator.free(key)
        return dropped


@contextlib.contextmanager
def tracking_resizes(tracker: StorageTracker):
    """Counts ``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2 frees and refills its
    gathered parameters that way (as torch's own MemTracker does, by the same patch)."""
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage, size):
        grows = size > storage.nbytes()
        if grows:
            tracker.check_growth(size - storage.nbytes())
        result = original(storage, size)
        if storage._cdata in tracker._live or grows:
            tracker.add_storage(storage)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


_COUNTING: list[StorageTracker] = []
"""Trackers inside ``tracking_inductor_buffers`` (the innermost last)."""


@contextlib.contextmanager
def tracking_inductor_buffers(tracker: StorageTracker):
    """Counts the buffers inductor's generated CPU code allocates: it calls
    ``torch._C._dynamo.guards._empty_strided_cpu`` directly, which no dispatch mode sees (its
    kernels then write into them). The generated module binds the function when it is loaded,
    which is when the step compiles: a module compiled inside keeps the counting wrapper, which
    counts on whichever tracker is inside this block when it runs (none: it only allocates)."""
    guards = getattr(torch._C._dynamo, "guards", None)
    original = getattr(guards, "_empty_strided_cpu", None)
    if original is None:  # a torch without it: nothing of inductor's to count
        yield
        return

    @functools.wraps(original)
    def empty_strided_cpu(*args, **kwargs):
        tensor = original(*args, **kwargs)
        if _COUNTING:
            _COUNTING[-1].add(tensor)
        return tensor

    guards._empty_strided_cpu = empty_strided_cpu
    _COUNTING.append(tracker)
    try:
        yield
    finally:
        _COUNTING.pop()
        guards._empty_strided_cpu = original


class _TrackingMode(TorchDispatchMode):
    def __init__(self, tracker: StorageTracker):
        super().__init__()
        self.tracker = tracker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile runs a frame eagerly while a dispatch mode that does not say this is
        # active: a compiled step would be measured as the eager one. Saying it, the mode sees
        # the compiled graph's ops at run time (not the tracing), which is the compiled step's
        # memory (with inductor's own buffers: tracking_inductor_buffers).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(hasattr(t, "__tensor_flatten__") for t in types):
            # A tensor subclass (DTensor) runs the op on its inner tensors, which come back
            # through this mode: their temporaries are counted, as the fake-tensor mode counts them.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if isinstance(out, FakeTensor) or (not isinstance(out, torch.Tensor) and any(
                isinstance(t, FakeTensor) for t in tree_flatten(out)[0])):
            # A fake mode of torch's own (DTensor's sharding propagation runs an op on fake
            # tensors of the global shape): nothing is allocated, as the estimate counts it
            # (memory.fake.uncounted_sharding_propagation).
            return out
        try:
            self.tracker.add_outputs(out)
        except torch.OutOfMemoryError:
            # The traceback keeps this frame alive: drop the refused output so it is freed now.
            del out
            raise
        return out


@contextlib.contextmanager
def counting(tracker: StorageTracker):
    """Count every tensor created inside the block on ``tracker``."""
    with _TrackingMode(tracker):
        yield


class HostDeviceTracker(StorageTracker):
    """A tracker for fsdp-offload's device: ``current``, ``peak`` and the budget are the device's;
    storages moved to the host (``move_to_host``) or made inside ``on_host()`` are counted apart,
    in ``host_current`` and ``host_peak``.

    On fake CPU tensors, and on real ones where the device is the CPU, FSDP2's copies between
    host and device are no-ops (the same tensor comes back), so where the data lives is told from
    what FSDP2 does with it (see
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` and ``_fsdp_collectives.py``): the
    sharded parameters and their gradients are host tensors, the optimizer steps on the host,
    and everything else of the step (gathered parameters, collective buffers, activations,
    unsharded gradients, the batch, module buffers) is on the device.
    """

    def __init__(self, budget_bytes: int | None = None):
        super().__init__(budget_bytes)
        self._host: dict[int, int] = {}
        self._making_host = False
        self.host_current = 0
        self.host_peak = 0

    @contextlib.contextmanager
    def on_host(self):
        saved, self._making_host = self._making_host, True
        try:
            yield
        finally:
            self._making_host = saved

    def add_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._host or (self._making_host and key not in self._live):
            self._count_on_host(storage)
        else:
            super().add_storage(storage)

    def move_to_host(self, tensor: torch.Tensor) -> None:
        """The tensor's storage leaves the device for the host (FSDP2's device-to-host copy of a
        sharded gradient, the offloaded shards): freed on the device, held on the host."""
        if hasattr(tensor, "to_local"):  # a DTensor: its local shard holds the storage
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._host:
            return
        self.current -= self._live.pop(key, 0)
        if self.allocator is not None:
            self.allocator.free(key)
        self._count_on_host(storage)

    def _count_on_host(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self._watch:
            self._watch[key] = weakref.ref(storage, functools.partial(self._forget, key))
        self.host_current += nbytes - self._host.get(key, 0)
        self._host[key] = nbytes
        self.host_peak = max(self.host_peak, self.host_current)

    def _forget(self, key: int, _ref=None) -> None:
        if key in self._host:
            self._watch.pop(key, None)
            self.host_current -= self._host.pop(key)
        else:
            super()._forget(key, _ref)


class CPUMemoryBackend(MemoryBackend):
    kind = "cpu"

    def __init__(self, memory_limit=None, *, offload: bool = False):
        self.device = torch.device("cpu")
        vm = psutil.virtual_memory()
        if memory_limit is not None:
            budget, source = parse_bytes(memory_limit), "--memory-limit"
            if budget > vm.total:
                # The CPU budget is only counted, not enforced by the OS: past physical memory the
                # probe would allocate until the system refuses (or swaps for hours).
                raise ConfigError(
                    f"--memory-limit {format_bytes(budget)} is more than this machine's "
                    f"{format_bytes(vm.total)} of physical memory; give {format_bytes(vm.total)} or less")
        else:
            budget = int(vm.available * DEFAULT_RAM_FRACTION)
            source = f"{DEFAULT_RAM_FRACTION:.0%} of available RAM (psutil)"
        self._info = DeviceInfo(
            kind="cpu",
            name=_cpu_name(),
            total_bytes=int(vm.total),
            free_bytes=int(vm.available),
            budget_bytes=budget,
            budget_source=source,
        )
        self._count(budget, offload=offload)

    def _count(self, budget: int | None, *, offload: bool) -> None:
        """The tracker, against ``budget``; ``offload`` (fsdp-offload): what FSDP2 keeps in host
        memory (the shards, their gradients, the optimizer state and step) is counted apart
        (``HostDeviceTracker``), as the plan's estimate and the training loop's meter count it;
        on the CPU it is the same memory."""
        self.offload = offload
        self.tracker = HostDeviceTracker(budget) if offload else StorageTracker(budget)

    def info(self) -> DeviceInfo:
        return self._info

    def offloading(self) -> "CPUMemoryBackend":
        """This backend (its budget and what it says of the device) counting fsdp-offload's host
        memory apart."""
        backend = CPUMemoryBackend(self._info.budget_bytes, offload=True)
        backend._info = self._info
        return backend

    def on_host(self):
        return self.tracker.on_host() if self.offload else contextlib.nullcontext()

    def offloaded(self, tensors) -> None:
        if self.offload:
            for tensor in tensors:
                self.tracker.move_to_host(tensor)

    def begin_trial(self) -> None:
        if self.offload:
            self.tracker.host_peak = self.tracker.host_current

    def memory_picture(self) -> dict:
        return {"host_peak_bytes": self.tracker.host_peak} if self.offload else {}

    @contextlib.contextmanager
    def tracking(self):
        with tracking_resizes(self.tracker), tracking_inductor_buffers(self.tracker), \
                _TrackingMode(self.tracker):
            yield

    def adopt(self, tensors) -> None:
        for tensor in tensors:
            self.tracker.add(tensor)

    def current_bytes(self) -> int:
        return self.tracker.current

    def live_storages(self) -> frozenset:
        return self.tracker.live_keys()

    def disown_since(self, before: frozenset) -> int:
        return self.tracker.disown(self.tracker.live_keys() - before)

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def peak_bytes(self) -> int:
        return self.tracker.peak

    @contextlib.contextmanager
    def unlimited(self, ceiling: int | None = None):
        """Measure without enforcing the budget (used to say how far over budget a model is);
        ``ceiling``: raise the out-of-memory error there instead of nowhere."""
        saved, self.tracker.budget_bytes = self.tracker.budget_bytes, ceiling
        try:
            yield
        finally:
            self.tracker.budget_bytes = saved


def _cpu_name() -> str:
    import platform

    name = platform.processor() or platform.machine() or "cpu"
    threads = psutil.cpu_count(logical=True)
    # Where torch runs on fewer (OMP_NUM_THREADS, torch.set_num_threads), the name says so: a
    # throughput study keyed by it is not reused at another thread count.
    used = torch.get_num_threads()
    return f"CPU ({name}, {threads} threads" + (f"; torch uses {used})" if used != threads else ")")
