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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import EstimateUnavailable
from ..distributed.sharding.ranks import sharded_step
from ..memory.cpu import tracking_resizes
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits, uncounted_sharding_propagation
from ..units import format_bytes
from ..workload.activation_checkpointing import (checkpointable_blocks, enable_checkpointing,
                                                 repeated_blocks, spread_evenly)
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest
from .fresh_trials import FreshTrialsSession
from .result import Trial
from .trial import SetupOutOfMemory

EDGE = 2
"""Units of the block pattern told apart at each end of the stack (see ``_Timeline``); the
smaller build repeats the unit twice that often, the larger once more."""

_enabled = True

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
    if total is not None and total >= FLOOR_MIN_BLOCKS and backend.tracker.budget_bytes is not None:
        # A modelled CUDA allocator's reserved memory (rounding, cached segments) does not extend
        # from small builds as tensor bytes do: the small builds' tensors only rule trials out
        # (under a budget; an estimate without one runs the full build alone).
        yield TensorFloorSession(workload, backend, session_type=session_type, total_blocks=total,
                                 layout=layout, **session_args)
        return
    if isinstance(backend, EstimateMemoryBackend) and backend.allocator is not None \
            and not torch.distributed.is_initialized():
        yield FreshTrialsSession(workload, backend, session_type=session_type, layout=layout, **session_args)
        return
    with sharded_step(workload, **layout) as step_workload:
        yield session_type(step_workload, backend, parallel=parallel, **session_args)


