"""Estimates of a model with identical repeated blocks, from fake builds with few of them.

Every byte a training step holds is a sum over its tensors, and a model whose repeated blocks are
identical (same modules, parameter and buffer shapes, dtypes and plain settings) adds the same
tensors for each block: its parameters, gradients and optimizer state, FSDP2's shards of them
(each block is sharded and padded on its own), the activations it saves and the foreach
optimizer's per-parameter temporaries. So what a step holds at a given moment is affine in the
number of blocks, and two fake builds with m1 and m2 repetitions give it for any N. A peak is a
maximum over moments, which is not affine (where the pass peaks moves with N: at the loss with 4
blocks, at the end of backward with 32), so the forward-backward pass is cut into segments at
the blocks' boundaries and each segment's peak is extended on its own (``_Timeline``); the
baseline, the gradients and the optimizer phase's peak are extended as they are.
tests/test_affine_blocks.py and bench/llama_plans.py check the result against full builds, to
the byte.

Checkpointing K of N blocks spreads them evenly, and the peak in backward depends on where the
checkpointed blocks sit; the blocks then repeat as a *unit* (off and on: one block; K dividing
N: one checkpointed block and N/K - 1 plain ones; one block of N: a checkpointed first block
before plain ones), and the small builds repeat the unit ``2 * EDGE`` and ``2 * EDGE + 1``
times. A pattern that does not repeat (K not dividing N), one whose small builds are not smaller
than the model, a model whose blocks differ, or one whose forward runs a block that was cut (it
keeps its own list of layers) is estimated on the full build.

The small builds are made from the model file as it is: the full model is built on fake tensors
(no memory, about half a second for 8B), its block container is cut to the first blocks, and
then it is sharded and stepped as usual.

A CUDA estimate's reserved memory (the modelled caching allocator) is not affine in the blocks;
the allocator's event sequence is, segment by segment: ``SynthesizedTrialsSession`` runs each
trial on three fresh small builds and replays their traces synthesized for the whole model
(``trace_synthesis``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import EstimateUnavailable, StepError
from ..distributed.sharding.ranks import sharded_step
from ..memory.cpu import tracking_resizes
from ..memory.frozen_heap import automatic_collection_off
from ..memory.cuda_allocator import cublas_workspaces
from ..memory.fake_build import build_fake_model, may_build_elsewhere
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits, is_hopper, uncounted_sharding_propagation
from ..units import format_bytes
from ..workload.activation_checkpointing import (checkpointable_blocks, enable_checkpointing,
                                                 repeated_blocks, spread_evenly)
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest
from .fresh_trials import FreshTrialsSession
from .result import Trial
from .trace_synthesis import (NotSynthesizable, Synthesis, TraceMarks, normalize, on_gradient,
                              replay_trial, tensor_peaks)
from .trial import SetupOutOfMemory

EDGE = 2
"""Units of the block pattern told apart at each end of the stack (see ``_Timeline``); the
smaller build repeats the unit twice that often, the larger once more."""

COUNT_UNITS = (2, 3, 4)
"""The units of the three small builds a step count extends from (``small_builds``). A count
needs no timeline's ends, only the ops each added unit adds: a unit between the first and the
last runs what every middle unit runs. Builds of 1, 2 and 3 units do not extend under FSDP2 (the
third is off the line through the first two, a lone block being the stack's first and last too);
2, 3 and 4 counted every layout of tests/test_extend_costs.py exactly as the whole model, at 9
blocks of work where the memory trials' 4, 5 and 6 take 15."""

_enabled = True

TRACE_SYNTHESIS = True
"""Estimates that model the CUDA caching allocator run on small builds too, their allocator traces
synthesized into the whole model's and replayed (``SynthesizedTrialsSession``); off: they run the
full build (the small builds' tensors ruling trials out, ``TensorFloorSession``)."""

SYNTHESIS_MAX_SHARE = 0.5
"""Synthesize where the three small builds hold at most this share of the model's blocks; above,
the full build costs about as much or less. Measured with ``bench/llama_plans.py`` (2026-12-03):
one trial (``--check``, CPU s, synthesized against full build) of 70B (80 blocks; small builds of
4, 5 and 6: 19%) 4.8-8.8 against 10.8-23.0; of 8B (32 blocks, 47%) 3.5-5.4 against 4.4-6.6, of
8B with 16 blocks checkpointed (units of two: builds of 8, 10 and 12, 94%) 6.4 against 4.8.
Whole plans: a quarter until 2026-12-04, when at 0.5 8B at sequence 131072 took 237 CPU s against
183-196 on full builds, its screens that fit nowhere dearer (a full build under a budget stops at
its first out-of-memory op; the small builds ran their whole steps before the replay). Since a
synthesized trial takes its tensor floor from its first two builds, before the third (and small
builds are cut before their tensors are made), the same plans, the same bytes, two at once
(``--tp auto --cp auto --pp auto``, CPU s, 2026-12-04): 8B at sequence 131072 103 and 102 at 0.5
against 126 and 136 at a quarter (CP 8's screen 9 against 25, its sync-on-last window 14 against
34), 8B at sequence 8192 38 against 50."""


@contextlib.contextmanager
def synthesized_traces(enabled: bool = True, *, max_share: float | None = SYNTHESIS_MAX_SHARE):
    """Allocator-modelled estimates from small builds' synthesized traces, or not; ``max_share``:
    where the small builds hold at most this share of the blocks (None: wherever a third small
    build is smaller than the model; tests compare small models with their full builds)."""
    global TRACE_SYNTHESIS, SYNTHESIS_MAX_SHARE
    saved = TRACE_SYNTHESIS, SYNTHESIS_MAX_SHARE
    TRACE_SYNTHESIS, SYNTHESIS_MAX_SHARE = enabled, max_share
    try:
        yield
    finally:
        TRACE_SYNTHESIS, SYNTHESIS_MAX_SHARE = saved

PROVEN_SPLITS: frozenset = frozenset({"tp", "cp"})
"""Model-parallel degrees whose few-block estimates tests/test_affine_layouts.py proves to the
byte against full fake builds (tp 2, FSDP 2 × TP 2, cp 2, FSDP 2 × CP 2, TP 2 × CP 2 and FSDP 2 ×
TP 2 × CP 2 on a twelve-layer Hugging Face Llama, every block checkpointed, micro-batches 1 and
2); layouts with any other degree above 1 run the full build. (Context parallelism failed the
proof until each session's ring attention ran on its own mesh: the small builds' rings were
patched over one another, ``context_parallel._Rings``.) Pipelines are not extended: a stage
holds N/pp blocks and the first holds pp micro-batches, so small builds would need pp × 2·EDGE and
pp × (2·EDGE + 1) blocks (32 and 40 at pp 8, more than 8B's 32)."""


FLOOR_MIN_BLOCKS = 4 * (2 * EDGE + 2 * EDGE + 1)
"""A CUDA estimate takes the tensor floor (``TensorFloorSession``) for models of at least this
many identical blocks: four times the blocks of the two small builds (4 and 5), which a floor
runs on top of the full build wherever the setting fits. Measured with ``bench/llama_plans.py``
(2026-12-02): 8B at sequence 131072 (32 blocks: the floor's builds are 28% of the full one)
planned in 452 CPU s with the floor and 390 without; 70B (80 blocks, 11%) in 288-343 against
381, 405B (126 blocks, 7%) in 506 against 769."""


def _few_blocks_proven(parallel) -> bool:
    if parallel is None or parallel.trivial:
        return True
    split = {name for name in ("tp", "cp", "pp") if getattr(parallel, name) > 1}
    return split <= PROVEN_SPLITS


@contextlib.contextmanager
def few_blocks_for(splits):
    """Extend small builds for layouts with these degrees too (what the proof runs under)."""
    global PROVEN_SPLITS
    saved, PROVEN_SPLITS = PROVEN_SPLITS, frozenset(splits) - {"pp"}
    try:
        yield
    finally:
        PROVEN_SPLITS = saved


@contextlib.contextmanager
def full_builds():
    """Estimate on full builds only, as before this module (benchmarks and tests compare both)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


@contextlib.contextmanager
def layout_session(workload, backend, *, session_type, precision, checkpointing, sharding,
                   world_size: int, shard_group, reduce_every_micro_step: bool = False,
                   few_blocks: bool = True, parallel=None, fake_rank: int | None = None):
    """The probe's session for a layout: ``session_type`` on ``workload`` sharded as ``sharding``
    says, or, on fake tensors where the model's repeated blocks are identical (and
    ``few_blocks``), a ``FewBlocksSession`` that measures small builds and extends their bytes to
    the whole model. A pipeline in one process is measured on every pipeline rank, each trial the
    worst rank's (``WorstPipelineRankSession``), unless ``fake_rank`` names the one rank to be."""
    session_args = dict(precision=precision, checkpointing=checkpointing, sharded=sharding.sharded,
                        offload=sharding.offload, reduce_every_micro_step=reduce_every_micro_step)
    layout = dict(sharding=sharding, world_size=world_size, shard_group=shard_group,
                  precision=precision, device_type=backend.device.type, parallel=parallel,
                  fake_rank=fake_rank or 0)
    if parallel is not None and parallel.pp > 1:
        from .pipeline_trial import (WorstPipelineRankSession, pipeline_fake_ranks,  # they import this module's users
                                     pipelined_session_type)

        session_type = pipelined_session_type(session_type)
        if fake_rank is None and not torch.distributed.is_initialized():
            def rank_session(rank: int):
                return layout_session(workload, backend, session_type=session_type, precision=precision,
                                      checkpointing=checkpointing, sharding=sharding,
                                      world_size=world_size, shard_group=shard_group,
                                      reduce_every_micro_step=reduce_every_micro_step,
                                      few_blocks=few_blocks, parallel=parallel, fake_rank=rank)

            yield WorstPipelineRankSession(rank_session, pipeline_fake_ranks(parallel, world_size))
            return
    total = (identical_block_count(workload)
             if _enabled and few_blocks and isinstance(backend, EstimateMemoryBackend)
             and not torch.distributed.is_initialized()
             # Proven for data-parallel layouts (tests/test_affine_blocks.py) and PROVEN_SPLITS.
             and _few_blocks_proven(parallel) else None)
    if total is not None and backend.allocator is None:
        yield FewBlocksSession(workload, backend, session_type=session_type, total_blocks=total,
                               layout=layout, **session_args)
        return
    floor = total is not None and total >= FLOOR_MIN_BLOCKS and backend.tracker.budget_bytes is not None
    if total is not None and TRACE_SYNTHESIS and backend.allocator is not None \
            and (getattr(session_type, "plain_type", session_type) is session_type
                 or hasattr(session_type, "for_small_build")):
        # A modelled CUDA allocator's reserved memory (rounding, cached segments) does not extend
        # from small builds as tensor bytes do; their allocator traces do. A session type that
        # records the steps it runs (timing.recorded) records each small build's, extended.
        yield SynthesizedTrialsSession(workload, backend, session_type=session_type, total_blocks=total,
                                       layout=layout, floor=floor, **session_args)
        return
    if floor:
        # Without synthesis, the small builds' tensors only rule trials out (under a budget; an
        # estimate without one runs the full build alone).
        yield TensorFloorSession(workload, backend, session_type=session_type, total_blocks=total,
                                 layout=layout, **session_args)
        return
    if isinstance(backend, EstimateMemoryBackend) and backend.allocator is not None \
            and not torch.distributed.is_initialized():
        yield FreshTrialsSession(workload, backend, session_type=session_type, layout=layout, **session_args)
        return
    with sharded_step(workload, **layout) as step_workload:
        yield session_type(step_workload, backend, parallel=parallel, **session_args)


