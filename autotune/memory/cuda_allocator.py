"""A model of torch's CUDA caching allocator: what ``torch.cuda.max_memory_reserved()`` would show
for an ordered trace of tensor allocations and frees, without a device.

Pure Python, no torch: the fake-tensor estimate (``memory.fake``) feeds it the storages it counts,
in order, when it estimates for a CUDA device. The rules are those of c10/cuda/CUDACachingAllocator.cpp
(its header comment, the constants ``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``,
``kMinLargeAlloc``, ``kRoundLarge``, ``kLargeBuffer``, and ``round_size``, ``get_allocation_size``,
``should_split``, ``get_free_block``, ``release_cached_blocks``; read at pytorch/pytorch commit
001074d) and of c10/core/AllocatorConfig.h (``roundup_power2_next_division``), described for users
in torch's "CUDA semantics" notes (docs/source/notes/cuda.rst, "Memory management" and
"Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"):

- every request is rounded up to a multiple of 512 B (or, with ``roundup_power2_divisions``, to
  the next of N equal divisions of its power-of-two interval);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from
  the large pool: under 10 MiB a 20 MiB segment, from 10 MiB up the size rounded up to 2 MiB;
- a request takes the smallest cached free block of its pool that fits (best fit), split when
  what remains is at least 512 B (small pool) or more than 1 MiB (large pool, and only for
  requests below ``max_split_size``); freed blocks merge with free neighbours of their segment;
- a cached block of ``max_split_size`` or more is not handed to a smaller request, nor to a
  request ``max_non_split_rounding`` (20 MiB) or more below its size;
- freeing never returns memory to the device; only ``empty_cache`` (or an allocation that would
  pass the limit, which empties the cache and retries) releases segments that hold no tensor;
- ``expandable_segments:True``: one segment per pool that grows by mapping pages (2 MiB for the
  small pool, 20 MiB for the large pool: "Note [Expandable Segments]" in the same file); reserved
  is the mapped pages, and ``empty_cache`` unmaps the pages no tensor touches.

What it leaves out: streams (every allocation is taken to be on one stream; FSDP2's all-gathers
and reduce-scatters run on their own streams and keep their blocks apart, so the model can
under-count there), the garbage-collection threshold, CUDA graphs' private pools, and which
oversize cached block an allocation under pressure frees first (all of them are freed).
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass

KiB, MiB = 1024, 1024 * 1024

MIN_BLOCK = 512
"""kMinBlockSize: every size is rounded up to a multiple of this."""
SMALL_SIZE = 1 * MiB
"""kSmallSize: the largest request served by the small pool."""
SMALL_BUFFER = 2 * MiB
"""kSmallBuffer: the small pool's segment size (and its expandable page)."""
MIN_LARGE_ALLOC = 10 * MiB
"""kMinLargeAlloc: large requests below this get a whole LARGE_BUFFER segment."""
LARGE_BUFFER = 20 * MiB
"""kLargeBuffer: the segment of a large request below MIN_LARGE_ALLOC (and the large pool's
expandable page, and max_non_split_rounding's default)."""
ROUND_LARGE = 2 * MiB
"""kRoundLarge: larger requests get a segment of their size rounded up to this."""

CUBLAS_WORKSPACE_HOPPER = 4096 * KiB * 8
"""cuBLAS workspace on sm90 (``:4096:8``, 32 MiB): aten/src/ATen/cuda/CublasHandlePool.cpp,
``parseChosenWorkspaceSize`` (read at commit 26a3905). Allocated through the caching allocator
(``getNewWorkspace``: ``CUDACachingAllocator::get()->allocate``), once per handle and stream, so it
is in ``max_memory_reserved`` and ``max_memory_allocated``."""
CUBLAS_WORKSPACE_OTHER = 4096 * KiB * 2 + 16 * KiB * 8
"""cuBLAS workspace elsewhere (``:4096:2:16:8``, 8 MiB + 128 KiB), same source."""
CUBLASLT_WORKSPACE = 1024 * KiB
"""cuBLASLt's own workspace (``CUBLASLT_WORKSPACE_SIZE``, default 1024 KiB, at most the cuBLAS one),
``parseCUDABlasLtWorkspaceSize``/``getNewCUDABlasLtWorkspace`` in the same file: also from the
caching allocator, and separate from the cuBLAS one unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1."""


