"""``plan(tp="auto", cp=..., pp=...)``: plan each candidate layout the search policy hands out
(``autotune.planning.layouts``) as ``plan()`` plans a fixed one, and keep the one it chooses.

Each candidate is a full planner run (the sharding and checkpointing search of that layout, on
fake tensors for a sharded or model-parallel step), sharing one inspection of the model. A
candidate whose split this build cannot estimate ("not available") is recorded as such and the
search goes on; one that fits nowhere rules out every layout it dominates. Ranked by predicted
throughput, a candidate is planned whole only where a bound of its samples/s per GPU
(``timing.bound``, from data parallelism's counted step, then from its own counted at
micro-batches 1 and 2) and a screen of its least memory there leave it a chance against the
fastest so far (``_cannot_win``).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from ..distributed.layout import Layout
from ..errors import (ConfigError, EstimateUnavailable, LayoutUnsupported, PlanError, WorkloadError, given,
                      option)
from ..distributed.sharding.settings import Sharding
from ..planning.layouts import (LayoutOutcome, choice_key, choose_layout, communication_bytes,
                                layout_candidates, search_layouts, steps_to_win)
from ..planning.policy import split_for
from ..planning.types import Plan
from ..precision import Precision
from ..probing.api import window_trial
from ..probing.fresh_trials import remembered_trials
from ..probing.share import window_steps
from ..timing.bound import fastest_possible
from ..timing.comm import network_from_profile
from ..timing.window import tokens_per_sample
from ..units import format_bytes
from .eval_batch import plan_eval_batch
from .predicted import details_upper, own_bounds, own_steps, reference_steps


def search_layout(workload, options, degrees: dict, *, make_planner, inspected, screen=None) -> Plan:
    """The plan of the layout chosen among ``degrees``' candidates (tp/cp/pp, each "auto" or an
    int, and pp_schedule/stages_per_rank); ``make_planner(workload, options, inspected=)`` is
    ``plan()``'s planner, ``inspected`` the model's (fingerprint, ModelShape); ``screen``
    (default ``_screen``) says why a layout does not fit at a micro-batch (1: fits nowhere), or
    None."""
    screen = screen or _screen
    if options.optimize == "throughput" and options.gpu is None:
        raise ConfigError(f"{given('optimize', 'throughput')} measures replicas on this device, not "
                          f"the layouts {given('tp', degrees['tp'])}, {given('cp', degrees['cp'])}, "
                          f"{given('pp', degrees['pp'])} would search; add {option('gpu')} (ranked by "
                          f"predicted step time) or plan with {given('optimize', 'memory')}")
    fingerprint, shape = inspected
    first = make_planner(workload, dataclasses.replace(options, eval_batch=False), inspected=inspected)
    # Host offload is data parallel's last resort where no layout fits on the device (below): a
    # model-parallel layout that does avoids the host traffic and CPU optimizer step, and the
    # offload's probes cost 405B's plan 19 CPU s.
    first.offload_last_resort = False
    # The chosen layout's details (smaller shard groups, the sync-on-last window) wait for the
    # choice where the planner's memo answers the trials it ran (a --gpu estimate's). Ranked by
    # throughput they can change the choice: data parallelism's are planned after it where
    # they could pass the winner (``details_upper``; 70B's shard groups cost 57 CPU s before it).
    rank_by_time = options.optimize == "throughput" and options.gpu is not None
    deferred = first.memoized
    first.search_details = not deferred
    gpus_per_node = options.gpus_per_node or (first.target.profile.gpus_per_node if first.target else None)
    world = first.world_size
    candidates, notes = layout_candidates(world, shape=shape, gpus_per_node=gpus_per_node,
                                          seq_len=workload.seq_len, **degrees)
    activation_bytes = 4 if Precision.parse(first.chosen) is Precision.FP32 else 2
    # Data parallel's FSDP settings too (where its planner may take them; where throughput ranks,
    # the search without checkpointing still runs, below what every block reached).
    first.sharded_every_block_first = True
    planners = {Layout(): first}

    def volume(layout: Layout, share: int, *, sharded: bool, steps: int = 1) -> float:
        return communication_bytes(layout, world, shape=shape, seq_len=workload.seq_len, share=share,
                                   param_bytes=fingerprint.param_bytes, activation_bytes=activation_bytes,
                                   sharded=sharded, steps=steps)

    def cost(layout: Layout) -> float:
        return volume(layout, max(1, options.target_batch // layout.data_parallel(world)),
                      sharded=options.sharding != "ddp")

    screening = []  # set once a layout fits nowhere: cheaper splits may not either
    leader: list[LayoutOutcome] = []  # the planned layout the choice would take so far
    fastest: list[LayoutOutcome] = []  # ranked by throughput: the planned layout predicted fastest
    # Ranked by steps, a candidate only matters if it can reach as few: one estimate at the
    # micro-batch that takes tells, where a planner's search would run many. Not where the
    # planner may take another precision than the one screened (auto on the CPU), a pinned
    # micro-batch sets the steps, or throughput ranks. (A token target is a sample target by
    # now: plan() resolved it before the search.)
    beat_screen = (not rank_by_time and options.micro_batch is None
                   and (first.target is not None or options.precision != "auto"))

    def evaluate(layout: Layout, screen_only: bool = False) -> LayoutOutcome:
        # autotune's loop trains model-parallel layouts over FSDP2 only, sharded across every
        # data-parallel rank as the published layouts are: no replica or shard-group search.
        # screen_only: its screen at micro-batch 1 alone (search_layouts' jump ranked by time).
        sharding = "fsdp" if options.sharding == "auto" and not layout.trivial else options.sharding
        try:
            planner = planners.get(layout) or make_planner(
                workload, dataclasses.replace(options, parallel=layout, eval_batch=False, sharding=sharding),
                inspected=inspected)
        except (ConfigError, PlanError) as exc:  # the layout's own limits (shard group, target)
            return LayoutOutcome(layout, error=f"not planned: {exc}")
        planners[layout] = planner
        # Ranked by time, a model-parallel layout's sync-on-last window (its only detail: no
        # shard groups) waits until it could lead (below): 8B's CP 2, planned and beaten, ran it.
        late_details = rank_by_time and planner.memoized and not layout.trivial
        planner.search_details = not deferred and not late_details
        try:
            short = None  # set where a screen at micro-batch 1 ran out: the layout fits nowhere
            screened = unscreened = False
            if rank_by_time and fastest and not layout.trivial and not screen_only:
                # Ranked by throughput, a layout is planned whole where a bound from data
                # parallelism's counted step leaves it a chance against the fastest so far.
                lost = _cannot_win(workload, planner, layout, fastest[0], planners.get(Layout()),
                                   checkpointable=fingerprint.checkpointable, sharding=sharding,
                                   screen=screen)
                unscreened = lost is _UNSCREENED  # its planner's probe says what fits
                if unscreened:
                    lost = None
                if lost is not None:
                    if lost.fits_nowhere:
                        screening.append(layout)
                    return lost
            if beat_screen and leader and not layout.trivial:
                # steps >= 1 here: a leader of 1 step ends the search (search_layouts).
                share = planner.request.share
                steps, why = steps_to_win(layout, leader[0], lambda steps: volume(
                    layout, share, sharded=Sharding.parse(sharding).sharded, steps=steps))
                needed = -(-share // steps)
                short = screen(workload, planner, layout, fingerprint.checkpointable, micro_batch=needed)
                screened = True
                # Where even micro-batch 1 does not fit, the layout fits nowhere, and neither does
                # any it dominates (below; 8B at sequence 131072 after CP 8's 8 steps: tp 2 x cp
                # 4's planner tried 8 micro-batches that ran out of memory, 47 CPU s).
                if short is not None and needed > 1:
                    return LayoutOutcome(layout, beaten=steps + 1, screened=True, error=(
                        f"{why}: its share of {share} samples in {_steps_words(steps)} needs "
                        f"micro-batch {needed}; {short}"))
            elif (screening or screen_only) and not layout.trivial and not unscreened:
                short = screen(workload, planner, layout, fingerprint.checkpointable)
                screened = True
            if short is None and screen_only:
                return LayoutOutcome(layout, screened=True, error="fits at micro-batch 1 (screened)")
            if short is not None:
                screening.append(layout)
                return _fits_nowhere(layout, short)
            # A screen that fitted ran every block checkpointed: the planner starts there. Ranked
            # by throughput, a model-parallel layout starts there too, unless data parallelism's
            # trials say it likely fits its whole share without checkpointing (one probe answers
            # then): its search without checkpointing runs below the micro-batch every block
            # reached, where it can fit, not from the share down (405B's TP 2 tried micro-batches
            # 4, 2 and 1 without it, its TP 4 8 and 1, where every block reached 2: 7.3 and 2.5
            # CPU s, 2.7 and 0.2 now). Not data parallelism's replicas, whose search of fewer
            # blocks checkpointed needs none probed first.
            # Where its search without checkpointing runs below every block's answer, it
            # starts at data parallelism's guess (read then: that planner's trials so far).
            planner.likely_without_checkpointing = functools.partial(
                _likely_without_checkpointing, planners.get(Layout()), layout, planner.usable)
            planner.every_block_first = screened or (
                rank_by_time and not layout.trivial and not _likely_fits_without_checkpointing(
                    planners.get(Layout()), layout, planner.usable, planner.request.wanted_micro_batch))
            planned = planner.run()
            if late_details and _could_lead(planner, fastest):
                # The same planner again, its memo and counts answering what it ran: what it
                # adds is the sync-on-last window, which may take the lead. A layout that could
                # not lead even with it keeps its plan (gradients reduce-scattered every
                # micro-step: fits, and what its probe proved) and its prediction.
                planner.search_details = True
                planned = planner.run()
        except PlanError as exc:
            screening.append(layout)
            return LayoutOutcome(layout, error=_first_sentence(exc), fits_nowhere=True)
        except (ConfigError, EstimateUnavailable) as exc:  # e.g. a split this build lacks
            lacking = re.match(r"(tp|cp|pp) \d+: \w+ parallelism is not available", str(exc))
            return LayoutOutcome(layout, error=f"not estimated: {_first_sentence(exc)}",
                                 unavailable=lacking.group(1) if lacking else None)
        except WorkloadError as exc:
            # A degree the model cannot take (a pipeline over tied weights): where the search
            # chose it, every candidate with it is answered alike and the others are planned;
            # where the user asked for it, the model's error is the answer.
            unsupported = _unsupported(exc)
            if unsupported is None or degrees.get(unsupported.degree) != "auto":
                raise
            return LayoutOutcome(layout, error=f"not estimated: {_first_sentence(unsupported)}",
                                 unavailable=unsupported.degree, unavailable_scope="for this model")
        outcome = planned_outcome(layout, planned)
        leader[:] = [min(leader + [outcome], key=choice_key)]  # the earlier one on a tie
        if outcome.samples_per_s is not None:
            fastest[:] = [max(fastest + [outcome], key=lambda o: o.samples_per_s)]
        return outcome

    def planned_outcome(layout: Layout, planned: Plan) -> LayoutOutcome:
        label = planned.parallel.describe(world, str(planned.sharding).upper())
        if planned.shard_group and planned.shard_group != layout.data_parallel(world):
            label += f" (shard group {planned.shard_group})"
        # The planner's prediction holds the layout's collectives and bubble, per GPU.
        timed = planned.step_time.samples_per_s if rank_by_time and planned.step_time is not None else None
        return LayoutOutcome(layout, steps=planned.accumulation_steps, label=label, plan=planned,
                             communication=volume(layout, sum(planned.micro_batches),
                                                  sharded=planned.sharding.sharded,
                                                  steps=planned.accumulation_steps),
                             peak_bytes=planned.predicted_peak_bytes, samples_per_s=timed)

    outcomes = search_layouts(candidates, evaluate, cost=cost, rank_by_time=rank_by_time)
    if not any(o.steps is not None for o in outcomes):
        # Nothing fits on the device: data parallel again, host offload allowed (the planner's
        # memo answers the trials it ran before).
        first.offload_last_resort = True
        outcomes = [evaluate(o.layout) if o.layout == Layout() else o for o in outcomes]
    winner, reason = choose_layout(outcomes, rank_by_time=rank_by_time)

    def in_detail(outcome: LayoutOutcome) -> None:
        # The same planner again, its memo answering every trial it ran: what it adds is the
        # deferred search. The steps and bytes communicated it ranked by stay as they were.
        nonlocal outcomes, winner, reason
        planner = planners[outcome.layout]
        planner.search_details = True
        detailed = planned_outcome(outcome.layout, planner.run())
        outcomes = [detailed if o is outcome else o for o in outcomes]
        winner, reason = choose_layout(outcomes, rank_by_time=rank_by_time)

    if deferred and rank_by_time and winner.plan is not None and winner.layout != Layout():
        replicas = next((o for o in outcomes if o.layout == Layout() and o.plan is not None), None)
        if replicas is not None and details_upper(first) > (winner.samples_per_s or 0.0):
            in_detail(replicas)
    if deferred and winner.plan is not None and not planners[winner.layout].search_details:
        in_detail(winner)
    planned: Plan = winner.plan
    planned.reasons["layout"] = reason + "".join(f"; {note}" for note in notes)
    if options.eval_batch:
        planner = planners[winner.layout]
        planned = plan_eval_batch(planned, planner.workload, planner.backend, usable=planner.usable,
                                  extra=planner.extra, upper=options.max_eval_batch, agree=planner.agree)
    return planned


def _could_lead(planner, fastest: list[LayoutOutcome]) -> bool:
    """Whether the plan ``planner`` just made, with the sync-on-last window it did not estimate,
    could pass the fastest layout planned so far (first planned: it leads)."""
    upper = getattr(planner, "sync_on_last_upper", None)
    return not fastest or upper is None or upper > fastest[0].samples_per_s


_UNSCREENED = object()
"""``_cannot_win``'s answer for a layout to plan whole without a screen first."""