def _resolved(checkpointing, total: int, source: str) -> Checkpointing:
    """What ``checkpointing`` asks of a model of ``total`` identical blocks."""
    request = CheckpointingRequest.parse(checkpointing, allow_auto=False)
    return Checkpointing.every_block(total) if request.value == "on" else request.resolve(total, source=source)


def _in_three_builds(pattern: BlockPattern | None, total: int, units: tuple[int, ...] | None = None) -> bool:
    """Whether ``pattern`` repeats in three small builds (no prefix; of ``units`` repetitions,
    default the memory trials') that are smaller than the model and, together, hold at most
    ``SYNTHESIS_MAX_SHARE`` of its blocks."""
    if pattern is None or pattern.prefix:
        return False
    units = units or (*pattern.small, pattern.small[1] + 1)
    if pattern.blocks(units[-1]) >= total:
        return False
    sizes = [pattern.blocks(m) for m in units]
    return SYNTHESIS_MAX_SHARE is None or sum(sizes) <= SYNTHESIS_MAX_SHARE * total


def checkpoint_first_blocks(session, indices, blocks: int, source: str) -> None:
    """Checkpoint the blocks at ``indices`` of a session's small build of ``blocks`` blocks."""
    if len(indices) in (0, blocks):  # off, or every block (a model's own switch included)
        session.set_checkpointing("on" if indices else "off")
        return
    session.set_checkpointing("off")
    session.checkpointed_blocks = enable_checkpointing(session.model, source=source, indices=list(indices))


