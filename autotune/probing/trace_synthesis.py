"""Trace synthesis (prototype): the modelled CUDA caching allocator's event trace of a model of N
identical blocks, made from the traces of builds cut to fewer blocks, and replayed for the
reserved peak (``affine_blocks.synthesized_traces`` turns it on for ``FewBlocksSession``;
bench/trace_synthesis_session.py and tests/test_trace_synthesis.py compare it with full builds).

A trace is what ``CachingAllocatorModel`` records (malloc/free/resize by storage key, empty_cache)
with marks at the blocks' boundaries (``TraceMarks``: ("mark", "F", b): block b's forward starts;
("mark", "B", b): its output's gradient is computed, its backward and recomputation start; S, H,
T, O, Oend, trial: a micro-step, the head, the tail of backward, the optimizer phase, its end,
a measured trial's start).

``normalize`` makes it a pure malloc/free trace with one id per block a key holds (a resize is a
new block, then the old one freed, which is what the model does), exact for the allocator.

``Synthesis`` takes the traces of three small builds of m, m+1 and m+2 units of the checkpointing
pattern:

- block segments (between a block's marks) are named by their unit's position (one of the
  ``EDGE`` first or last units, or "mid") and the block's offset in it; every mid segment of a
  phase has the same events, so the segments of N units are the small build's with the mid
  segments repeated;
- the other segments (set-up, optimizer phase...) are aligned between builds m and m+1 on runs
  of equal events (difflib): what m+1 inserts is repeated (slid to the end of the stretch that
  repeats, so each phase's inserted chunk is the last unit's), what it deletes (a build cut from
  the full model frees the cut blocks' parameters) is deleted as often, a run whose length
  changes is extended affinely, and so is a size that changes (a stack of one scalar per
  parameter);
- a free names no key: each free of the template frees the k-th newest (or oldest) live block of
  its size, or the block allocated by a given event of an inserted chunk (same copy) or of the
  set-up (its run index moving per copy), or by the same event of a block segment a fixed number
  of blocks before (a checkpointed block's input, freed in its backward), whichever all three
  small builds agree on; each small build must first be its own synthesis.

Two things make a trace depend on what ran before it in the process, and small builds share it:
DTensor's sharding propagation runs each new op on fake tensors of the full shape, counted where
our fake mode is the one it finds (on CUDA it makes its own: no device memory), then caches it for
the process (``uncounted_sharding_propagation``); and cut blocks live in reference cycles, freed
wherever the interpreter's automatic collection happens to run (``automatic_collection_off``).
Traced builds run under both (every estimate counts no sharding propagation); the full builds
they are compared with give the same peaks with automatic collection on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import functools

import torch

from ..memory.cuda_allocator import AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel, cublas_workspaces

EDGE = 2
RUN_ENDS = 1
"""Events of a run whose length changes with the blocks are told apart this far from its ends."""


class TraceMarks:
    """Records a session's allocator events with marks at the blocks' boundaries.

    ``record(backend)`` before the session is entered (the cuBLAS workspaces the backend took
    are written first); ``hook_blocks(blocks)`` on the model's blocks as it is built (before
    the warm-up step); ``hook_session(session)`` before the session is entered."""

    def __init__(self):
        self.events: list | None = None
        self._backward = False

    def record(self, backend, hopper: bool) -> None:
        self.events = backend.allocator.events = [
            ("malloc", ("cublas workspace", i), n) for i, n in enumerate(cublas_workspaces(hopper=hopper))]
        begin_trial = backend.begin_trial

        def begin():
            self.mark("trial")
            begin_trial()

        backend.begin_trial = begin

    def mark(self, *label) -> None:
        if self.events is not None:
            self.events.append(("mark", *label))

    def hook_blocks(self, blocks) -> None:
        last = len(blocks) - 1
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(functools.partial(self._starts, index))
            block.register_forward_hook(functools.partial(self._ends, index, last))

    def hook_session(self, session) -> None:
        forward_backward, optimizer_phase = session._forward_backward, session._optimizer_phase

        def marked_forward_backward(batch):
            self._backward = False
            self.mark("S")
            try:
                return forward_backward(batch)
            finally:
                self.mark("E")  # the pass's end: what follows is in no segment of it

        def marked_optimizer_phase():
            self.mark("O")
            try:
                return optimizer_phase()
            finally:
                self.mark("Oend")

        session._forward_backward, session._optimizer_phase = marked_forward_backward, marked_optimizer_phase
        if session.sharded:
            outside_budget = session._outside_budget

            @contextlib.contextmanager
            def marked_outside_budget():
                # A sharded session's one-time set-up is not held to the budget (the full model
                # before sharding, the warm-up step): nor is its replay.
                with outside_budget():
                    self.mark("unbudgeted")
                    try:
                        yield
                    finally:
                        self.mark("budgeted")

            session._outside_budget = marked_outside_budget

    def _backward_mark(self, label) -> None:
        self._backward = True
        self.mark(*label)

    def _starts(self, index, module, args):
        if self._backward:
            return  # a checkpointed block's recomputation: in its backward segment
        self.mark("F", index)
        if index == 0:
            on_gradient(args, ("T",), self._backward_mark)

    def _ends(self, index, last, module, args, output):
        if self._backward:
            return
        on_gradient(output, ("B", index), self._backward_mark)
        if index == last:
            self.mark("H")


def on_gradient(values, label, switch) -> None:
    """Call ``switch(label)`` when the gradient of the first tensor in ``values`` that needs one
    is computed (``TraceMarks`` and ``affine_blocks._Timeline`` cut a pass into segments so)."""
    for value in torch.utils._pytree.tree_leaves(values):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(lambda grad: switch(label))
            return


def normalize(events) -> list[tuple]:
    """("m", id, size) / ("f", id) / ("e",) / ("mark", ...): one id per block held, ids in
    allocation order."""
    live, out, count = {}, [], 0
    for event in events:
        kind = event[0]
        if kind == "malloc":
            if event[2] <= 0 or event[1] in live:
                continue  # the model hands out nothing for these
            live[event[1]] = count
            out.append(("m", count, event[2]))
            count += 1
        elif kind == "free":
            old = live.pop(event[1], None)
            if old is not None:
                out.append(("f", old))
        elif kind == "resize":
            old = live.pop(event[1], None)
            if event[2] > 0:
                live[event[1]] = count
                out.append(("m", count, event[2]))
                count += 1
            if old is not None:
                out.append(("f", old))
        elif kind == "empty_cache":
            out.append(("e",))
        elif kind == "mark":
            out.append(event)
        else:
            raise ValueError(f"unknown event {event!r}")
    return out


def replay_peak(trace, config: AllocatorConfig | None = None) -> int:
    """The reserved peak from the "trial" mark on (what the measured step reports)."""
    return replay_trial(trace, config).reserved_peak


@dataclasses.dataclass
class ReplayedTrial:
    """The last trial's peaks in a replayed trace, as ``EstimateMemoryBackend`` reports them."""

    activation_peak: int
    """Reserved, from the trial's start to its optimizer phase."""
    step_peak: int
    """Reserved, in the optimizer phase."""
    reserved_peak: int
    requested_peak: int
    """Tensor bytes (the tracker's count) over the trial."""
    fits: bool = True