def _cannot_win(workload, planner, layout: Layout, leader: LayoutOutcome, reference, *,
                checkpointable: bool, sharding: str, screen) -> LayoutOutcome | object | None:
    """``layout``'s outcome where it cannot beat ``leader``'s predicted samples/s per GPU
    without a planner's search; None where it might (it is planned whole then).

    For each checkpointing setting its planner would rank, ``timing.bound`` gives the most
    samples/s each of its splits could reach, from data parallelism's counted steps
    (``reference``'s planner: its ranked settings', or where it fitted nowhere its step counted
    anyway, ``predicted.reference_steps``): splits that cannot pass the leader need nothing more; for those
    that could, one screen at the smallest micro-batch among them (the least memory any of them
    needs; a pipeline's at a window of pp micro-batches, less than its own) says whether any fits.
    Where one does, the layout's own step, counted at micro-batches 1 and 2 for that setting
    (``predicted.own_steps``, kept for its planner), bounds those splits again
    (``predicted.own_bounds``), and a screen at the smallest that still could win decides; a
    setting that holds less than one a screen saw fit there is counted without that first screen,
    and so is the least memory where a screen would be at micro-batch 1: still winning there after
    its count, the layout is planned whole unscreened (``_UNSCREENED``). Every block checkpointed
    is bounded first by the step counted without checkpointing, with data parallelism's recompute
    over tp × cp (``timing.bound.RecomputedFloorSteps``). A pipeline whose least memory
    could win at micro-batch 1 is screened there first: where that does not fit, it fits nowhere.
    Likewise a setting that would be screened where data parallelism's trials guess it does not
    fit waits for the least memory's screen where that turn starts no later: where the least
    memory runs out there, so does the setting holding more. Every block's recompute is a floor only where that is the one
    checkpointed setting ranked (a sharded layout's; a replica's planner also ranks fewer blocks:
    its own step is counted without checkpointing then)."""
    if reference is None or not hasattr(reference, "step_models") or planner.target is None:
        return None
    choices = _checkpointing_choices(planner, checkpointable=checkpointable,
                                     sharded=Sharding.parse(sharding).sharded)
    if choices is None:
        return None
    request, options = planner.request, planner.options
    try:
        references = reference_steps(reference)
    except EstimateUnavailable:  # data parallelism's step has no count here: planned whole, as before
        return None
    network = network_from_profile(planner.target.profile, gpus_per_node=options.gpus_per_node,
                                   network_gbps=options.network_gbps)
    shape = planner.shape
    seq_len = workload.seq_len or tokens_per_sample(workload)
    activation_bytes = 4 if Precision.parse(planner.chosen) is Precision.FP32 else 2
    splits = {tuple(s) for m in range(1, request.share + 1) if (s := split_for(m, request)) is not None}
    # A model-parallel layout's FSDP2 shards over all its data-parallel ranks, with the
    # context-parallel ones, unless a shard group is asked for (planner._probe_layouts).
    group = (layout.data_parallel(planner.world_size) * layout.cp
             if Sharding.parse(sharding) is Sharding.FSDP and options.shard_group is None else None)
    words = []
    fits_at = 0  # the largest micro-batch a screen without checkpointing fitted (with it, less is held)
    likely = _likely_without_checkpointing(reference, layout, planner.usable)
    drawn = {checkpointing: {split: fastest_possible(
        references, layout, list(split), recompute=recompute, network=network, seq_len=seq_len,
        hidden=shape.hidden, blocks=shape.blocks, activation_bytes=activation_bytes, sharded_group=group)
        for split in sorted(splits)} for checkpointing, recompute in choices}
    least_memory = choices[-1][0]
    answered = {}  # (micro-batch, setting): a screen's answer, asked once

    def screened(micro_batch: int, checkpointing: str) -> str | None:
        key = (micro_batch, checkpointing)
        if key not in answered:
            answered[key] = screen(workload, planner, layout, checkpointable, micro_batch=micro_batch,
                                   checkpointing=checkpointing)
        return answered[key]

    def count_comes_first(micro_batch: int, *, least: bool) -> bool:
        # Counted before any screen (see the loop below): no pipeline, and a screen saw it fit
        # there, data parallelism's trials guess it does, or it is the least memory at 1.
        return layout.pp == 1 and (micro_batch <= fits_at or likely >= micro_batch or least)

    def least_memory_screened_at() -> int | None:
        # The micro-batch the least memory's turn (below) starts with a screen at, from data
        # parallelism's bound alone (its own step without checkpointing not counted); None
        # where it starts with its count, or nothing of it could win.
        could = [max(split) for split, b in drawn[least_memory].items() if b > leader.samples_per_s]
        if not could:
            return None
        first = min(could)
        return None if count_comes_first(first, least=first == 1) else first

    if layout.pp > 1 and any(
            b > leader.samples_per_s and max(split) == 1 for split, b in drawn[least_memory].items()):
        # A pipeline (no count of its own) whose least memory could win at micro-batch 1 is screened
        # there first: where that runs out it fits nowhere, without the screen of a setting
        # holding more (70B's and 405B's pipelines: 7 CPU s each); where it fits, the same
        # screen answers its setting's turn below. (Any other layout's least memory at 1 is
        # counted, never screened, below.)
        short = screened(1, least_memory)
        if short is not None:
            return _fits_nowhere(layout, short)
    unchecked = None  # the layout's own step counted without checkpointing, where it was
    for checkpointing, recompute in choices:
        bounds = drawn[checkpointing]
        label = "every block checkpointed" if checkpointing == "on" else "checkpointing off"
        counted = False  # bounded by the layout's own step too
        borrowed = checkpointing == "on" and unchecked is not None
        if borrowed:
            # A step with every block checkpointed runs every op of the step without, and
            # recomputes each block's forward, no faster than 1/(tp × cp) of data parallelism's
            # recompute (``timing.bound.RecomputedFloorSteps``): that step's own count bounds it
            # before its own is counted (the wide decoder's TP 2 is ruled out: 1.1 CPU s; 8B's
            # CP 2 could win from micro-batch 8, not 2). Where fewer blocks may be ranked (a
            # replica's planner), without the recompute.
            could = [split for split, b in bounds.items() if b > leader.samples_per_s]
            own = own_bounds(planner, unchecked, could, network=network,
                             recompute_from=references if recompute else None)
            bounds = {split: min(b, own.get(split, b)) for split, b in bounds.items()}
        while True:
            winning = [split for split, b in bounds.items() if b > leader.samples_per_s]
            said = (f"{label} {'up to' if winning else 'at most'} {max(bounds.values(), default=0.0):.4g}"
                    + (" (its own step counted)" if counted else
                       " (its own step without checkpointing counted)" if borrowed else ""))
            if not winning:
                words.append(said)
                break
            micro_batch = min(max(split) for split in winning)
            # A setting holding less than one a screen saw fit there (every block checkpointed, at
            # or below ``fits_at``) is counted, not screened: it fits there too, and its own step
            # moves the smallest micro-batch that could win up, where one screen decides (8B's CP
            # 2: the screen at micro-batch 2 fitted, its own count then asked for 16; 8.5 CPU s
            # saved). The least memory at micro-batch 1 is counted before it is screened too, and
            # planned whole unscreened where its own step still lets it win there: a screen would
            # only say it fits, which the planner's probe finds anyway (70B's TP 2: 11 CPU s); one
            # that fits nowhere fails that probe instead (no pipeline here: 70B's and 405B's fit
            # nowhere). So is a setting that data parallelism's trials say likely fits there
            # (without checkpointing at that micro-batch, and so with it): a screen that fits only
            # sends it to its count (8B's CP 2 screened micro-batch 1 without checkpointing, 3.0
            # CPU s, to count its step and screen micro-batch 2 next). Past those, a screen that
            # runs out spares the count (8B's CP 2 with every block, which could win from
            # micro-batch 8 by its step without checkpointing: out of memory there, 2.3 CPU s).
            least = checkpointing == least_memory and micro_batch == 1
            count_first = not counted and count_comes_first(micro_batch, least=least)
            if counted and least:
                return _UNSCREENED
            if micro_batch > fits_at and not count_first:
                earlier = (least_memory_screened_at() if checkpointing != least_memory and not counted
                           and _guessed_short_without_checkpointing(reference, layout, planner.usable, micro_batch)
                           else None)
                if earlier is not None and earlier <= micro_batch and screened(earlier, least_memory) is not None:
                    # The least memory's turn starts with its screen at a micro-batch no larger,
                    # and data parallelism's trials guess this setting does not fit here (where
                    # they say nothing, both screens may fit, and the first is then spent): that
                    # screen goes first, and where it runs out, this setting (holding at least as
                    # much) runs out here too. 70B's CP 2 was screened at micro-batch 4 without checkpointing (out of
                    # memory: 577 GiB) and then with every block (past the limit), 3.0 and 5.2
                    # CPU s; the second alone answers both now.
                    words.append(f"{said}, from micro-batch {micro_batch}: every block checkpointed "
                                 f"already does not fit at {earlier}")
                    break
                short = screened(micro_batch, checkpointing)
                if short is not None:
                    words.append(f"{said}, from micro-batch {micro_batch}: {short}")
                    break
                if checkpointing == "off":
                    fits_at = micro_batch
            if counted or layout.pp > 1:
                # A pipeline's stage counted afresh is not the stage its probe records (which
                # its plan is predicted from): no bound from its own step.
                return None
            # It fits where data parallelism's step lets it win: its own step, counted at
            # micro-batches 1 and 2, bounds the splits that could closer (a count costs about a
            # screen; its planner's search a probe per setting and micro-batch: 8B's CP 2 is
            # ruled out in 18 CPU s, planned whole in 28).
            try:
                steps = own_steps(planner, every_block=recompute)
            except EstimateUnavailable:
                return None
            counted = True
            own = own_bounds(planner, steps, winning, network=network)
            bounds = {split: min(bounds[split], own[split]) for split in winning}
            if checkpointing == "off":
                unchecked = steps
    why = (f"cannot beat {leader.name}'s {leader.samples_per_s:.4g} samples/s per GPU (bounded from data "
           f"parallelism's counted step, or its own where said): {'; '.join(words)}")
    return LayoutOutcome(layout, beaten=1, screened=True, error=why)