@dataclasses.dataclass(frozen=True)
class SmallBuild:
    """One small build a step count extends from: the first ``blocks`` of the model's repeated
    blocks, ``checkpointed`` the indices among them that are checkpointed."""

    blocks: int
    checkpointed: tuple[int, ...]
    units: int
    """The block pattern's units it repeats."""


def small_builds(workload, checkpointing, *, parallel=None) -> tuple[BlockPattern, list[SmallBuild]] | None:
    """The three small builds (``COUNT_UNITS`` units of the block pattern) that a count of the
    step extends to the whole model (``timing.count``,
    ``timing.extend``), with the pattern; None where the model's step is counted whole: its
    blocks differ or are too few, the checkpointed blocks do not repeat from the first, the
    layout's few-block estimates are not proven, or the small builds would hold more than
    ``SYNTHESIS_MAX_SHARE`` of the model's blocks (counting them would cost as much)."""
    if not (_enabled and _few_blocks_proven(parallel)):
        return None
    total = identical_block_count(workload)
    if total is None:
        return None
    pattern = block_pattern(_resolved(checkpointing, total, workload.source).count or 0, total)
    if not _in_three_builds(pattern, total, COUNT_UNITS):
        return None
    return pattern, [SmallBuild(pattern.blocks(m), tuple(pattern.checkpointed(m)), m) for m in COUNT_UNITS]


def first_blocks(workload, build: SmallBuild):
    """``workload`` (on fake tensors) with a model of ``build``'s first blocks; a cut block that
    runs raises ``DroppedBlockRan`` (the model keeps its blocks elsewhere too: count it whole,
    see ``built_whole_instead``)."""
    return _first_blocks(workload, build.blocks, _raising(lambda module, args: None))


def built_whole_instead(exc: BaseException) -> bool:
    """Whether a small build's failure says only that the model must be built whole: a cut block
    ran, or a build cut before its tensors were made failed where a whole one may not
    (``may_build_elsewhere``); the whole build raises a genuine error again."""
    cause = exc.__cause__ if isinstance(exc, StepError) and exc.__cause__ is not None else exc
    return isinstance(cause, DroppedBlockRan) or may_build_elsewhere(cause)


_BLOCK_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""``identical_block_count`` by model factory: every layout session of a plan asks, and building
405B's 126 blocks on fake tensors to answer costs about a second."""


def identical_block_count(workload) -> int | None:
    """N where the model's repeated blocks are N identical children of one container, with more
    blocks than the small builds hold; else None. The model is built on fake tensors (once per
    model factory)."""
    if workload.model_is_instance:
        return None
    try:
        return _BLOCK_COUNTS[workload.model]
    except (KeyError, TypeError):  # not asked yet, or a factory that takes no weak reference
        pass
    count = _identical_block_count(workload)
    try:
        _BLOCK_COUNTS[workload.model] = count
    except TypeError:
        pass
    return count


def _identical_block_count(workload) -> int | None:
    try:
        # As the estimate builds it: a model that fake tensors cannot build (peft's adapters swap
        # their base layer's weights) is built on the meta device (``fake_build``).
        with fake_tensor_limits(workload), FakeTensorMode(allow_non_fake_inputs=True):
            model = build_fake_model(workload)
    except EstimateUnavailable:
        return None  # the session's own build says why
    container = _block_container(model)
    if container is None or len(container) < 4:
        return None
    first = _signature(container[0])
    if any(_signature(block) != first for block in container):
        return None
    return len(container)


def _block_container(model: torch.nn.Module):
    """The one ModuleList/Sequential whose children are all of the model's repeated blocks."""
    blocks = repeated_blocks(model)
    if not blocks:
        return None
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) == len(blocks) \
                and all(a is b for a, b in zip(module, blocks)):
            return module if all(any(True for _ in b.parameters()) for b in blocks) else None
    return None


_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
"""Plain attributes that number the blocks (Hugging Face's caches key on them) and change nothing
a step holds."""


def _signature(block: torch.nn.Module) -> tuple:
    def plain(module):
        return tuple(sorted((k, v) for k, v in vars(module).items()
                            if not k.startswith("_") and k not in _INDEX_ATTRIBUTES
                            and isinstance(v, (bool, int, float, str, type(None)))))

    return (tuple((name, type(m), plain(m)) for name, m in block.named_modules()),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers()))


@dataclasses.dataclass(frozen=True)
class BlockPattern:
    """The blocks as ``prefix`` then ``unit`` repeated ``repeats`` times (True: checkpointed)."""

    prefix: tuple[bool, ...]
    unit: tuple[bool, ...]
    repeats: int

    def blocks(self, repeats: int) -> int:
        return len(self.prefix) + repeats * len(self.unit)

    @property
    def small(self) -> tuple[int, int]:
        """The repetitions (m1, m1 + 1) of the two small builds."""
        return 2 * EDGE, 2 * EDGE + 1

    def position(self, block: int, repeats: int) -> tuple | None:
        """Where a block sits, as every build with at least ``2 * EDGE`` repetitions names it:
        in the prefix, or its offset in one of the ``EDGE`` units at either end; None for the
        units between (their segments peak below those of the nearest ends' units, see
        ``_Timeline``)."""
        if block < len(self.prefix):
            return ("prefix", block)
        unit, offset = divmod(block - len(self.prefix), len(self.unit))
        if EDGE <= unit < repeats - EDGE:
            return None
        return (unit if unit < EDGE else unit - repeats, offset)

    def checkpointed(self, repeats: int) -> list[int]:
        flags = self.prefix + self.unit * repeats
        return [i for i, flag in enumerate(flags) if flag]