def replay_trial(trace, config: AllocatorConfig | None = None, limit: int | None = None) -> ReplayedTrial:
    """The peaks of the trace's last trial (from its "trial" mark on); ``limit``: the budget,
    where the model empties its cache and retries, then runs out of memory (fits False)."""
    model = CachingAllocatorModel(config, limit=limit)
    activation = step = reserved = requested = 0
    phase = None
    try:
        for event in trace:
            kind = event[0]
            if kind == "m":
                model.malloc(event[1], event[2])
            elif kind == "f":
                model.free(event[1])
            elif kind == "e":
                model.empty_cache()
            elif event[1] == "unbudgeted":
                model.limit = None
            elif event[1] == "budgeted":
                model.limit = limit
            elif event[1] == "trial":
                model.reset_peak()
                phase = "activation"
            elif event[1] == "O" and phase is not None:
                activation = model.peak_reserved
                reserved, requested = model.peak_reserved, model.peak_requested
                model.reset_peak()
                phase = "step"
            elif event[1] == "Oend" and phase == "step":
                step = model.peak_reserved
                phase = "after"
    except AllocatorOutOfMemory:
        # As the tracker counts a refused allocation: its bytes on top of those in use.
        refused = max(requested, model.peak_requested, model.requested + event[2])
        return ReplayedTrial(model.peak_reserved, model.peak_reserved, model.peak_reserved,
                             refused, fits=False)
    return ReplayedTrial(activation, step, max(reserved, model.peak_reserved),
                         max(requested, model.peak_requested))


