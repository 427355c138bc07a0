"""``--tp/--cp/--pp auto``: which tensor/context/pipeline splits of the world are candidates, how
much each communicates, the order they are estimated in, which need no estimate, and which one
the plan takes. Pure: the planner (``autotune.orchestration.layout_search``) plans each candidate
it is handed and reports back.

Candidates: every tp × cp × pp dividing the world size, tp × cp inside one host (a divisor of
``gpus_per_node`` where it is known), tp dividing the attention and key/value heads (no heads
known: tp stays 1), the pipeline's stages no more than the repeated blocks, and cp only where
the plan has a sequence length that divides into 2 × cp chunks (the causal load balancing of
torch's context parallel gives each rank two chunks).

Order and stops (never hundreds of estimates): the least split first (tp × cp × pp ascending:
data parallelism alone, today's plan, then splits over 2 ranks, 4, ...; each doubling roughly
halves what a rank holds of the model and its activations, and adds per-block traffic or a
bubble), the cheapest communication first among equally split ones. A candidate needs no estimate where one with at least its every degree fitted nowhere:
with the world fixed, more tp, cp or pp never holds more per rank (parameters, gradients and
optimizer state divide over tp × pp, FSDP's over the data-parallel ranks too; activations over
tp × cp with sequence parallel; a 1F1B stage holds at most pp micro-batches of 1/pp of the
blocks, no more than one micro-batch of all of them). After the first candidate that fits
nowhere, the most split candidate (no pipeline deeper than ``JUMP_MAX_PP``) is estimated next, so
one estimate can rule out everything it dominates (ranked by throughput: only before any layout
has fitted, patience ending that search sooner than the jump's screen would, and then screened
only, a candidate that fits being planned in its place; or, where none has fitted yet and every candidate left can be screened within
``MAX_SCREENED``, the most split go first from then on, each ruling out what it dominates, and
patience stops nothing), and the planner screens each later candidate with one estimate of its
least memory (micro-batch 1, every block checkpointed) before searching it. Once a candidate has planned N
accumulation steps, ranked by steps, the planner screens each later one at the micro-batch that
N steps of its share need (N - 1 where with N steps it would lose the tie: a larger bubble or
more communication, ``steps_to_win``): one that does not fit there cannot win (``beaten``), and
costs one estimate instead of a search; where that micro-batch is 1, one that does not fit there
fits nowhere (and rules out what it dominates). The search stops at one accumulation step (nothing later has fewer steps, and it
communicates more), after ``PATIENCE`` estimates in a row that fit without cutting steps, or
after ``MAX_ESTIMATED`` planned or ``MAX_SCREENED`` screened layouts; ``plan.reasons["layout"]``
says which.

The choice: the fewest accumulation steps, then the smallest pipeline bubble
(``autotune.timing.layout.pipeline_bubble``: a pipeline idles while it fills and drains, which
fewer steps make worse), then the least communication per rank and optimizer step
(``communication_bytes``), then the earlier candidate; with a throughput model's prediction
(``--gpu --optimize throughput``), the most samples per second per GPU. Ranked so, a candidate
after the fastest so far is planned only where it could beat it: the planner bounds its samples/s
from data parallelism's counted step (``autotune.timing.bound``) and screens the least memory of
the splits that could win (``LayoutOutcome.beaten`` of 1 where none fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..distributed.layout import Layout, parse_layout
from ..errors import ConfigError, given
from ..timing.layout import pipeline_bubble
from ..units import format_bytes
from ..workload.model_shape import ModelShape

AUTO = "auto"
MAX_ESTIMATED = 8
"""Layouts the search plans at most (each a planner's search on fake tensors)."""
MAX_SCREENED = 24
"""Layouts the search answers at most with one screening estimate each (``LayoutOutcome.screened``:
a tenth of a planner's search or less), besides the ``MAX_ESTIMATED`` it plans."""
PATIENCE = 2
"""Estimated layouts in a row that fit without fewer accumulation steps than the best so far,
after which the search stops: later candidates communicate more."""
JUMP_MAX_PP = 8
"""The deepest pipeline the search estimates out of order (after the first layout that fits
nowhere, to rule out all it dominates). A pipeline's estimate runs a window of pp micro-batches
on each pipeline rank it estimates, on the stage's full build (never few blocks): for 405B on 512
GPUs the most split candidate, cp 8 × pp 64, took 30-64 CPU s per rank (2026-12-04), more than
the whole search of the layouts it could rule out."""


def is_auto(value) -> bool:
    return isinstance(value, str) and value.lower() == AUTO


def layout_candidates(world_size: int, *, tp=1, cp=1, pp=1, pp_schedule=None, stages_per_rank=None,
                      shape: ModelShape, gpus_per_node: int | None = None,
                      seq_len: int | None = None) -> tuple[list[Layout], list[str]]:
    """The layouts to search (each degree "auto" or a fixed int), and notes on degrees that stay
    1 (and why). Fixed degrees are taken as given (their checks are the plan's)."""
    notes = []

    def degrees(name, value, fits: Callable[[int], bool], why_none: str | None) -> list[int]:
        if not is_auto(value):
            return [value]
        if why_none is not None:
            notes.append(f"{name} stays 1: {why_none}")
            return [1]
        found = [d for d in _divisors(world_size) if d == 1 or fits(d)]
        if found == [1] and world_size > 1:
            notes.append(f"{name} stays 1: no degree above 1 divides the world size and fits "
                         f"{limits[name]}")
        return found

    host = (lambda d: gpus_per_node % d == 0) if gpus_per_node else (lambda d: True)
    inside = f", inside a host of {gpus_per_node} GPUs" if gpus_per_node else ""
    limits = {"tp": f"the model's {shape.heads} attention and {shape.kv_heads} key/value heads{inside}",
              "cp": f"sequence length {seq_len} (2 × cp chunks){inside}",
              "pp": f"the model's {shape.blocks} repeated blocks"}
    tps = degrees("tp", tp, lambda d: shape.heads % d == 0 and (shape.kv_heads or shape.heads) % d == 0
                  and host(d),
                  None if shape.heads else "the model names no attention heads (no config."
                                           "num_attention_heads, no attention module with num_heads)")
    cps = degrees("cp", cp, lambda d: seq_len % (2 * d) == 0 and host(d),
                  None if seq_len else "the plan has no sequence length (plan with --seq-len N or "
                                       "--target-tokens, and make_batch(batch_size, seq_len))")
    schedule = parse_layout(pp=2, pp_schedule=pp_schedule, stages_per_rank=stages_per_rank)
    pps = degrees("pp", pp, lambda d: d * schedule.stages_per_rank <= shape.blocks,
                  None if shape.blocks >= 2 * schedule.stages_per_rank
                  else f"the model has {shape.blocks} repeated block(s), fewer than two stages need")
    found = []
    for t in tps:
        for c in cps:
            for p in pps:
                if world_size % (t * c * p) or (gpus_per_node and gpus_per_node % (t * c)):
                    continue
                piped = dict(pp_schedule=pp_schedule, stages_per_rank=stages_per_rank) if p > 1 else {}
                found.append(parse_layout(tp=t, cp=c, pp=p, **piped))
    if not found:
        raise ConfigError(f"no tensor/context/pipeline split of {given('world_size', world_size)} "
                          f"fits the degrees asked for ({given('tp', tp)}, {given('cp', cp)}, "
                          f"{given('pp', pp)}) with {given('gpus_per_node', gpus_per_node)}")
    return found, notes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def communication_bytes(layout: Layout, world_size: int, *, shape: ModelShape, seq_len: int | None,
                        share: int, param_bytes: int, activation_bytes: int = 2,
                        sharded: bool = True, steps: int = 1) -> float:
    """Bytes one rank sends per optimizer step under ``layout``, from the model's shapes; a ring
    collective over g ranks moves (g − 1)/g of the whole tensor per rank. ``share``: samples per
    data-parallel rank and step; ``param_bytes``: the trainable parameters' bytes (gradients are
    reduced at that size); ``activation_bytes``: bytes per activation element (2 for bf16).

    - Tensor parallel with sequence parallel: per block and micro-batch, 4 all-gathers or
      reduce-scatters of the b × s × h activation in forward and 4 in backward (Korthikanti et
      al., "Reducing Activation Recomputation in Large Transformer Models", 2022, §4.2.2), over
      the tokens this rank's context shard holds.
    - Context parallel: per block, K and V all-gathered around the ring in forward, again in
      backward with their gradients reduce-scattered (3 × 2 × s × h_kv, of which tp holds 1/tp).
    - Pipeline parallel: each stage boundary sends the activation forward and its gradient back,
      once per stage a rank holds (the tensor sharded over tp × cp).
    - Data parallel over d ranks: DDP all-reduces the rank's gradients (2 (d − 1)/d × its share
      of the parameters, 1/(tp × pp) of them); FSDP2 all-gathers them in forward and backward of
      every micro-step and reduce-scatters the gradients (3 (d − 1)/d per micro-step), over
      d × cp ranks (context-parallel ranks shard and reduce with the data-parallel ones).

    Bytes within a host (NVLink) and between hosts count alike: a tie-break between layouts that
    need as many accumulation steps, not a time (``autotune.timing.layout`` is one)."""
    dp = layout.data_parallel(world_size)
    tokens = share * (seq_len or 1)  # this data-parallel rank's tokens per optimizer step
    hidden = shape.hidden or 0
    stage_blocks = shape.blocks / layout.pp if shape.blocks else 0
    ring = lambda g: (g - 1) / g  # noqa: E731 - the one formula, named where it is used
    total = 0.0
    if layout.tp > 1:
        total += 8 * stage_blocks * (tokens / layout.cp) * hidden * activation_bytes * ring(layout.tp)
    if layout.cp > 1:
        total += 6 * stage_blocks * tokens * ((shape.kv_hidden or 0) / layout.tp) * activation_bytes \
            * ring(layout.cp)
    if layout.pp > 1:
        total += 2 * layout.stages_per_rank * tokens * hidden * activation_bytes / (layout.tp * layout.cp)
    group = dp * layout.cp if sharded else dp  # FSDP2 shards over the context-parallel ranks too
    if group > 1:
        held = param_bytes / (layout.tp * layout.pp)
        total += (3 * steps if sharded else 2) * ring(group) * held
    return total


@dataclass
class LayoutOutcome:
    """What planning one candidate layout gave."""

    layout: Layout
    steps: int | None = None
    """Accumulation steps of its plan (None: nothing fits, or not estimated)."""
    communication: float = 0.0
    """Bytes per rank and optimizer step (``communication_bytes``)."""
    peak_bytes: int | None = None
    """Its plan's predicted per-rank peak."""
    label: str = ""
    """The layout as the plan names it ("FSDP 4 × TP 2")."""
    samples_per_s: float | None = None
    """Predicted samples per second per GPU (throughput ranking only)."""
    error: str | None = None
    """Why it has no plan: fits nowhere, not available, or why it was not estimated."""
    estimated: bool = True
    """False: no estimate ran (dominated by one that fits nowhere, or the search had stopped)."""
    fits_nowhere: bool = False
    """A memory verdict: no micro-batch fits in any sharding (what ``dominated`` prunes by)."""
    beaten: int | None = None
    """The accumulation steps from which on a layout planned before it wins, where a screen
    showed it cannot go below them (it may fit, with more steps: no plan, and it rules out
    nothing)."""
    screened: bool = False
    """Answered by one screening estimate, not a planner's search (counted apart: ``MAX_SCREENED``)."""
    unavailable: str | None = None
    """The degree ("tp", "cp", "pp") this build cannot estimate, or the model cannot take, where
    that stopped it: every candidate with that degree above 1 is answered alike without an
    estimate."""
    unavailable_scope: str = "in this build"
    """Where the degree is not available: "in this build", or "for this model"."""
    plan: object = None

    @property
    def name(self) -> str:
        return self.label or (self.layout.describe_degrees() if not self.layout.trivial else "data parallel")


def dominates(big: Layout, small: Layout) -> bool:
    """Every degree of ``big`` at least ``small``'s: a rank of ``big`` holds no more."""
    return big.tp >= small.tp and big.cp >= small.cp and big.pp >= small.pp


def search_layouts(candidates: list[Layout], evaluate: Callable[[Layout], LayoutOutcome], *,
                   cost: Callable[[Layout], float], rank_by_time: bool = False,
                   max_estimated: int = MAX_ESTIMATED, patience: int = PATIENCE,
                   max_screened: int = MAX_SCREENED) -> list[LayoutOutcome]:
    """Every candidate's outcome, least split first, then cheapest (see the module's docstring;
    the order they were considered in may differ): ``evaluate`` plans one, or with
    ``screen_only=True`` (ranked by throughput, the most split candidate estimated out of order)
    only screens it at micro-batch 1 (fits nowhere, or not: planned when its turn comes);
    ``cost`` orders them (communication at one step)."""
    pending = sorted(candidates, key=lambda lay: (lay.model_parallel, cost(lay)))
    rank = {lay: i for i, lay in enumerate(pending)}
    done: list[LayoutOutcome] = []
    stop: str | None = None
    best_steps, since_better, estimated, screened = None, 0, 0, 0
    jumped: Layout | None = None
    jump_screened = False
    most_split_first = False
    while pending:
        layout = pending.pop(0)
        blocker = next((o for o in done if o.fits_nowhere and dominates(o.layout, layout)), None)
        if blocker is not None:
            done.append(LayoutOutcome(layout, estimated=False, fits_nowhere=True, error=(
                f"fits nowhere, not estimated: a rank holds no less than under {blocker.name}, "
                f"which fits nowhere")))
            continue
        lacking = next((o for o in done if o.unavailable and getattr(layout, o.unavailable) > 1), None)
        if lacking is not None:
            done.append(LayoutOutcome(layout, estimated=False, error=(
                f"not estimated: {lacking.unavailable} > 1 is not available {lacking.unavailable_scope} "
                f"({lacking.name} showed it)")))
            continue
        if stop is None:
            if not rank_by_time and best_steps == 1:
                stop = ("one accumulation step was reached: nothing has fewer, and the layouts "
                        "left add per-block communication or a bubble")
            elif best_steps is not None and since_better >= patience and not most_split_first:
                stop = (f"{patience} layout(s) in a row fitted without fewer accumulation steps "
                        f"(later ones communicate more)")
            elif estimated >= max_estimated:
                stop = f"the search estimates at most {max_estimated} layouts"
            elif screened >= max_screened:
                stop = f"the search screens at most {max_screened} layouts"
        if stop is not None:
            done.append(LayoutOutcome(layout, estimated=False, error=f"not estimated: {stop}"))
            continue
        if rank_by_time and layout is jumped and not jump_screened:
            # Out of order only to rule out what it dominates: its screen (micro-batch 1) says
            # whether it does. Where it fits, it goes back to its place: ranked by throughput a
            # layout that fits is planned whole, and the most split one, a deep pipeline, is the
            # dearest to plan (70B on 256: FSDP 4 × CP 8 × PP 8's windows of 32 to 128
            # micro-batches on 8 pipeline ranks ran past 30 CPU minutes).
            jump_screened = True
            outcome = evaluate(layout, screen_only=True)
            if not outcome.fits_nowhere:
                screened += 1
                pending = sorted([*pending, layout], key=rank.__getitem__)
                continue
        else:
            outcome = evaluate(layout)
        # What the cap counts: memory answers. A split this build refuses fails at the build.
        answered = outcome.steps is not None or outcome.fits_nowhere or outcome.beaten is not None
        screened += answered and outcome.screened
        estimated += answered and not outcome.screened
        done.append(outcome)
        if outcome.beaten is not None:  # as one that fitted without fewer steps
            since_better += layout is not jumped
        elif outcome.steps is not None:
            improved = best_steps is None or outcome.steps < best_steps
            best_steps = outcome.steps if improved else best_steps
            # The most split candidate ran out of order: it says nothing about the ones next.
            since_better = 0 if improved else since_better + (layout is not jumped)
        elif outcome.fits_nowhere and not most_split_first and pending:
            if best_steps is None and len(pending) <= max_screened - screened:
                # Nothing has fitted yet, and every candidate left gets an answer within the
                # screening cap, whatever the order: the most split first, so that each one that
                # fits nowhere rules out all it dominates before they are screened (8B at
                # sequence 131072 on 8 GPUs screened cp 2, tp 2, cp 4, tp 2 × cp 2 and tp 4 one
                # by one before tp 2 × cp 4 and tp 4 × cp 2, which rule them all out). Patience
                # no longer stops the search: the candidates after a fitting one communicate
                # less, and may need fewer steps.
                most_split_first = True
                pending.sort(key=lambda c: (-c.model_parallel, cost(c)))
            elif jumped is None and not (rank_by_time and best_steps is not None):
                # The first that fits nowhere: the most split candidate next (the cheapest of
                # those no other dominates), so that one estimate can rule out all it dominates;
                # no pipeline deeper than JUMP_MAX_PP (its estimate costs more than the screens
                # it could save). Not where throughput ranks and a layout fitted already: patience
                # ends that search within a few more estimates, and the jump's screen costs more
                # than they do (70B on 256: FSDP 4 × CP 8 × PP 8's screen took 274 CPU s, tp 2's
                # and cp 2's whole plans 39 and 33, pp 2's, which fitted nowhere, 19).
                shallow = [c for c in pending if c.pp <= JUMP_MAX_PP]
                jumped = max((c for c in shallow if not any(dominates(o, c) and o != c for o in shallow)),
                             key=lambda c: (c.model_parallel, -cost(c)), default=None)
                if jumped is not None:
                    pending = [jumped] + [c for c in pending if c is not jumped]
    # In the order of the candidates (least split, then cheapest, first), whatever the order they
    # were considered in: the choice's last tie-break and the reason's list read it.
    return sorted(done, key=lambda o: rank[o.layout])


def choice_key(outcome: LayoutOutcome) -> tuple:
    """What ``choose_layout`` minimises among planned layouts ranked by steps (then the earlier)."""
    return outcome.steps, _bubble(outcome), outcome.communication


def steps_to_win(layout: Layout, leader: LayoutOutcome, communication_at: Callable[[int], float]
                 ) -> tuple[int, str]:
    """The most accumulation steps with which ``layout``, considered after ``leader``, could be
    chosen over it, and why no more: ``leader``'s steps where at as many ``layout`` would idle
    less in its bubble or communicate less (``communication_at(steps)``), one fewer where not."""
    steps = leader.steps
    tie = (pipeline_bubble(layout, steps), communication_at(steps))
    if tie < (_bubble(leader), leader.communication):
        return steps, f"more than {_steps(steps)} (those of {leader.name})"
    worse = ("its bubble" if tie[0] > _bubble(leader) else
             f"its communication ({_gb(tie[1])} per rank and step against {_gb(leader.communication)})")
    return steps - 1, (f"{_steps(steps)} or more, where {worse} loses to {leader.name}'s "
                       f"{_steps(steps)}")


def choose_layout(outcomes: list[LayoutOutcome], *, rank_by_time: bool = False) -> tuple[LayoutOutcome, str]:
    """The winner among ``outcomes`` with a plan, and ``plan.reasons["layout"]``; a ConfigError
    naming every layout's answer where none has a plan."""
    fitting = [(i, o) for i, o in enumerate(outcomes) if o.steps is not None]
    if not fitting:
        raise ConfigError("no layout fits: " + _tried_words(outcomes))
    if rank_by_time and all(o.samples_per_s is not None for _, o in fitting):
        i, winner = max(fitting, key=lambda p: (p[1].samples_per_s, -p[0]))
        runner = max((p for p in fitting if p[0] != i), key=lambda p: p[1].samples_per_s, default=None)
        why = f"the most samples/s per GPU predicted ({winner.samples_per_s:.4g})"
        if runner is not None:
            why += f"; next {runner[1].name} at {runner[1].samples_per_s:.4g}"
    else:
        i, winner = min(fitting, key=lambda p: (*choice_key(p[1]), p[0]))
        fewest = [o for _, o in fitting if o.steps == winner.steps]
        why = f"{_steps(winner.steps)}, the fewest of the layouts that fit"
        if len(fewest) > 1:
            runner = min((o for o in fewest if o is not winner), key=lambda o: (_bubble(o), o.communication))
            if _bubble(runner) > _bubble(winner):
                why += (f"; of the {len(fewest)} with {_steps(winner.steps)}, the smallest pipeline "
                        f"bubble ({_bubble(winner):.0%} of the step against {runner.name}'s "
                        f"{_bubble(runner):.0%})")
            else:
                why += (f"; the least communication of the {len(fewest)} with {_steps(winner.steps)} "
                        f"({_gb(winner.communication)} per rank and step against {runner.name}'s "
                        f"{_gb(runner.communication)})")
    return winner, (f"auto: {winner.name}: {why}. Layouts considered (least split first, "
                    f"then cheapest communication): {_tried_words(outcomes)}")


def _bubble(outcome: LayoutOutcome) -> float:
    return pipeline_bubble(outcome.layout, outcome.steps or 1)


def _tried_words(outcomes: list[LayoutOutcome]) -> str:
    parts, skipped = [], {}
    for o in outcomes:
        if not o.estimated:
            skipped.setdefault(o.error, []).append(o.name)
        elif o.steps is not None:
            speed = f", {o.samples_per_s:.4g} samples/s per GPU" if o.samples_per_s is not None else ""
            bubble = f", bubble {_bubble(o):.0%}" if o.layout.pp > 1 else ""
            peak = f", peak {_gb(o.peak_bytes)}" if o.peak_bytes is not None else ""
            parts.append(f"{o.name} ({_steps(o.steps)}{peak}, {_gb(o.communication)} communicated per "
                         f"rank and step{bubble}{speed})")
        else:
            parts.append(f"{o.name} ({o.error or 'fits nowhere'})")
    parts += [f"{', '.join(names)} ({error})" for error, names in skipped.items()]
    return "; ".join(parts)


def _steps(n: int) -> str:
    return "1 accumulation step" if n == 1 else f"{n} accumulation steps"


def _gb(value: float) -> str:
    return format_bytes(int(value))


__all__ = ["AUTO", "LayoutOutcome", "MAX_ESTIMATED", "MAX_SCREENED", "PATIENCE", "choice_key", "choose_layout",
           "communication_bytes", "dominates", "is_auto", "layout_candidates", "search_layouts",
           "steps_to_win"]