def block_pattern(checkpointed: int, total: int) -> BlockPattern | None:
    """How ``checkpointed`` of ``total`` blocks (spread evenly) repeat, with the fewest blocks in
    the larger small build; None where no build smaller than the model repeats them."""
    chosen = set(spread_evenly(checkpointed, total))
    flags = tuple(i in chosen for i in range(total))
    best = None
    for start in range(min(2, total)):  # a checkpointed first block before plain ones
        rest = total - start
        for length in range(1, rest + 1):
            if rest % length or flags[start:] != flags[start:start + length] * (rest // length):
                continue
            pattern = BlockPattern(flags[:start], flags[start:start + length], rest // length)
            larger = pattern.blocks(pattern.small[1])
            if larger < total and (best is None or larger < best.blocks(best.small[1])):
                best = pattern
            break  # longer units of the same start only repeat fewer times
    return best


_EXTENDED = ("peak_bytes", "activation_peak_bytes", "step_peak_bytes", "baseline_bytes",
             "gradient_bytes", "held_gradient_bytes", "host_peak_bytes")


def extend(values: tuple[int | None, int | None], small: tuple[int, int], repeats: int) -> int | None:
    """The value at ``repeats`` from its values at the ``small`` repetitions (affine in them)."""
    low, high = values
    if low is None or high is None:
        return None
    m1, m2 = small
    return low + (repeats - m1) * (high - low) // (m2 - m1)


class _ResumableBackend(EstimateMemoryBackend):
    """An unbudgeted estimate backend whose fake mode is entered only while its own session
    runs (``resumed``), so several sessions live side by side in one process."""

    def __init__(self, like: EstimateMemoryBackend, *, tensors_only: bool = False, traced: bool = False):
        super().__init__(None, for_cuda=like.for_cuda, target=like.info(), offload=like.offload)
        if tensors_only:  # CUDA's accounting (foreach, no gloo buffers), tensor bytes only
            self.allocator = self.tracker.allocator = None
        self._mode = self.counting_mode()
        self._traced = traced
        """Traced builds count no sharding propagation and collect garbage only where the session
        does (``uncounted_sharding_propagation``, ``frozen_heap.automatic_collection_off``): their traces do
        not depend on what ran before them in the process."""

    def tracking(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def resumed(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(tracking_resizes(self.tracker))
            stack.enter_context(self._mode)
            stack.enter_context(uncounted_sharding_propagation())
            if self._traced:
                stack.enter_context(automatic_collection_off())
            yield


class FewBlocksSession:
    """A ``TrialSession`` stand-in for a model of ``total_blocks`` identical blocks: each trial
    runs on the small builds of its checkpointing pattern (see ``block_pattern``) and every byte
    it reports is extended to the whole model; the budget is checked on the extended peak. A
    pattern that does not repeat runs on the full build."""

    compiled = False
    """Fake-tensor steps run eager (a compiled model's estimate runs apart, probing.isolated): the
    probe asks every session."""
    graphs_compiled = 0

    def __init__(self, workload, backend: EstimateMemoryBackend, *, session_type, total_blocks: int,
                 layout: dict, precision, checkpointing, sharded: bool, offload: bool,
                 reduce_every_micro_step: bool, tensors_only: bool = False, traced: bool = False):
        """``tensors_only``: the small builds count tensor bytes without ``backend``'s allocator
        model (``TensorFloorSession``'s floor); the budget is still ``backend``'s. ``traced``:
        ``backend`` models the CUDA caching allocator, and the reserved peaks come from three small
        builds' allocator traces, synthesized for the whole model and replayed
        (``trace_synthesis``); a pattern or trace that does not extend raises
        ``NotSynthesizable`` (set-up or trial) and builds nothing whole."""
        self.workload = workload
        self._tensors_only = tensors_only
        self.backend = backend
        self.session_type = session_type
        self.layout = layout
        self.precision = precision
        self.sharded, self.offload = sharded, offload
        self.reduce_every_micro_step = reduce_every_micro_step
        self.total_blocks = total_blocks
        self.ranks_agree = False
        self.checkpointing = Checkpointing.off(total_blocks)
        self.checkpointed_blocks = 0
        self.gradient_bytes = 0
        self._asked = checkpointing
        self._children: dict[int, tuple[_ResumableBackend, object]] = {}
        self._stack: contextlib.ExitStack | None = None
        self._timelines: dict[int, _Timeline] = {}
        self._early = True
        """Small builds are cut before their tensors are made (``_first_blocks``)."""
        self._dropped_ran = False
        """A block cut from a small build ran in its forward: the model holds its blocks elsewhere
        too, and only full builds measure it."""
        self._traced = traced and backend.allocator is not None and not tensors_only
        self._marks: dict = {}
        self._recorders: dict[int, type] = {}
        """The recording type of each small build, where the session type records
        (``_child_type``)."""
        self._ran = False
        self.synthesizable = self._traced
        """Traced: the setting's blocks repeat in three small builds (no trial runs otherwise)."""

    @property
    def checkpointing_label(self) -> str:
        return self.checkpointing.label

    def __enter__(self) -> "FewBlocksSession":
        self._stack = contextlib.ExitStack()
        try:
            self.set_checkpointing(self._asked)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        self._close_children()
        self._stack = None

    def _close_children(self) -> None:
        stack, self._stack = self._stack, contextlib.ExitStack()
        children, self._children = self._children, {}
        self._ran = False
        for backend, session in reversed(children.values()):
            with backend.resumed():
                session.__exit__(None, None, None)
        if stack is not None:
            stack.close()

    def set_checkpointing(self, checkpointing) -> int:
        total = self.total_blocks
        self.checkpointing = _resolved(checkpointing, total, self.workload.source)
        self.checkpointed_blocks = self.checkpointing.count or 0
        self._pattern = None if self._dropped_ran else block_pattern(self.checkpointed_blocks, total)
        if self._traced:
            self._close_children()  # every trial on builds of its own, set up as this setting says
            # Synthesis needs a third small build, no prefix, and small builds that cost less than
            # the model's (SYNTHESIS_MAX_SHARE).
            self.synthesizable = _in_three_builds(self._pattern, total)
            # Built when a trial (or what only they know) needs them: a session whose trial the
            # planner's memo answers, or whose setting changes first, sets up none.
            return self.checkpointed_blocks
        self._build_children()
        return self.checkpointed_blocks

    def ensure_built(self) -> None:
        """The small builds of the setting, set up (traced builds wait for their trial)."""
        if not self._children and self.synthesizable:
            self._build_children()

    def _build_children(self) -> None:
        # Traced: the third build waits for the tensor floor of the first two (``run``).
        sizes = self._sizes()[:2] if self._traced else self._sizes()
        for size in sizes:
            self._child(size)
        setup = [self._children[size][0].current_bytes() for size in sizes]
        grads = [self._children[size][1].gradient_bytes for size in sizes]
        self.gradient_bytes = self._extended(grads)
        budget = self.backend.tracker.budget_bytes
        state = self._extended(setup)
        if budget is not None and state > budget:
            raise SetupOutOfMemory(
                f"{self.workload.source}: the model's parameters, buffers and optimizer state alone "
                f"pass the {format_bytes(budget)} budget, before any batch")

    def window_micro_batches(self, n: int, window: int) -> list[int]:
        self.ensure_built()
        backend, session = self._children[self._sizes()[0]]
        return session.window_micro_batches(n, window)

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> Trial:
        if self._traced:
            if not self.synthesizable:
                raise NotSynthesizable(f"{self.checkpointed_blocks} of {self.total_blocks} blocks "
                                       "checkpointed do not repeat in three small builds")
            if self._ran:  # fresh builds: a modelled allocator's cache outlives a trial
                self._close_children()
            self.ensure_built()
            self._ran = True
        trials, segments = [], []
        for size in self._sizes():
            if self._traced and len(trials) == 2:
                floor = self._tensor_floor(trials)
                if floor is not None:
                    return floor
            backend, session = self._child(size)
            timeline = self._timelines.get(size)
            with backend.resumed():
                self._checkpoint(session, size)
                if timeline is not None and self._pattern is not None:
                    timeline.name_blocks(self._pattern, self._pattern.small[len(trials)])
                try:
                    trials.append(session.run(n, window=window, micro_batches=micro_batches))
                except Exception as exc:
                    if self._dropped_ran:
                        break  # a dropped block ran (on the meta device): answered below
                    if not self._built_late_instead(exc):
                        raise
                    self._close_children()
                    return self.run(n, window=window, micro_batches=micro_batches)
            segments.append(timeline.peaks if timeline is not None else None)
        if self._dropped_ran and self._traced:
            raise NotSynthesizable("the model runs blocks it does not hold in its container")
        if self._dropped_ran and self._pattern is not None:
            # The model runs blocks it does not hold in its container: only its full build is it.
            self._pattern = None
            self._child(self.total_blocks)
            return self.run(n, window=window, micro_batches=micro_batches)
        if any(not t.fits for t in trials):  # only under the soft ceiling of agreeing ranks
            raise RuntimeError("a small build ran out of memory without a budget")
        if self._pattern is None:
            trial = trials[0]
            fields = {name: getattr(trial, name) for name in _EXTENDED}
        elif self._traced:
            fields = self._synthesized(trials)
        else:
            fields = {name: self._extended([getattr(t, name) for t in trials]) for name in _EXTENDED}
            fields["activation_peak_bytes"] = self._extended_segments(*segments[:2])
            fields["peak_bytes"] = max(fields["activation_peak_bytes"], fields["step_peak_bytes"])
        budget = self.backend.tracker.budget_bytes
        fits = fields.pop("fits", True) and (budget is None or fields["peak_bytes"] <= budget)
        if not fits:  # as a budgeted step reports one that ran out of memory
            fields["activation_peak_bytes"] = fields["step_peak_bytes"] = None
        elif self._traced:
            self._extend_records(n)
        return dataclasses.replace(trials[-1], fits=fits, seconds=sum(t.seconds for t in trials),
                                   **fields)

    def _tensor_floor(self, trials) -> Trial | None:
        """Where a budget is set, a trial that the tensors of the first two traced builds,
        extended, pass it (reserved memory holds every tensor): out of memory, without the third
        build. Its peak is the same tensor floor a ``TensorFloorSession`` takes from builds of its
        own (tests/test_trace_synthesis.py). Likewise where they pass the backend's
        ``limit_bytes`` (what the caller plans within), marked ``past_limit``: the third build
        would only say by how much (8B at sequence 131072 under CP 8, micro-batch 2: 73.14 GiB of
        tensors against 70.84 usable, 2.6 of the trial's 7.8 CPU s)."""
        budget = self.backend.tracker.budget_bytes
        limit = self.backend.limit_bytes
        if budget is None:
            return None
        pattern = self._pattern
        found = [tensor_peaks(normalize(self._marks[size].events), pattern.small[0] + index, len(pattern.unit))
                 for index, size in enumerate(self._sizes()[:2])]
        (low, low_step), (high, high_step) = found
        if set(low) != set(high):
            raise NotSynthesizable(f"the small builds' passes differ: {sorted(low, key=str)} and "
                                   f"{sorted(high, key=str)}")
        workspaces = sum(cublas_workspaces(hopper=is_hopper(self.backend.info().name)))
        peak = max(max((self._extended([low[label], high[label]]) for label in low), default=0),
                   self._extended([low_step, high_step])) - workspaces
        past_limit = limit if limit is not None and budget >= peak > limit else None
        if peak <= budget and past_limit is None:
            return None
        fields = {name: self._extended([getattr(t, name) for t in trials]) for name in _EXTENDED}
        fields.update(peak_bytes=peak, activation_peak_bytes=None, step_peak_bytes=None,
                      reserved_peak_bytes=None, allocated_peak_bytes=None, past_limit=past_limit)
        return dataclasses.replace(trials[-1], fits=False, seconds=sum(t.seconds for t in trials),
                                   **fields)

    def _synthesized(self, trials) -> dict:
        """The trial's fields where the allocator is modelled: the peaks (reserved bytes) from the
        small builds' traces synthesized for the whole model and replayed; the others (tensor
        bytes) extended as without it."""
        pattern = self._pattern
        synthesis = Synthesis(tuple(normalize(self._marks[size].events) for size in self._sizes()),
                              pattern.small[0], len(pattern.unit))
        replayed = replay_trial(synthesis.trace(pattern.repeats), self.backend.allocator.config,
                                limit=self.backend.tracker.budget_bytes)
        fields = {name: self._extended([getattr(t, name) for t in trials]) for name in _EXTENDED}
        fields.update(activation_peak_bytes=replayed.activation_peak, step_peak_bytes=replayed.step_peak,
                      peak_bytes=max(replayed.activation_peak, replayed.step_peak),
                      reserved_peak_bytes=replayed.reserved_peak,
                      # The tensors' peak: the cuBLAS workspaces are the allocator's, not the tracker's.
                      allocated_peak_bytes=replayed.requested_peak - sum(
                          cublas_workspaces(hopper=is_hopper(self.backend.info().name))),
                      fits=replayed.fits)
        return fields

    def _extended_segments(self, low: dict, high: dict) -> int:
        named = {label for label in low if None not in label}
        if named != {label for label in high if None not in label}:
            raise RuntimeError(f"the small builds' passes differ: {sorted(low, key=str)} and "
                               f"{sorted(high, key=str)}")
        return max(self._extended([low[label], high[label]]) for label in named)

    def _sizes(self) -> list[int]:
        if self._pattern is None:
            return [self.total_blocks]
        small = self._pattern.small
        if self._traced:
            small = (*small, small[1] + 1)
        return [self._pattern.blocks(m) for m in small]

    def _extended(self, values: list[int | None]) -> int | None:
        if self._pattern is None:
            return values[0]
        return extend(tuple(values[:2]), self._pattern.small, self._pattern.repeats)

    def _checkpoint(self, session, size: int) -> None:
        if self._pattern is None:
            session.set_checkpointing(self.checkpointing)
            return
        repeats = self._pattern.small[0] + self._sizes().index(size)
        checkpoint_first_blocks(session, self._pattern.checkpointed(repeats), size, self.workload.source)

    def _checkpoint_from_setup(self, session, size: int) -> None:
        def set_checkpointing(checkpointing):
            del session.set_checkpointing  # the class's from now on
            self._checkpoint(session, size)
            return session.checkpointed_blocks

        session.set_checkpointing = set_checkpointing

    def _child(self, size: int):
        if size in self._children:
            return self._children[size]
        try:
            backend, session = self._new_child(size, early=self._early)
        except Exception as exc:
            if not self._built_late_instead(exc):
                raise
            backend, session = self._new_child(size, early=False)
        self._children[size] = backend, session
        if size < self.total_blocks and not self._traced:
            self._timelines[size] = _Timeline(backend.tracker, session)
        return backend, session

    def _new_child(self, size: int, *, early: bool):
        backend = _ResumableBackend(self.backend, tensors_only=self._tensors_only, traced=self._traced)
        marks = None
        if self._traced:
            marks = self._marks[size] = TraceMarks()
            marks.record(backend, hopper=is_hopper(backend.info().name))
        with contextlib.ExitStack() as stack:
            step_workload = stack.enter_context(
                sharded_step(_first_blocks(self.workload, size, self._dropped_block_ran,
                                           marks.hook_blocks if marks is not None else None,
                                           early=early and size < self.total_blocks), **self.layout))
            session = self._child_type(size)(step_workload, backend, precision=self.precision,
                                        checkpointing=False, sharded=self.sharded, offload=self.offload,
                                        reduce_every_micro_step=self.reduce_every_micro_step,
                                        parallel=self.layout.get("parallel"))
            if marks is not None:
                marks.hook_session(session)
                if self._pattern is not None:
                    # The warm-up step checkpoints as the full build's does: where the allocator
                    # is modelled, the cache it leaves is part of every later trial's.
                    self._checkpoint_from_setup(session, size)
            with backend.resumed():
                session.__enter__()
            self._stack.enter_context(stack.pop_all())
        return backend, session

    def _child_type(self, size: int) -> type:
        """The session type of the small build of ``size`` blocks. A type that records the steps
        it runs (``timing.recorded``) records each traced build's apart, and a trial's three
        extend to the whole model's (``_extend_records``); untraced builds count bytes only."""
        if self._traced and hasattr(self.session_type, "for_small_build"):
            self._recorders[size] = self.session_type.for_small_build()
            return self._recorders[size]
        return getattr(self.session_type, "plain_type", self.session_type)

    def _extend_records(self, n: int) -> None:
        if self._recorders and self._pattern is not None:
            self.session_type.extend_small_builds(n, [self._recorders[size] for size in self._sizes()],
                                                  units=self._pattern.small[0], repeats=self._pattern.repeats)

    def _built_late_instead(self, exc: Exception) -> bool:
        """Whether a small build cut before its tensors were made failed where one cut after
        them may not: a dropped block ran (left on the meta device), or the model holds a meta
        tensor ``build_fake_model`` could not find (in a list, say). From then on, this session's
        builds are cut after; a genuine error comes back from them."""
        if not self._early or not (self._dropped_ran or built_whole_instead(exc)):
            return False
        self._early = False
        return True

    def _dropped_block_ran(self, module, args) -> None:
        self._dropped_ran = True


class TensorFloorSession(FreshTrialsSession):
    """A CUDA estimate's session (allocator modelled) for a model of identical blocks: a setting's
    trials run first on the small builds, counting tensor bytes only (``FewBlocksSession``), and
    where those alone pass the budget the trial is out of memory without the full build: reserved
    memory holds every tensor (rounded up) and the cuBLAS workspaces, so it is never below them.
    From the first trial that passes the floor on, trials run on the full build, each on one of
    its own (``FreshTrialsSession``).

    The tensors of the small builds, extended, are the full build's to the byte for the layouts
    few blocks are proven for (bench/llama_plans.py ``--check`` with CUDA's accounting;
    tests/test_affine_blocks.py, tests/test_affine_layouts.py), so a trial the floor rules out
    does not fit on the full build either. What it saves: the settings of a plan's search that
    cannot fit at all (70B or 405B without checkpointing: terabytes of activations), each of
    which cost a full build and its warm-up step."""

    def __init__(self, workload, backend: EstimateMemoryBackend, *, session_type, total_blocks: int,
                 layout: dict, precision, checkpointing, sharded: bool, offload: bool,
                 reduce_every_micro_step: bool):
        super().__init__(workload, backend, session_type=session_type, layout=layout, precision=precision,
                         checkpointing=checkpointing, sharded=sharded, offload=offload,
                         reduce_every_micro_step=reduce_every_micro_step)
        # Plain estimate sessions for the floor: a session type that records the steps it runs
        # (timing.recorded) records the full build's only.
        self._floor = FewBlocksSession(workload, backend,
                                       session_type=getattr(session_type, "plain_type", session_type),
                                       total_blocks=total_blocks, layout=layout,
                                       precision=precision, checkpointing=checkpointing,
                                       sharded=sharded, offload=offload,
                                       reduce_every_micro_step=reduce_every_micro_step,
                                       tensors_only=True)
        self._stack: contextlib.ExitStack | None = None
        self._floor_passed = False
        """A trial of this setting passed the floor: the later ones go to the full build at once.
        A floor costs its small builds' steps (9 of 32 blocks at 8B) on top of the full build's
        for every trial that passes it; its gain is a setting that fits nowhere, which the
        setting's first trial shows."""
        self.floored_trials = 0
        """Trials the floor ruled out without the full build."""

    def __enter__(self) -> "TensorFloorSession":
        super().__enter__()
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(self._floor)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self._floor_passed = False
        return self

    def __exit__(self, *exc_info):
        try:
            super().__exit__(*exc_info)
        finally:
            stack, self._stack = self._stack, None
            if stack is not None:
                stack.close()

    def __getattr__(self, name):
        # What the full session knows (its model, its device); the floor's where the full build
        # is not made yet and the floor has it (blocks, checkpointing, gradients: the same).
        if name.startswith("_"):
            raise AttributeError(name)
        if self._full is None and hasattr(self._floor, name):
            return getattr(self._floor, name)
        return super().__getattr__(name)

    def set_checkpointing(self, checkpointing) -> int:
        self._asked = checkpointing
        self._floor_passed = False
        self._close_full()  # the next trial builds afresh, with this setting
        return self._floor.set_checkpointing(checkpointing)

    def tensor_peak(self, n: int) -> int:
        """The tensors' peak of one step at micro-batch ``n``, from the small builds (the budget
        in force checked): what the reserved peak is at least."""
        return self._floor.run(n).peak_bytes

    def knows(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> bool:
        # Before the floor has passed, a trial runs the floor's small builds first, unless the
        # memo holds its answer.
        if not self._floor_passed:
            floor = self._remembered_floor(n, window, micro_batches)
            if floor is None:
                return False
            if not self._within(floor).fits:
                return True
        return super().knows(n, window=window, micro_batches=micro_batches)

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> Trial:
        if not self._floor_passed:
            floor = self._remembered_floor(n, window, micro_batches)
            if floor is None:
                floor = self._floor.run(n, window=window, micro_batches=micro_batches)
                if self.backend.trials_memo is not None:
                    self.backend.trials_memo[self._floor_key(n, window, micro_batches)] = \
                        dataclasses.replace(floor)
            floor = self._within(floor)
            if not floor.fits:
                self.floored_trials += 1
                return floor
            self._floor_passed = True
        return super().run(n, window=window, micro_batches=micro_batches)

    def _within(self, floor: Trial) -> Trial:
        """``floor`` (the small builds' tensors, within the budget or not) as the trial's answer
        where its tensors pass the backend's ``limit_bytes`` (what the caller plans within):
        out of memory to it, marked ``past_limit``, as a synthesized trial's floor is
        (``FewBlocksSession._tensor_floor``); else ``floor`` itself (a floor within the limit only
        says the full build must answer)."""
        limit = self.backend.limit_bytes
        if not floor.fits or limit is None or floor.peak_bytes <= limit:
            return floor
        return dataclasses.replace(floor, fits=False, past_limit=limit, activation_peak_bytes=None,
                                   step_peak_bytes=None, reserved_peak_bytes=None,
                                   allocated_peak_bytes=None)

    def _floor_key(self, n: int, window: int, micro_batches) -> tuple:
        return ("tensor floor", self._memo_key(n, window, micro_batches))

    def _remembered_floor(self, n: int, window: int, micro_batches) -> Trial | None:
        """The floor's answer to this trial where the memo holds it (a planner run again, as a
        layout search runs its chosen layout's: the same small builds give the same bytes)."""
        memo = self.backend.trials_memo
        found = memo.get(self._floor_key(n, window, micro_batches)) if memo is not None else None
        return dataclasses.replace(found) if found is not None else None


class SynthesizedTrialsSession(TensorFloorSession):
    """A CUDA estimate's session (allocator modelled) for a model of identical blocks: where a
    setting's blocks repeat in three small builds that cost less than the model
    (``SYNTHESIS_MAX_SHARE``), each trial runs on three fresh small builds, and their allocator
    traces, synthesized for the whole model and replayed, give its reserved peaks
    (``FewBlocksSession(traced=True)``, ``trace_synthesis``). Other settings, and one whose traces
    do not extend (``NotSynthesizable``, its reason kept in ``unsynthesizable``), run as a
    ``TensorFloorSession`` (``floor``) or a ``FreshTrialsSession``: on the full build, each trial
    on one of its own. A synthesized trial takes the tensor floor from its own first two builds
    (``FewBlocksSession._tensor_floor``).

    tests/test_trace_synthesis.py and ``bench/llama_plans.py --check`` compare it with full
    builds, to the byte."""

    def __init__(self, workload, backend: EstimateMemoryBackend, *, session_type, total_blocks: int,
                 layout: dict, precision, checkpointing, sharded: bool, offload: bool,
                 reduce_every_micro_step: bool, floor: bool):
        """``floor``: settings that do not synthesize are ruled out on the small builds' tensors
        first (a ``TensorFloorSession``'s floor, set up only for them)."""
        settings = dict(session_type=session_type, total_blocks=total_blocks, layout=layout,
                        precision=precision, checkpointing=checkpointing, sharded=sharded,
                        offload=offload, reduce_every_micro_step=reduce_every_micro_step)
        super().__init__(workload, backend, **settings)
        self._few = FewBlocksSession(workload, backend, traced=True, **settings)
        self._few_open = self._floor_open = self._floor_made = False
        self._floors = floor
        self._failed = False
        """This setting's traces did not extend: its trials run on the full build."""
        self.unsynthesizable: str | None = None
        """Why the latest setting that did not synthesize did not."""

    def __enter__(self) -> "SynthesizedTrialsSession":
        FreshTrialsSession.__enter__(self)
        self._stack = contextlib.ExitStack()
        self._floor_passed = False
        try:
            self._few.__enter__()
            self._few_open = True
            self._not_synthesized()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        try:
            super().__exit__(*exc_info)  # the full build's, then the floor's
        finally:
            self._floor_open = False
            if self._few_open:
                self._few_open = False
                self._few.__exit__(None, None, None)

    def _synthesizing(self) -> bool:
        return self._few_open and self._few.synthesizable and not self._failed

    def _not_synthesized(self) -> None:
        """A setting that does not synthesize: its floor, where it takes one."""
        if self._synthesizing():
            return
        if not self._failed:
            self.unsynthesizable = (f"{self._few.checkpointed_blocks} of {self._few.total_blocks} "
                                    "checkpointed blocks do not repeat in three small builds that "
                                    "cost less than the model")
        if self._floors:
            self._open_floor()

    def _open_floor(self) -> None:
        if not self._floor_open:
            self._floor._asked = self._asked
            self._stack.enter_context(self._floor)
            self._floor_open = self._floor_made = True

    def __getattr__(self, name):
        # The small builds' (blocks, checkpointing, gradients: the full build's) where they run.
        if name.startswith("_"):
            raise AttributeError(name)
        if self._full is None and self._few.synthesizable and not self._failed and hasattr(self._few, name):
            if name == "gradient_bytes" and self._few_open:
                self._few.ensure_built()  # what the builds' set-up counts
            return getattr(self._few, name)
        if self._floor_made:  # read after the session ends too, as a plain session's are
            return super().__getattr__(name)
        return FreshTrialsSession.__getattr__(self, name)

    def set_checkpointing(self, checkpointing) -> int:
        self._asked, self._failed, self._floor_passed = checkpointing, False, False
        self._close_full()
        blocks = self._few.set_checkpointing(checkpointing)
        if self._synthesizing():
            if self._floor_open:
                self._floor.set_checkpointing(checkpointing)
            return blocks
        opened = not self._floor_open
        self._not_synthesized()
        if self._floor_open:
            return self._floor.checkpointed_blocks if opened else self._floor.set_checkpointing(checkpointing)
        return self._full_session().checkpointed_blocks

    def tensor_peak(self, n: int) -> int:
        self._open_floor()
        return super().tensor_peak(n)

    def knows(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> bool:
        if self._floor_open and not self._synthesizing():
            return super().knows(n, window=window, micro_batches=micro_batches)
        return FreshTrialsSession.knows(self, n, window=window, micro_batches=micro_batches)

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> Trial:
        # A synthesized trial takes its tensor floor from its own first two builds.
        if self._floor_open and not self._synthesizing():
            return super().run(n, window=window, micro_batches=micro_batches)
        return FreshTrialsSession.run(self, n, window=window, micro_batches=micro_batches)

    def _fresh_trial(self, n: int, window: int, micro_batches):
        if self._synthesizing():
            try:
                return self._few.run(n, window=window, micro_batches=micro_batches)
            except NotSynthesizable as why:
                self._failed, self.unsynthesizable = True, str(why)
        return super()._fresh_trial(n, window, micro_batches)


class _Timeline:
    """The peak of each segment of a small build's forward-backward passes, between the events
    that start a block's forward, end the last one's, and start each block's backward (a hook on
    its output's gradient) and the passes' tail (the first block's input gradient), named by
    micro-step and the block's position (``BlockPattern.position``).

    Within a segment every moment holds the same tensors of the other blocks (the activations
    saved by those before it, the gradients of those after it), so a segment's peak is affine in
    the repetitions, while the pass's peak, a maximum over segments, is not: replicated 8B at
    micro-batch 1 peaks at the loss with 3 and 4 blocks and at the end of backward (every
    gradient) with 32. Units away from the first and last differ only by that affine part in
    their index (FSDP2 prefetches no block after the last, and the first block's backward runs
    last), so the segment peaks of units between the second and the second-to-last lie between
    theirs, and the ``EDGE`` units at each end hold the maximum over all of them."""

    def __init__(self, tracker, session):
        self.tracker = tracker
        self.peaks: dict[tuple, int] = {}
        self.names: list[tuple] = []
        self._label = None
        self._step = -1
        self._forward = False
        self.blocks = checkpointable_blocks(session.model)
        for index, block in enumerate(self.blocks):
            block.register_forward_pre_hook(functools.partial(self._block_starts, index))
            block.register_forward_hook(functools.partial(self._block_ends, index))
        forward_backward = session._forward_backward

        def measured(batch):
            self._step += 1
            self._forward = True
            self._switch(("before the blocks", self._step))
            try:
                return forward_backward(batch)
            finally:
                self._switch(None)

        session._forward_backward = measured

    def name_blocks(self, pattern: BlockPattern, repeats: int) -> None:
        self.names = [pattern.position(i, repeats) for i in range(len(self.blocks))]
        self.peaks, self._step = {}, -1

    def _switch(self, label) -> None:
        if self._label is not None:
            self.peaks[self._label] = max(self.peaks.get(self._label, 0), self.tracker.peak)
        self.tracker.peak = self.tracker.current
        self._label = label

    def _block_starts(self, index, module, args):
        if not self._forward:  # recomputation of a checkpointed block, in backward
            return
        self._switch(("forward", self._step, self.names[index]))
        if index == 0:
            on_gradient(args, ("after the blocks' backward", self._step), self._switch)

    def _block_ends(self, index, module, args, output):
        if not self._forward:
            return
        on_gradient(output, ("backward", self._step, self.names[index]), self._switch)
        if index == len(self.blocks) - 1:
            self._switch(("after the blocks", self._step))
            self._forward = False


def _first_blocks(workload, count: int, dropped_ran, on_blocks=None, *, early: bool = True):
    """The workload with a model factory that keeps the first ``count`` repeated blocks; a dropped
    block that runs anyway (the model keeps its own list of them) calls ``dropped_ran``;
    ``on_blocks`` is called with the blocks kept.

    ``early``: where the factory builds on fake tensors (``on_fake_tensors``), the blocks are cut
    before their tensors are made (``build_fake_model``'s ``cut``); a dropped block is then left
    on the meta device, so the hook raises ``DroppedBlockRan`` after ``dropped_ran`` rather than
    let it run there (the session builds again with ``early=False``, where it runs on fake
    tensors and only ``dropped_ran`` tells)."""

    kept: list = []

    def keep_first(model: torch.nn.Module, *, raises: bool) -> None:
        container = _block_container(model)
        kept[:] = list(container)[:count]
        if count < len(container):
            hook = _raising(dropped_ran) if raises else dropped_ran
            for block in list(container)[count:]:
                block.register_forward_pre_hook(hook)
            for name in list(container._modules):
                del container._modules[name]
            for index, block in enumerate(kept):
                container.add_module(str(index), block)

    def build() -> torch.nn.Module:
        if early and getattr(workload.model, "takes_cut", False):
            model = workload.model(cut=functools.partial(keep_first, raises=True))
        else:
            model = workload.new_model()
            keep_first(model, raises=False)
        if on_blocks is not None:
            on_blocks(list(kept))
        return model

    return dataclasses.replace(workload, model=build)


class DroppedBlockRan(RuntimeError):
    """A block cut from a small build before its tensors were made ran: the model holds its blocks
    elsewhere too (caught by ``FewBlocksSession``, which builds again)."""


def _raising(dropped_ran):
    def hook(module, args):
        dropped_ran(module, args)
        raise DroppedBlockRan("a block cut from a small build ran")

    return hook


__all__ = ["BlockPattern", "DroppedBlockRan", "FewBlocksSession", "SmallBuild", "TensorFloorSession", "block_pattern",
           "built_whole_instead", "checkpoint_first_blocks", "extend", "first_blocks", "full_builds", "identical_block_count", "layout_session", "small_builds",
           "synthesized_traces"]