def tensor_peaks(trace, units: int, unit: int = 1) -> tuple[dict, int]:
    """The tensors' peaks in a small build's last trial (from its "trial" mark on), as the
    requested bytes of its normalized trace count them (the tracker's bytes and the cuBLAS
    workspaces): ({segment: peak} of its forward-backward passes, the middle units' left out,
    named as ``affine_blocks._Timeline`` names them; the optimizer phase's peak). Extended from two
    builds they are the tensor floor (``TensorFloorSession``)."""
    tok = tokens(trace)
    start = max(i for i, t in enumerate(tok) if t[:2] == ("mark", "trial"))
    requested = sum(t[1] if t[0] == "m" else -t[1] for t in tok[:start] if t[0] in "mf")
    peaks, label, micro = {}, None, -1
    for t in tok[start:]:
        if t[0] == "mark":
            kind = t[1]
            if kind == "S":
                micro += 1
                label = ("before the blocks", micro)
            elif len(t) == 3:
                where = position(t[2], units, unit)
                label = None if where[1] == "mid" else (
                    "forward" if kind == "F" else "backward", micro, where)
            else:
                label = {"H": ("after the blocks", micro), "T": ("after the blocks' backward", micro),
                         "O": ("optimizer",)}.get(kind)
            if label is not None:
                peaks[label] = max(peaks.get(label, 0), requested)
            continue
        if t[0] in "mf":
            requested += t[1] if t[0] == "m" else -t[1]
            if label is not None:
                peaks[label] = max(peaks[label], requested)
    return peaks, peaks.pop(("optimizer",), 0)


def tokens(trace) -> list[tuple]:
    """Ids dropped: ("m", size), ("f", size of the block freed), ("e",), marks."""
    sizes, out = {}, []
    for event in trace:
        if event[0] == "m":
            sizes[event[1]] = event[2]
            out.append(("m", event[2]))
        elif event[0] == "f":
            out.append(("f", sizes[event[1]]))
        else:
            out.append(event)
    return out


def position(block: int, units: int, unit: int = 1):
    """A block's position: (offset in its unit, the unit's index from the first (0, 1), from the
    last (-1, -2), or "mid")."""
    u, offset = divmod(block, unit)
    return offset, (u if u < EDGE else u - units if u >= units - EDGE else "mid")


def segments(tok, units: int, unit: int = 1) -> list[tuple[tuple, list]]:
    """The trace cut at its marks: (label, events). A plain segment's label is (k, kind, mark),
    k counting the plain marks; a block segment's (k of the plain mark before it, phase, the
    block's ``position``, mark)."""
    out, label, current, k = [], ("setup",), [], 0
    for event in tok:
        if event[0] != "mark":
            current.append(event)
            continue
        out.append((label, current))
        current = []
        if len(event) == 3:  # a block's mark
            label = (k, event[1], position(event[2], units, unit), event)
        else:
            k += 1
            label = (k, event[1], event)
    out.append((label, current))
    return out


class NotSynthesizable(Exception):
    """The small builds' traces do not extend (the reason says where)."""


def _placeholders(a, b):
    """Sizes only one of a and b has, paired in order of appearance (affine sizes)."""
    def order(seq, other_sizes):
        seen = []
        for t in seq:
            if t[0] in "mf" and t[1] not in other_sizes and t[1] not in seen:
                seen.append(t[1])
        return seen

    sizes_a = {t[1] for t in a if t[0] in "mf"}
    sizes_b = {t[1] for t in b if t[0] in "mf"}
    only_a, only_b = order(a, sizes_b), order(b, sizes_a)
    if len(only_a) != len(only_b):
        raise NotSynthesizable(f"sizes differ unpaired: {only_a} and {only_b}")
    return dict(zip(only_a, only_b))


def _runs(seq):
    """Run-length encoding: [[token, count]]."""
    out = []
    for t in seq:
        if out and out[-1][0] == t:
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return out