def _likely_without_checkpointing(reference, layout: Layout, usable: int) -> int:
    """The largest micro-batch at which ``layout`` (not a pipeline) likely fits ``usable`` without
    checkpointing, guessed from the trials data parallelism's planner (``reference``) ran of that
    (its memo): a rank that splits each sample over d = tp × cp GPUs holds about the parameter,
    gradient and optimizer-state shards data parallelism's FSDP2 rank holds (the same number of
    ranks share them) and 1/d of the rest. Only trials that saw the whole step count (one that
    fitted, or a floor of its tensors: an out-of-memory step stops early). 0: none says so. A
    guess that orders the search's work, never its answer: 8B's CP 2 (82.0 GiB at micro-batch 1,
    14.96 of it held before the step: 48.5 guessed, fits) and 70B's TP 2 (283.1 and 4.11: 143.6
    guessed, 159.5 its own floor)."""
    return max((micro_batch for micro_batch, held, rest in _split_trials(reference, layout)
                if held + rest <= usable), default=0)


def _likely_fits_without_checkpointing(reference, layout: Layout, usable: int, micro_batch: int) -> bool:
    """Whether ``layout`` likely fits ``usable`` at ``micro_batch`` without checkpointing: the guess
    of ``_likely_without_checkpointing``, a trial at a smaller micro-batch m taken as holding
    ``micro_batch`` / m times its rest (more than its parameters' gathers grow)."""
    return any(held + rest * max(1.0, micro_batch / m) <= usable
               for m, held, rest in _split_trials(reference, layout))