def identical_block_count(workload) -> int | None:
    """N where the model's repeated blocks are N identical children of one container, with more
    blocks than the small builds hold; else None. The model is built on fake tensors."""
    if workload.model_is_instance:
        return None
    try:
        with fake_tensor_limits(workload), FakeTensorMode(allow_non_fake_inputs=True):
            model = workload.new_model()
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

    def __init__(self, like: EstimateMemoryBackend, *, tensors_only: bool = False):
        super().__init__(None, for_cuda=like.for_cuda, target=like.info(), offload=like.offload)
        if tensors_only:  # CUDA's accounting (foreach, no gloo buffers), tensor bytes only
            self.allocator = self.tracker.allocator = None
        self._mode = self.counting_mode()

    def tracking(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def resumed(self):
        with tracking_resizes(self.tracker), self._mode, uncounted_sharding_propagation():
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
                 reduce_every_micro_step: bool, tensors_only: bool = False):
        """``tensors_only``: the small builds count tensor bytes without ``backend``'s allocator
        model (``TensorFloorSession``'s floor); the budget is still ``backend``'s."""
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
        self._dropped_ran = False
        """A block cut from a small build ran in its forward: the model holds its blocks elsewhere
        too, and only full builds measure it."""

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
        stack, self._stack = self._stack, None
        children, self._children = self._children, {}
        for backend, session in reversed(children.values()):
            with backend.resumed():
                session.__exit__(None, None, None)
        if stack is not None:
            stack.close()

    def set_checkpointing(self, checkpointing) -> int:
        request = CheckpointingRequest.parse(checkpointing, allow_auto=False)
        total = self.total_blocks
        self.checkpointing = (Checkpointing.every_block(total) if request.value == "on"
                              else request.resolve(total, source=self.workload.source))
        self.checkpointed_blocks = self.checkpointing.count or 0
        self._pattern = None if self._dropped_ran else block_pattern(self.checkpointed_blocks, total)
        sizes = self._sizes()
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
        return self.checkpointed_blocks

    def window_micro_batches(self, n: int, window: int) -> list[int]:
        backend, session = self._children[self._sizes()[0]]
        return session.window_micro_batches(n, window)

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> Trial:
        trials, segments = [], []
        for size in self._sizes():
            backend, session = self._children[size]
            timeline = self._timelines.get(size)
            with backend.resumed():
                self._checkpoint(session, size)
                if timeline is not None and self._pattern is not None:
                    timeline.name_blocks(self._pattern, self._pattern.small[len(trials)])
                trials.append(session.run(n, window=window, micro_batches=micro_batches))
            segments.append(timeline.peaks if timeline is not None else None)
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
        else:
            fields = {name: self._extended([getattr(t, name) for t in trials]) for name in _EXTENDED}
            fields["activation_peak_bytes"] = self._extended_segments(*segments)
            fields["peak_bytes"] = max(fields["activation_peak_bytes"], fields["step_peak_bytes"])
        budget = self.backend.tracker.budget_bytes
        fits = budget is None or fields["peak_bytes"] <= budget
        if not fits:  # as a budgeted step reports one that ran out of memory
            fields["activation_peak_bytes"] = fields["step_peak_bytes"] = None
        return dataclasses.replace(trials[-1], fits=fits, seconds=sum(t.seconds for t in trials),
                                   **fields)

    def _extended_segments(self, low: dict, high: dict) -> int:
        named = {label for label in low if None not in label}
        if named != {label for label in high if None not in label}:
            raise RuntimeError(f"the small builds' passes differ: {sorted(low, key=str)} and "
                               f"{sorted(high, key=str)}")
        return max(self._extended([low[label], high[label]]) for label in named)

    def _sizes(self) -> list[int]:
        if self._pattern is None:
            return [self.total_blocks]
        return [self._pattern.blocks(m) for m in self._pattern.small]

    def _extended(self, values: list[int | None]) -> int | None:
        if self._pattern is None:
            return values[0]
        return extend(tuple(values), self._pattern.small, self._pattern.repeats)

    def _checkpoint(self, session, size: int) -> None:
        if self._pattern is None:
            session.set_checkpointing(self.checkpointing)
            return
        repeats = self._pattern.small[self._sizes().index(size)]
        indices = self._pattern.checkpointed(repeats)
        if len(indices) in (0, size):  # off, or every block (a model's own switch included)
            session.set_checkpointing("on" if indices else "off")
            return
        session.set_checkpointing("off")
        session.checkpointed_blocks = enable_checkpointing(session.model, source=self.workload.source,
                                                           indices=indices)

    def _child(self, size: int):
        if size in self._children:
            return self._children[size]
        backend = _ResumableBackend(self.backend, tensors_only=self._tensors_only)
        step_workload = self._stack.enter_context(
            sharded_step(_first_blocks(self.workload, size, self._dropped_block_ran), **self.layout))
        session = self.session_type(step_workload, backend, precision=self.precision,
                                    checkpointing=False, sharded=self.sharded, offload=self.offload,
                                    reduce_every_micro_step=self.reduce_every_micro_step,
                                    parallel=self.layout.get("parallel"))
        with backend.resumed():
            session.__enter__()
        self._children[size] = backend, session
        if size < self.total_blocks:
            self._timelines[size] = _Timeline(backend.tracker, session)
        return backend, session

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

    def run(self, n: int, *, window: int = 1, micro_batches: list[int] | None = None) -> Trial:
        if not self._floor_passed:
            floor = self._floor.run(n, window=window, micro_batches=micro_batches)
            if not floor.fits:
                self.floored_trials += 1
                return floor
            self._floor_passed = True
        return super().run(n, window=window, micro_batches=micro_batches)


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
            _on_gradient(args, ("after the blocks' backward", self._step), self._switch)

    def _block_ends(self, index, module, args, output):
        if not self._forward:
            return
        _on_gradient(output, ("backward", self._step, self.names[index]), self._switch)
        if index == len(self.blocks) - 1:
            self._switch(("after the blocks", self._step))
            self._forward = False


def _on_gradient(values, label, switch) -> None:
    """Switch to ``label`` when the gradient of the first tensor in ``values`` that needs one is
    computed."""
    for value in torch.utils._pytree.tree_leaves(values):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(lambda grad: switch(label))
            return


def _first_blocks(workload, count: int, dropped_ran):
    """The workload with a model factory that keeps the first ``count`` repeated blocks; a dropped
    block that runs anyway (the model keeps its own list of them) calls ``dropped_ran``."""

    def build() -> torch.nn.Module:
        model = workload.new_model()
        container = _block_container(model)
        if count < len(container):
            for block in list(container)[count:]:
                block.register_forward_pre_hook(dropped_ran)
            keep = list(container)[:count]
            for name in list(container._modules):
                del container._modules[name]
            for index, block in enumerate(keep):
                container.add_module(str(index), block)
        return model

    return dataclasses.replace(workload, model=build)


__all__ = ["BlockPattern", "FewBlocksSession", "TensorFloorSession", "block_pattern", "extend",
           "full_builds", "identical_block_count", "layout_session"]