def _edit(a, b, label):
    """How segment ``a`` (m blocks) becomes ``b`` (m+1), on runs of equal events (a run's length
    may differ: extended affinely): [(op, i1, i2, chunk or counts)], runs of a and b, placeholders."""
    pairs = _placeholders(a, b)
    back = {v: k for k, v in pairs.items()}
    ka = _runs([(t[0], ("v", t[1])) if t[0] in "mf" and t[1] in pairs else t for t in a])
    kb = _runs([(t[0], ("v", back[t[1]])) if t[0] in "mf" and t[1] in back else t for t in b])
    edits = []
    opcodes = difflib.SequenceMatcher(None, [r[0] for r in ka], [r[0] for r in kb], autojunk=False).get_opcodes()
    starts = [op[1] for op in opcodes if op[0] != "equal"] + [len(ka)]
    for number, (tag, i1, i2, j1, j2) in enumerate(opcodes):
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                if ka[i][1] != kb[j][1]:
                    edits.append(("count", i, i + 1, kb[j][1] - ka[i][1]))
        elif tag == "insert":
            # Slid to the end of the repeating stretch it lies in (rotating the chunk): then the
            # chunk inserted in every phase is the last unit's, and a block freed in one chunk
            # was allocated in the same copy of another.
            chunk = [list(r) for r in kb[j1:j2]]
            limit = min(s for s in starts if s > i1) if any(s > i1 for s in starts) else len(ka)
            while i1 < limit and ka[i1] == chunk[0]:
                chunk = chunk[1:] + chunk[:1]
                i1 += 1
            edits.append(("insert", i1, i1, chunk))
        elif tag == "delete":
            edits.append(("delete", i1, i2, None))
        else:
            raise NotSynthesizable(f"segment {label[:3]}: runs {i1}:{i2} of the smaller build are "
                                   f"runs {j1}:{j2} of the larger ({ka[i1:i2][:6]} ... vs {kb[j1:j2][:6]} ...)")
    return edits, (ka, pairs)


def _apply(edits, runs, copies: int):
    """The segment with the edit repeated ``copies`` times: [(token, origin)]."""
    ka, pairs = runs
    out, last = [], 0
    counts = {i: d for tag, i, _, d in edits if tag == "count"}

    def token(t):
        if t[0] in "mf" and isinstance(t[1], tuple):  # a placeholder: its size is affine
            size = t[1][1]
            return (t[0], size + copies * (pairs[size] - size))
        return t

    def keep(lo, hi):
        for i in range(lo, hi):
            t, n = ka[i]
            step = counts.get(i, 0)
            n += copies * step
            if n < 0:
                raise NotSynthesizable(f"a run's length goes below 0 at {i}")
            # A run of constant length names each of its events; one whose length changes names
            # the first and last few apart, the others alike (they must free alike).
            out.extend((token(t), ("a", i, j) if not step else
                        ("a", i, "*", min(j, RUN_ENDS), min(n - 1 - j, RUN_ENDS)), None) for j in range(n))

    for index, (tag, i1, i2, chunk) in enumerate(edits):
        if tag == "insert":
            keep(last, i1)
            for c in range(copies):
                for o, (t, n) in enumerate(chunk):
                    out.extend((token(t), ("ins", index, o, j), c) for j in range(n))
            last = i1
        elif tag == "delete":  # the chunk repeats around i1; drop ``copies`` of it
            length = i2 - i1
            unit = ka[i1:i2]
            start = i1
            while start - length >= last and ka[start - length:start] == unit:
                start -= length
            if ka[start:start + copies * length] != unit * copies:
                raise NotSynthesizable(f"a deleted chunk at {i1} does not repeat {copies} times")
            keep(last, start)
            last = start + copies * length
    keep(last, len(ka))
    return out