def _guessed_short_without_checkpointing(reference, layout: Layout, usable: int, micro_batch: int) -> bool:
    """Whether data parallelism's trials guess that ``layout`` does not fit ``usable`` at
    ``micro_batch`` without checkpointing: some whole-step trial exists, and none says it likely
    fits (``_likely_fits_without_checkpointing``). False where no trial says anything."""
    return (next(_split_trials(reference, layout), None) is not None
            and not _likely_fits_without_checkpointing(reference, layout, usable, micro_batch))


def _split_trials(reference, layout: Layout):
    """(micro-batch, bytes held before the step, the rest over tp × cp) of each of data
    parallelism's whole-step trials without checkpointing (``_likely_without_checkpointing``);
    none for a pipeline."""
    memo = getattr(getattr(reference, "backend", None), "trials_memo", None)
    if not memo or layout.pp > 1:
        return
    budget = reference.backend.info().budget_bytes
    split = layout.tp * layout.cp
    for trial in remembered_trials(memo, checkpointing="off"):
        peak, held = trial.budgeted_peak_bytes, trial.baseline_bytes
        whole = trial.fits or trial.past_limit is not None or (budget and peak > budget)
        if whole and held is not None:
            yield trial.micro_batch, held, (peak - held) / split


def _fits_nowhere(layout: Layout, short: str) -> LayoutOutcome:
    """``layout``'s outcome where its screen at micro-batch 1, of its least memory, said ``short``."""
    return LayoutOutcome(layout, error=f"nothing fits: {short}", fits_nowhere=True, screened=True)