HANDLES_PER_STEP = 2
"""cuBLAS handles a training step uses, each with its workspaces (kept per handle and stream):
torch hands out handles per thread (``DeviceThreadHandlePool``), and the autograd engine runs a
CUDA backward on its own device thread, so the forward's and the backward's matmuls hold one each.
Measured on an H200 (torch 2.11.0+cu130, 2026-12-04, bench/gpu_proof.py): a step's
``max_memory_allocated`` exceeded the fake tensors' peak by 64.5, 65.5 and 66.5 MiB for mlp
fp32, cnn_bn bf16 and gpt_varlen fp32 (two 32 MiB cuBLAS and two 1 MiB cuBLASLt workspaces:
66 MiB), where one handle's would be 33."""


class AllocatorOutOfMemory(Exception):
    """A new segment would take reserved memory past the limit, even after emptying the cache."""

    def __init__(self, requested: int, reserved: int, limit: int):
        super().__init__(f"the caching allocator needs a {requested} B segment with {reserved} B "
                         f"reserved against a limit of {limit} B")
        self.requested, self.reserved, self.limit = requested, reserved, limit


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the model follows."""

    max_split_size: int | None = None
    """Bytes; blocks this large or larger are not split (None: unlimited, torch's default)."""
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: int = 0
    """0 or 1: sizes round to 512 B only."""
    expandable_segments: bool = False

    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """``expandable_segments:True,max_split_size_mb:512,roundup_power2_divisions:4``; options
        the model does not follow (garbage_collection_threshold, backend, ...) are ignored, and a
        per-interval ``roundup_power2_divisions`` list ([256:1,512:2]) is not modelled (it takes
        the largest division given, an upper bound of the rounding)."""
        fields = {}
        # Commas separate options, except inside a bracketed list.
        for item in filter(None, (p.strip() for p in re.split(r",(?![^\[]*\])", text or ""))):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments":
                fields["expandable_segments"] = value.lower() == "true"
            elif key == "max_split_size_mb":
                # torch keeps at least kLargeBuffer: smaller values would split 20 MiB segments.
                fields["max_split_size"] = max(int(value), LARGE_BUFFER // MiB) * MiB
            elif key == "max_non_split_rounding_mb":
                fields["max_non_split_rounding"] = int(value) * MiB
            elif key == "roundup_power2_divisions":
                divisions = ([int(n) for n in re.findall(r"[>\d]+:(\d+)", value)] if "[" in value
                             else [int(value)])
                fields["roundup_power2_divisions"] = max(divisions, default=0)
        return cls(**fields)


def round_size(nbytes: int, divisions: int = 0) -> int:
    """``round_size``: the block size a request of ``nbytes`` takes."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        return _roundup_power2_next_division(nbytes, divisions)
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    below = size & ~(step - 1)
    return size if below == size else below + step


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a rounded request gets when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("segment", "offset", "size", "allocated", "prev", "next", "requested")

    def __init__(self, segment, offset, size):
        self.segment, self.offset, self.size = segment, offset, size
        self.allocated, self.prev, self.next, self.requested = False, None, None, 0


class _Segment:
    __slots__ = ("id", "small", "size", "expandable", "mapped", "tail")

    def __init__(self, id_, small, size, expandable=False):
        self.id, self.small, self.size, self.expandable = id_, small, size, expandable
        self.tail: _Block | None = None
        """The block at the segment's end."""
        self.mapped: set[int] = set()
        """Expandable: the indices of the pages mapped."""


class CachingAllocatorModel:
    """Replays allocations and frees (by key) through the caching allocator's rules.

    ``malloc(key, nbytes)`` / ``free(key)`` / ``empty_cache()``; ``reserved``, ``allocated``
    (block sizes, as ``memory_allocated`` counts them) and ``requested`` (the bytes asked for, what
    the fake-tensor tracker counts) now and at their peaks since ``reset_peak``. ``limit``: a new
    segment past it empties the cache and retries, then raises ``AllocatorOutOfMemory``, as the
    real allocator does under ``set_per_process_memory_fraction``.
    """

    def __init__(self, config: AllocatorConfig | None = None, *, limit: int | None = None,
                 record: bool = False):
        self.config = config or AllocatorConfig()
        self.limit = limit
        self.events: list | None = [] if record else None
        """``record``: every malloc, free and empty_cache, in order, as ``replay`` takes them
        (``("malloc", key, nbytes)``, ``("free", key)``, ``("empty_cache",)``)."""
        self._ids = itertools.count()
        self._free: dict[bool, list] = {True: [], False: []}  # small? -> sorted (size, seg, offset)
        self._blocks: dict[tuple, _Block] = {}  # (seg, offset) of every free block
        self._live: dict = {}  # key -> block
        self._segments: dict[int, _Segment] = {}
        self._expandable: dict[bool, _Segment] = {}
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.segments_created = 0

    # -- the public operations ---------------------------------------------------------------

    def malloc(self, key, nbytes: int) -> None:
        self._malloc(key, nbytes)
        if self.events is not None and nbytes > 0:  # once it succeeded (an OOM retry's
            self.events.append(("malloc", key, nbytes))  # empty_cache comes first)

    def free(self, key) -> None:
        if self._release(key) and self.events is not None:
            self.events.append(("free", key))

    def resize(self, key, nbytes: int) -> None:
        """A storage resized in place (FSDP2 frees and refills its gathered parameters so): on
        CUDA a new block, then the old one freed."""
        old = self._live.pop(key, None)
        if old is not None:
            self._live[("resized", key)] = old
        try:
            self._malloc(key, nbytes)
        except AllocatorOutOfMemory:
            if old is not None:
                self._live[key] = self._live.pop(("resized", key))
            raise
        self._release(("resized", key))
        if self.events is not None:
            self.events.append(("resize", key, nbytes))

    def _malloc(self, key, nbytes: int) -> None:
        if nbytes <= 0 or key in self._live:
            return  # torch hands out no memory for an empty storage
        size = round_size(nbytes, self.config.roundup_power2_divisions)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size)
        if block is None:
            block = self._new_block(small, size)
        else:
            if block.segment.expandable:  # a cached block whose pages were unmapped: map them
                self._map(block.segment, block.offset, block.offset + size)
            self._remove_free(block)
        if self._should_split(block, size):
            rest = _Block(block.segment, block.offset + size, block.size - size)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            else:
                block.segment.tail = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        block.allocated, block.requested = True, nbytes
        self._live[key] = block
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def _release(self, key) -> bool:
        block = self._live.pop(key, None)
        if block is None:
            return False
        self.allocated -= block.size
        self.requested -= block.requested
        block.allocated, block.requested = False, 0
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                block = self._merge(block, neighbour)
        self._insert_free(block)
        return True

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every segment no tensor uses (expandable: unmap
        every page no tensor touches)."""
        if self.events is not None:
            self.events.append(("empty_cache",))
        for small in (True, False):
            for size, seg_id, offset in list(self._free[small]):
                block = self._blocks[(seg_id, offset)]
                segment = block.segment
                if segment.expandable:
                    self._unmap(segment, block.offset, block.offset + block.size)
                elif block.prev is None and block.next is None:
                    self._remove_free(block)
                    del self._segments[segment.id]
                    self.reserved -= segment.size

    def reset_peak(self) -> None:
        self.peak_reserved, self.peak_allocated, self.peak_requested = (
            self.reserved, self.allocated, self.requested)

    # -- finding and making blocks -----------------------------------------------------------

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1, -1))
        if i == len(free):
            return None
        block = self._blocks[free[i][1:]]
        limit = self.config.max_split_size
        if limit is not None and not small:
            # get_free_block: an oversize block serves no request below max_split_size, nor one
            # more than max_non_split_rounding smaller than itself.
            if size < limit <= block.size:
                return None
            if size >= limit and block.size >= size + self.config.max_non_split_rounding:
                return None
        return block

    def _new_block(self, small: bool, size: int) -> _Block:
        if self.config.expandable_segments:
            return self._grow(small, size)
        segment_size = allocation_size(size)
        self._check_limit(segment_size)
        segment = _Segment(next(self._ids), small, segment_size)
        self._segments[segment.id] = segment
        self.segments_created += 1
        self.reserved += segment_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = segment.tail = _Block(segment, 0, segment_size)
        return block

    def _check_limit(self, grow: int) -> None:
        if self.limit is None or self.reserved + grow <= self.limit:
            return
        self.empty_cache()  # the allocator's retry: free the cache, try again
        if self.reserved + grow > self.limit:
            raise AllocatorOutOfMemory(grow, self.reserved, self.limit)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.segment.small or block.segment.expandable:
            return remaining >= MIN_BLOCK
        limit = self.config.max_split_size
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    # -- expandable segments -----------------------------------------------------------------

    def _page(self, small: bool) -> int:
        return SMALL_BUFFER if small else LARGE_BUFFER

    def _grow(self, small: bool, size: int) -> _Block:
        """No free block fits: extend the pool's segment at its end (taking a free block that
        ends there along), mapping the pages the new block needs."""
        segment = self._expandable.get(small)
        if segment is None:
            segment = self._expandable[small] = _Segment(next(self._ids), small, 0, expandable=True)
            self._segments[segment.id] = segment
            self.segments_created += 1
        last = segment.tail
        start = last.offset if last is not None and not last.allocated else segment.size
        page = self._page(small)
        self._map(segment, start, start + size)  # first: it may refuse, and nothing has changed
        new_size = max(segment.size, -(-(start + size) // page) * page)
        block = _Block(segment, start, new_size - start)
        if last is not None and last.allocated:
            last.next, block.prev = block, last
        elif last is not None:
            self._remove_free(last)
            block.prev = last.prev
            if last.prev is not None:
                last.prev.next = block
        segment.size, segment.tail = new_size, block
        return block

    def _map(self, segment: _Segment, start: int, end: int) -> None:
        page = self._page(segment.small)

        def wanted():
            return [p for p in range(start // page, -(-end // page)) if p not in segment.mapped]

        pages = wanted()
        if not pages:
            return
        if self.limit is not None and self.reserved + len(pages) * page > self.limit:
            self.empty_cache()  # the allocator's retry: unmap what no tensor touches, try again
            pages = wanted()
            if self.reserved + len(pages) * page > self.limit:
                raise AllocatorOutOfMemory(len(pages) * page, self.reserved, self.limit)
        segment.mapped.update(pages)
        self.reserved += len(pages) * page
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _unmap(self, segment: _Segment, start: int, end: int) -> None:
        page = self._page(segment.small)
        pages = [p for p in range(-(-start // page), end // page) if p in segment.mapped]
        segment.mapped.difference_update(pages)
        self.reserved -= len(pages) * page

    # -- the free lists ----------------------------------------------------------------------

    def _insert_free(self, block: _Block) -> None:
        self._blocks[(block.segment.id, block.offset)] = block
        bisect.insort(self._free[block.segment.small], (block.size, block.segment.id, block.offset))

    def _remove_free(self, block: _Block) -> None:
        free = self._free[block.segment.small]
        entry = (block.size, block.segment.id, block.offset)
        del free[bisect.bisect_left(free, entry)]
        del self._blocks[entry[1:]]

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        else:
            first.segment.tail = first
        return first


def replay(events, config: AllocatorConfig | None = None) -> CachingAllocatorModel:
    """The model after an ordered trace of ``("malloc", key, nbytes)``, ``("free", key)``,
    ``("resize", key, nbytes)`` and ``("empty_cache",)`` events; its ``peak_reserved``,
    ``peak_allocated`` and ``peak_requested`` cover the trace."""
    model = CachingAllocatorModel(config)
    for event in events:
        if event[0] == "malloc":
            model.malloc(event[1], event[2])
        elif event[0] == "free":
            model.free(event[1])
        elif event[0] == "resize":
            model.resize(event[1], event[2])
        elif event[0] == "empty_cache":
            model.empty_cache()
        else:
            raise ValueError(f"unknown allocator event {event!r}: use malloc, free or empty_cache")
    return model


def cublas_workspaces(hopper: bool, environ=None) -> list[int]:
    """The cuBLAS and cuBLASLt workspaces the first matmul of each handle allocates through the
    caching allocator (sizes as ``CUBLAS_WORKSPACE_CONFIG``/``CUBLASLT_WORKSPACE_SIZE`` set them,
    else torch's defaults for the architecture; see the constants above), for each of the
    ``HANDLES_PER_STEP`` handles a training step uses."""
    import os

    environ = os.environ if environ is None else environ
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    cublas = (sum(int(size) * KiB * int(count) for size, count in pairs) if pairs
              else CUBLAS_WORKSPACE_HOPPER if hopper else CUBLAS_WORKSPACE_OTHER)
    lt_text = environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    lt = int(lt_text) * KiB if lt_text.isdigit() else CUBLASLT_WORKSPACE
    return [cublas, min(lt, cublas)] * HANDLES_PER_STEP


__all__ = ["AllocatorConfig", "AllocatorOutOfMemory", "CachingAllocatorModel", "allocation_size",
           "cublas_workspaces", "replay", "round_size"]