@dataclasses.dataclass
class Synthesis:
    """The trace of ``blocks`` + k blocks from traces of ``blocks``, ``blocks`` + 1 and
    ``blocks`` + 2 (normalized)."""

    traces: tuple  # three normalized traces, of ``units``, ``units`` + 1 and ``units`` + 2 units
    units: int
    unit: int = 1
    """Blocks in a unit of the checkpointing pattern."""

    def __post_init__(self):
        m = self.units
        self.segs = [segments(tokens(t), m + i, self.unit) for i, t in enumerate(self.traces)]
        small, large = self.segs[0], self.segs[1]
        self.edits = {}
        self.block_templates = {}
        # The larger build's labels, mid segments once per phase.
        self.layout = []
        for label, events in large:
            if len(label) == 4:  # a block segment
                key = label[:3]
                known = self.block_templates.setdefault(key, events)
                if known != events:
                    raise NotSynthesizable(f"block segments {key} differ")
                if not self.layout or self.layout[-1] != ("block", key):
                    self.layout.append(("block", key))
            else:
                self.layout.append(("plain", label))
        for label, events in small + self.segs[2]:
            if len(label) == 4 and self.block_templates.get(label[:3]) != events:
                raise NotSynthesizable(f"block segment {label[:3]} differs between builds")
        plain_small = {l: e for l, e in small if len(l) != 4}
        plain_large = {l: e for l, e in large if len(l) != 4}
        if set(plain_small) != set(plain_large):
            raise NotSynthesizable("the builds' segments differ")
        for label in plain_large:
            self.edits[label] = _edit(plain_small[label], plain_large[label], label)
        self.plain_small, self.plain_large = plain_small, plain_large
        self.rules = self._learn_ranks()

    def _tokens_with_origins(self, total: int):
        """(token, origin, copy, block) of the trace of ``total`` units, marks included (origin
        None); ``block``: the block whose segment holds the event, None in a plain segment."""
        copies = total - self.units
        out, written = [], set()
        for kind, key in self.layout:
            if kind == "plain":
                if key != ("setup",):
                    out.append((key[-1], None, None, None))
                edits, pairs = self.edits[key]
                for t, origin, copy in _apply(edits, pairs, copies):
                    out.append((t, (key, origin), copy, None))
                continue
            step, phase, _ = key
            if (step, phase) in written:
                continue
            written.add((step, phase))
            blocks = total * self.unit
            order = range(blocks - 1, -1, -1) if phase == "B" else range(blocks)
            for b in order:
                p = position(b, total, self.unit)
                out.append((("mark", phase, b), None, None, None))
                for o, t in enumerate(self.block_templates[(step, phase, p)]):
                    out.append((t, ((step, phase, p), o), None, b))
        return out

    def _learn_ranks(self) -> dict:
        """For every free of the template, the block it frees, as all three small builds agree:
        ("new", k) or ("old", k), the k-th newest or oldest live block of its size; or ("at",
        origin, step), the block allocated by the event of that origin (a plain segment's), its
        run index moved by ``step`` per copy of the free's inserted chunk (a chunk that shards
        one more block frees that block's parameters, made where the model was built)."""
        seen = collections.defaultdict(list)
        for index, trace in enumerate(self.traces):
            synth = self._tokens_with_origins(self.units + index)
            real = tokens(trace)
            if [t for t, _, _, _ in synth] != real:
                raise NotSynthesizable(f"the build of {self.units + index} units is not its own "
                                       f"synthesis")
            allocated = {}
            for (t, origin, copy, block), event, rank in zip(synth, trace, _ranks(trace)):
                if event[0] == "m":
                    allocated[event[1]] = (origin, copy, block)
                elif t[0] == "f":
                    seen[origin].append((rank, copy, allocated[event[1]], block))
        rules = {}
        for origin, cases in seen.items():
            new = {rank[0] for rank, _, _, _ in cases}
            old = {rank[1] for rank, _, _, _ in cases}
            if len(new) == 1:
                rules[origin] = ("new", new.pop())
            elif len(old) == 1:
                rules[origin] = ("old", old.pop())
            else:
                rules[origin] = _block_rule(cases) or _origin_rule(
                    [(rank, copy, (alloc, alloc_copy)) for rank, copy, (alloc, alloc_copy, _), _ in cases])
        return rules

    def trace(self, total: int) -> list[tuple]:
        """The synthesized normalized trace of ``total`` units."""
        out, live, count = [], collections.defaultdict(list), 0
        by_origin, by_block = {}, {}
        for t, origin, copy, block in self._tokens_with_origins(total):
            if t[0] == "m":
                live[t[1]].append(count)
                by_origin[origin, copy] = count
                if block is not None:
                    by_block[origin[0][:2], origin[1], block] = count
                out.append(("m", count, t[1]))
                count += 1
            elif t[0] == "f":
                rule = self.rules.get(origin)
                if rule is None:
                    raise NotSynthesizable(f"no rank agreed for the free at {origin}")
                pool = live[t[1]]
                if rule[0] == "block":
                    (step, phase, event), distance = rule[1], rule[2]
                    lid = by_block.get(((step, phase), event, block - distance))
                    if lid not in pool:
                        raise NotSynthesizable(f"the free at {origin} finds no live block {distance} "
                                               f"blocks before its own")
                    pool.remove(lid)
                    out.append(("f", lid))
                    continue
                if rule[0] == "at":
                    (key, (a, i, j)), step = rule[1], rule[2]
                    lid = by_origin.get(((key, (a, i + step * (copy or 0), j)), None))
                    if lid not in pool:
                        raise NotSynthesizable(f"the free at {origin} finds no live block at its origin")
                    pool.remove(lid)
                    out.append(("f", lid))
                    continue
                if rule[0] == "copy":
                    lid = by_origin.get((rule[1], (copy or 0) + rule[2]))
                    if lid not in pool:
                        raise NotSynthesizable(f"the free at {origin} finds no live block at its origin")
                    pool.remove(lid)
                    out.append(("f", lid))
                    continue
                k = len(pool) - 1 - rule[1] if rule[0] == "new" else rule[1]
                if not 0 <= k < len(pool):
                    raise NotSynthesizable(f"the free at {origin} has no block of its rank")
                out.append(("f", pool.pop(k)))
            else:
                out.append(t)
        return out