def _checkpointing_choices(planner, *, checkpointable: bool, sharded: bool) -> list[tuple[str, bool]] | None:
    """The checkpointing settings a layout's ranked plan may take, as (screen's "off"/"on", every
    block's recompute counted in the bound), the least memory last; None where a setting of K
    blocks is asked for (no bound)."""
    if not checkpointable:
        return [("off", False)]
    if planner.checkpointing.auto:
        # A replica's planner also ranks fewer blocks than every one: no recompute is the floor.
        return [("off", False), ("on", sharded or planner.distributed)]
    blocks = planner.first
    if not blocks.blocks:
        return [("off", False)]
    if blocks.blocks == blocks.total:
        return [("on", True)]
    return None


def _screen(workload, planner, layout: Layout, checkpointable: bool, micro_batch: int = 1,
            checkpointing: str | None = None) -> str | None:
    """Why ``layout`` does not fit at ``micro_batch``, from one estimate of its least memory
    there (every block checkpointed, or ``checkpointing`` "on"/"off" where given, FSDP2 over all
    its data-parallel ranks, the planner's precision, the accumulation window a plan at
    ``micro_batch`` runs); None where that fits (the planner then searches it). Memory grows with the micro-batch, so at 1 this says the
    layout fits nowhere. One trial instead of a planner's search: where data parallelism fit
    nowhere, many candidates do not either, and where a layout planned N steps, many cannot reach
    N."""
    # The window the planner's probe runs at ``micro_batch`` (``window_steps`` of the layout's
    # share, reduce-scattering every micro-step), so that a CUDA estimate's probe takes this
    # trial's answer instead of running it again (``FreshTrialsSession``'s memo); a pipeline's
    # is at least pp micro-batches (its schedule's). The layout's sharding as the planner plans
    # it (fsdp under auto; fsdp-offload holds less on the device).
    sharding = str(planner.options.sharding)
    window = layout.pp if layout.pp > 1 else window_steps(micro_batch, planner.request.share)
    checkpointing = checkpointing or ("on" if checkpointable else "off")
    trial = window_trial(workload, planner.backend, micro_batch=micro_batch, window=window,
                         precision=planner.chosen, checkpointing=checkpointing,
                         sharding="fsdp" if sharding == "auto" else sharding,
                         world_size=planner.world_size, parallel=layout, reduce_every_micro_step=True,
                         limit=planner.usable)
    least = f"micro-batch {micro_batch}" + (", every block checkpointed" if checkpointing == "on" else
                                            ", checkpointing off" if checkpointable else "")
    if trial is None:
        return f"parameters and optimizer state alone pass the budget ({least} screened)"
    # A --gpu estimate's budget holds the modelled reserved memory, not only the tensors.
    peak = trial.budgeted_peak_bytes
    if trial.past_limit is not None:  # its tensors alone: reserved memory holds more
        return (f"at least {format_bytes(peak)} at {least}, past the "
                f"{format_bytes(planner.usable)} the headroom leaves")
    if not trial.fits:
        # An out-of-memory step stops where an allocation fails, holding less than the budget;
        # a tensor floor's (affine_blocks) counts the whole step's tensors, more than the budget.
        budget = planner.backend.info().budget_bytes
        held = "needs at least {}" if budget and peak > budget else "with {} in use"
        return f"{least} runs out of memory ({held.format(format_bytes(peak))})"
    if peak > planner.usable:
        return (f"{format_bytes(peak)} at {least}, past the "
                f"{format_bytes(planner.usable)} the headroom leaves")
    return None


def _unsupported(exc: BaseException) -> LayoutUnsupported | None:
    """The ``LayoutUnsupported`` that ``exc`` is or was raised from (``raise ... from``: a step's
    error wraps it so); not one merely being handled when another error came."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LayoutUnsupported):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


def _steps_words(n: int) -> str:
    return "1 accumulation step" if n == 1 else f"{n} accumulation steps"


def _first_sentence(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["search_layout"]