def _block_rule(cases):
    """Where a block segment's free takes the block that the same event of the segment of one
    phase allocated a fixed number of blocks earlier (a checkpointed block's input, the previous
    block's output, freed in its backward): ("block", (step, phase, event), distance); else None."""
    found = set()
    for _, _, (alloc, _, alloc_block), block in cases:
        if block is None or alloc_block is None:
            return None
        (step, phase, _), event = alloc
        found.add(((step, phase, event), block - alloc_block))
    return ("block", *found.pop()) if len(found) == 1 else None


def _origin_rule(cases):
    """Where no rank agrees: ("copy", origin, d), every case frees the block that the event of
    that origin in an inserted chunk allocated, in the copy d after the free's own; or ("at",
    origin, step), the block a plain segment's event allocated, at a run index moved by ``step``
    per copy of the free; else None."""
    allocs = [(copy or 0, alloc, alloc_copy) for _, copy, (alloc, alloc_copy) in cases]
    if all(alloc_copy is not None for _, _, alloc_copy in allocs):
        origins = {alloc for _, alloc, _ in allocs}
        deltas = {alloc_copy - copy for copy, _, alloc_copy in allocs}
        if len(origins) == 1 and len(deltas) == 1:
            return ("copy", origins.pop(), deltas.pop())
        return None
    steps, base = set(), None
    for copy, alloc, alloc_copy in allocs:
        if alloc_copy is not None or len(alloc) != 2:
            return None
        key, where = alloc
        if not (isinstance(where, tuple) and where[0] == "a" and len(where) == 3):
            return None
        if base is None:
            base = (key, where, copy)
            continue
        if key != base[0] or where[2] != base[1][2]:
            return None
        if copy == base[2]:
            if where != base[1]:
                return None
            continue
        step, rest = divmod(where[1] - base[1][1], copy - base[2])
        if rest:
            return None
        steps.add(step)
    if base is None or len(steps) > 1:
        return None
    step = steps.pop() if steps else 0
    key, where, copy = base
    return ("at", (key, ("a", where[1] - step * copy, where[2])), step)


def _ranks(trace):
    """Per event: (rank from the newest, rank from the oldest) of a freed block among the live
    blocks of its size; None for other events."""
    live, sizes, out = collections.defaultdict(list), {}, []
    for event in trace:
        if event[0] == "m":
            sizes[event[1]] = event[2]
            live[event[2]].append(event[1])
            out.append(None)
        elif event[0] == "f":
            pool = live[sizes[event[1]]]
            k = pool.index(event[1])
            out.append((len(pool) - 1 - k, k))
            pool.pop(k)
        else:
            out.append(None)
    return out


__all__ = ["NotSynthesizable", "tensor_peaks", "ReplayedTrial", "Synthesis", "TraceMarks", "normalize", "replay_peak",
           "replay_trial", "segments", "tokens"]
