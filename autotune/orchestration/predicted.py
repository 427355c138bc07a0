"""``--optimize throughput --gpu``: rank what fits by predicted throughput, without the device.

The settings are those ``--optimize memory`` probes on fake tensors: ddp, FSDP2 where a replica
leaves accumulation steps to save or fits nowhere (the whole world and the smallest shard group
that reaches as few steps; ``--sharding fsdp`` ranks FSDP2 whatever ddp does), checkpointing off
and, where off leaves accumulation steps, on (the fewest blocks that reach as few). For each
setting that fits, the split of its fewest accumulation steps is timed (``autotune.timing``: the
roofline on the step counted on fake tensors, the alpha–beta network with the runtime's overlap),
and the plan takes the most samples per second per GPU. Within a setting more steps are never
faster under this model: a micro-step's time is affine in its micro-batch (a fixed part for every
op's launch, a part per sample) and its communication does not shrink with it, so a split of k
steps costs k fixed parts and k rounds of all-gathers on top of the same per-sample work. On a
device you have, the measured search (``autotune.tuning``) stays the method.
"""

from __future__ import annotations

import dataclasses

from ..distributed.sharding.settings import Sharding, resolve_shard_group
from ..errors import EstimateUnavailable, PlanError
from ..planning.policy import micro_batch_for_steps, split_for
from ..planning.types import ConfigurationPredicted, Plan, SettingTried, ThroughputOutcome
from ..precision import Precision
from ..timing.bound import SLACK, FloorSteps, RecomputedFloorSteps, ReferenceStep
from ..timing.comm import network_from_profile
from ..timing.layout import with_layout
from ..timing.count import count_steps_costs
from ..timing.roofline import speed_for_profile
from ..timing.window import StepModel, predict_window, tokens_per_sample, with_tokens
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest

def fastest_predicted(planner) -> Plan:
    """The plan of the configuration predicted fastest (see the module's docstring)."""
    options, request = planner.options, planner.request
    profile = planner.target.profile
    # A pipeline's schedule reduces a sharded stage's gradients once, on its last backward
    # (``count._per_micro_step`` keeps those reduce-scatters whole for it).
    pipelined = options.parallel.pp > 1
    speed = speed_for_profile(profile)
    network = network_from_profile(profile, gpus_per_node=options.gpus_per_node,
                                   network_gbps=options.network_gbps)
    # The layouts the memory rule probes: FSDP2 where a replica leaves accumulation steps to save
    # (or fits nowhere), on the whole world and the smallest shard group that reaches as few.
    settings = planner.settings_in(planner.chosen)
    tokens = tokens_per_sample(planner.workload)
    ranked, models = [], {}
    planner.step_models = []
    for setting in settings:
        split = split_for(setting.allowed_micro_batch, request)
        if split is None:
            continue
        sizes = sorted(set(split))
        try:
            counted = _count(planner, setting, sizes, tokens, profile.name)
        except EstimateUnavailable:
            continue
        model = StepModel(counted, speed, setting.precision)
        models[id(setting)] = (model, counted)
        planner.step_models.append((setting, counted, model))
        timed = _in_layout(planner, predict_window(
            model, split, network=network, world_size=planner.world_size,
            sharding=str(setting.sharding), shard_group=setting.shard_group,
            reduce_every_micro_step=not pipelined, gradient_bytes=planner.fingerprint.param_bytes),
            split, setting.precision, network)
        ranked.append((setting, ConfigurationPredicted(
            precision=setting.precision, checkpointing=setting.checkpointing, micro_batches=split,
            sharding=setting.sharding, shard_group=setting.shard_group, parallel=setting.parallel,
            step_time=timed)))
    if not ranked:
        raise PlanError(f"--optimize throughput --gpu {profile.id}: no configuration fits "
                        f"({_why_none(settings)}); lower --headroom, or plan for a larger GPU")
    ranked.sort(key=lambda pair: -pair[1].step_time.samples_per_s)
    setting, winner = ranked[0]
    chosen = dataclasses.replace(setting, allowed_micro_batch=max(winner.micro_batches))
    precision = winner.precision
    reason = why_predicted_fastest([c for _, c in ranked], network=network, speed=speed)
    # Built as a request for the winner's settings; the planner's own request stays as asked,
    # so that running it again (a layout search's deferred details) ranks the same settings.
    planner.request = dataclasses.replace(
        request, precision=precision, sharding=str(winner.sharding),
        checkpointing=CheckpointingRequest.parse(winner.checkpointing),
        precision_reason=request.precision_reason)
    try:
        plan = planner.build(precision, [chosen], considered=settings,
                             throughput=ThroughputOutcome(records=[], reason=reason))
    finally:
        planner.request = request
    # The plan's own window: its split and gradient sync as built (the ranking reduced every
    # micro-step, what the probe proved fits). Measuring the planned micro-batch can lower it:
    # sizes not counted yet are counted now.
    model, counted = models[id(setting)]
    missing = sorted(set(plan.micro_batches) - set(counted))
    if missing:
        model = StepModel({**counted, **_count(planner, setting, missing, tokens, profile.name)}, speed,
                          setting.precision)
    def timed(reduce_every_micro_step: bool):
        return _in_layout(planner, predict_window(
            model, plan.micro_batches, network=network, world_size=planner.world_size,
            sharding=str(plan.sharding), shard_group=plan.shard_group,
            reduce_every_micro_step=reduce_every_micro_step and not pipelined,
            gradient_bytes=planner.fingerprint.param_bytes), plan.micro_batches, setting.precision, network)

    plan.step_time = timed(plan.reduce_every_micro_step)
    # Where the sync-on-last window was not estimated (a layout search defers it), the most this
    # plan could reach with it: its gradients reduce-scattered once a window instead.
    planner.sync_on_last_upper = (
        max(plan.step_time.samples_per_s, timed(False).samples_per_s)
        if plan.sharding.sharded and plan.reduce_every_micro_step and plan.accumulation_steps > 1
        and not pipelined and not planner.search_details else plan.step_time.samples_per_s)
    plan.predicted = [c for _, c in ranked]
    layouts = sorted({c.layout for c in plan.predicted})
    plan.reasons["sharding"] = (
        f"{plan.chosen_layout}: the fastest predicted of {', '.join(layouts)} (see throughput)"
        if len(layouts) > 1 else
        f"{plan.chosen_layout}: the only layout ranked (FSDP2 is probed where a replica leaves "
        f"accumulation steps to save or fits nowhere; --sharding fsdp ranks it anyway)"
        if options.sharding == "auto" else f"{plan.chosen_layout} as requested")
    return plan


def details_upper(planner) -> float:
    """The most samples/s per GPU data parallelism's ranked plan could reach with the details a
    layout search defers (``search_details`` off): its sync-on-last window
    (``sync_on_last_upper``), or a smaller shard group that reaches as few steps
    (``_shard_groups_upper``)."""
    own = planner.sync_on_last_upper or 0.0
    return max(own, _shard_groups_upper(planner)) if not planner.search_details else own


SHARD_PADDING_BYTES = 1 << 20
"""What a rank's parameter shards on the whole world may hold beyond their share: FSDP2 pads each
parameter to a multiple of the group, at most one element per tensor and rank (1 MiB: 262,144
fp32 tensors)."""


def _shard_groups_upper(planner) -> float:
    """``shard_group_bounds``' most; 0.0 where no group is searched or none can fit."""
    return max(shard_group_bounds(planner).values(), default=0.0)


def shard_group_bounds(planner) -> dict[int, float]:
    """{g: the most samples/s per GPU shard group g's settings could be predicted at}, from the
    whole world's ranked settings, for each smaller group that may fit (none where no group is
    searched).

    A group is probed at one micro-batch, the one that reaches the world's fewest steps
    (``planner._probe_layouts``), for each checkpointing setting the world's reaches it with. A
    rank of group g holds what the world's rank holds there (the same gathered blocks and
    activations) and parameter and optimizer-state shards world/g times larger
    (``_states_per_parameter``): where the world's tensors at that micro-batch plus that growth
    pass the budget left, g does not fit (70B on 256: groups 4, 8 and 16). Else its step is the
    world's counted one with FSDP2's gathers and scatters over g ranks (the same forward and
    backward; larger shards to copy and step, and its replicas' all-reduce, left out, only add),
    each size not counted at ``FloorSteps``' floor, its gradients reduce-scattered each
    micro-step or once a window, less ``SLACK``."""
    options, request = planner.options, planner.request
    world = request.data_parallel
    groups = [g for g in range(2, world) if world % g == 0]
    if options.sharding != "auto" or options.shard_group is not None or not groups:
        return {}
    whole = [(setting, counted) for setting, counted, _ in planner.step_models
             if setting.sharding is Sharding.FSDP and setting.shard_group in (None, world)]
    if not whole:
        return {}
    best = min(len(split_for(setting.allowed_micro_batch, request)) for setting, _ in whole)
    needed = micro_batch_for_steps(request, best)
    split = split_for(needed, request)
    speed = speed_for_profile(planner.target.profile)
    network = network_from_profile(planner.target.profile, gpus_per_node=options.gpus_per_node,
                                   network_gbps=options.network_gbps)
    states = _states_per_parameter(planner.fingerprint)
    sharded = planner.fingerprint.param_bytes * (1 + states)
    most: dict[int, float] = {}
    for setting, counted in whole:
        if setting.allowed_micro_batch < needed:
            continue  # a group's rank holds more: it cannot reach it either
        at = setting.probe.trial_at(needed) if setting.probe is not None else None
        held = (at.allocated_peak_bytes or at.peak_bytes) if at is not None else None
        for group in groups:
            grows = sharded * (1 / group - 1 / world) - SHARD_PADDING_BYTES * (1 + states)
            if held is not None and held + grows > planner.usable:
                continue
            model = FloorSteps({n: _regrouped(c, world, group) for n, c in counted.items()}, speed,
                               setting.precision)
            for every in (True, False):
                most[group] = max(most.get(group, 0.0), predict_window(
                    model, split, network=network, world_size=world, sharding="fsdp", shard_group=group,
                    reduce_every_micro_step=every, gradient_bytes=planner.fingerprint.param_bytes
                ).samples_per_s / SLACK)
    return most


def _states_per_parameter(fingerprint) -> int:
    """Tensors of a parameter's size and dtype the optimizer keeps for each trainable parameter,
    at least: torch's Adam and AdamW two (``exp_avg``, ``exp_avg_sq``), SGD with momentum one
    (``momentum_buffer``); 0 for any other (bitsandbytes' 8-bit states are smaller)."""
    settings = fingerprint.optimizer_settings or {}
    if fingerprint.optimizer in ("Adam", "AdamW"):
        return 2
    if fingerprint.optimizer == "SGD" and (settings.get("momentum") or 0) > 0:
        return 1
    return 0


def _regrouped(costs, world: int, group: int):
    """``costs`` with FSDP2's gathers and scatters over the whole ``world`` over ``group`` ranks."""
    calls = tuple(dataclasses.replace(c, group_size=group)
                  if c.kind in ("all_gather", "reduce_scatter") and c.group_size == world and not c.ring else c
                  for c in costs.collectives)
    return dataclasses.replace(costs, collectives=calls)


def _in_layout(planner, timed, split: list[int], precision, network):
    """``timed`` (a data-parallel rank's window) with the plan's model-parallel layout's exposed
    tensor-parallel collectives and pipeline bubble, per GPU (``timing.layout.with_layout``):
    within a pipeline a split of fewer micro-batches idles longer. A sample's tokens are the
    plan's sequence length, else the batch's (``tokens_per_sample``: a plan without --seq-len
    still moves each sample's activations through the tensor-parallel collectives)."""
    parallel = planner.options.parallel
    if parallel.trivial:
        return timed
    shape = planner.shape
    seq_len = planner.workload.seq_len or tokens_per_sample(planner.workload)
    return with_layout(timed, parallel, micro_batches=split, seq_len=seq_len,
                       hidden=shape.hidden, blocks=shape.blocks,
                       activation_bytes=4 if Precision.parse(precision) is Precision.FP32 else 2,
                       network=network)


def _count(planner, setting: SettingTried, sizes, tokens: int | None, gpu: str) -> dict:
    """The setting's steps at ``sizes`` on fake tensors (with tokens per sample): those its probe
    ran and recorded (``timing.recorded``: no second pass) or counted before, the others counted
    now."""
    recorded = planner.recorded_steps.setdefault(recorded_key(setting), {})
    missing = [n for n in sizes if n not in recorded]
    if missing:
        # Kept with the probe's records: a layout search that runs this planner again (its
        # deferred details) counts nothing twice.
        recorded.update(count_steps_costs(planner.workload, missing, precision=setting.precision,
                                          checkpointing=setting.checkpointing, sharding=setting.sharding,
                                          world_size=planner.world_size, shard_group=setting.shard_group,
                                          for_gpu=gpu, parallel=setting.parallel))
    return with_tokens({n: recorded[n] for n in sizes}, tokens)


def reference_steps(planner) -> list[ReferenceStep]:
    """A data-parallel planner's ranked settings as steps at any micro-batch
    (``timing.bound``), each drawn through two counted micro-batches. Each alone bounds a layout
    (a rank of it runs at least 1/d of every op data parallelism runs), so those its ranking
    counted at two sizes serve as they are, and where none was, one more size is counted for one
    setting only (every block checkpointed, FSDP2 over the whole world where ranked: its
    recompute and gathers bound the most), and the one it still lacks where the setting with
    every block is another (the wide decoder's four settings at one size each: one count, not
    four). Where none was ranked (data parallelism fits nowhere), its step counted at
    micro-batches 1 and 2 all the same (a count needs no memory): FSDP2 over the whole world,
    every block checkpointed where the model has blocks (the forward and backward of none, and
    the recompute of every one)."""
    if not planner.step_models:
        if getattr(planner, "counted_reference", None) is None:
            planner.counted_reference = _counted_reference(planner)
        return planner.counted_reference
    models = planner.step_models
    every = [_every_block(setting) for setting, _, _ in models]
    whole = [_sharded_over_world(setting, planner.world_size) for setting, _, _ in models]
    drawn = [i for i, (_, counted, _) in enumerate(models) if len(counted) >= 2]
    if not drawn:
        drawn = [max(range(len(models)), key=lambda i: (every[i], whole[i]))]
    if any(every) and not any(every[i] for i in drawn):
        drawn.append(max((i for i in range(len(models)) if every[i]), key=lambda i: whole[i]))
    found = []
    for i in drawn:
        setting, counted, model = models[i]
        if len(counted) < 2:
            extra = max(counted) + 1
            counted = {**counted, **_count(planner, setting, [extra], tokens_per_sample(planner.workload),
                                           planner.target.profile.name)}
            model = StepModel(counted, model.speed, setting.precision)
            models[i] = (setting, counted, model)
        # FSDP2 over the whole world: its gathers are what a layout's FSDP2 gathers, over tp.
        calls = _sharded_calls(model.at(min(counted)).collectives) if whole[i] else ()
        found.append(ReferenceStep(model, every_block=every[i], sharded_calls=calls))
    return found


def _every_block(setting: SettingTried) -> bool:
    blocks = setting.checkpointing
    return bool(blocks.blocks) and blocks.blocks == blocks.total


def _sharded_over_world(setting: SettingTried, world: int) -> bool:
    return setting.sharding is Sharding.FSDP and setting.shard_group in (None, world)


def own_steps(planner, *, every_block: bool) -> dict:
    """``planner``'s layout's own step (``{micro_batch: StepCosts}``) at micro-batches 1 and 2 (1
    where its share is 1), every block checkpointed where ``every_block``, else as its first
    setting: counted as its ranking counts a setting (``_count``), and kept with its recorded
    steps, so that a layout planned whole after all counts these sizes once."""
    sizes = [1, 2] if planner.request.share > 1 else [1]
    return _count(planner, _own_setting(planner, every_block=every_block), sizes,
                  tokens_per_sample(planner.workload), planner.target.profile.name)


def own_bounds(planner, steps: dict, splits, *, network, recompute_from=None) -> dict:
    """The most samples/s per GPU ``planner``'s layout could be predicted at with each of
    ``splits`` (one data-parallel rank's micro-batches), from ``steps``, its step counted at one
    and two micro-batches (``own_steps``; each other size at its floor,
    ``timing.bound.FloorSteps``), its gradients reduce-scattered every micro-step or once a
    window, whichever predicts faster. ``recompute_from`` (data parallelism's ``ReferenceStep``s):
    ``steps`` were counted without checkpointing, and the bound is every block checkpointed's,
    with the least recompute those references draw (``timing.bound.RecomputedFloorSteps``)."""
    setting = _own_setting(planner, every_block=False)
    speed = speed_for_profile(planner.target.profile)
    layout = planner.options.parallel
    model = (FloorSteps(steps, speed, setting.precision) if recompute_from is None else
             RecomputedFloorSteps(steps, speed, setting.precision, recompute_from, layout.tp * layout.cp * layout.pp))
    pipelined = layout.pp > 1

    def bound(split: list[int]) -> float:
        return max(_in_layout(planner, predict_window(
            model, split, network=network, world_size=planner.world_size, sharding=str(setting.sharding),
            shard_group=setting.shard_group, reduce_every_micro_step=every and not pipelined,
            gradient_bytes=planner.fingerprint.param_bytes), split, setting.precision, network).samples_per_s
            for every in (True, False))

    return {tuple(split): bound(list(split)) for split in splits}


def _own_setting(planner, *, every_block: bool) -> SettingTried:
    """The setting a model-parallel ``planner`` probes and counts (``planner._probe_layouts``):
    FSDP2 under auto, over all data-parallel ranks unless a shard group is asked for."""
    options = planner.options
    sharding = Sharding.FSDP if options.sharding == "auto" else Sharding.parse(options.sharding)
    group = resolve_shard_group(options.shard_group, planner.request.data_parallel) if sharding.sharded else None
    return SettingTried(precision=planner.chosen, checkpointing=planner.every_block if every_block else planner.first,
                        sharding=sharding, shard_group=group, parallel=options.parallel)


def _counted_reference(planner) -> list[ReferenceStep]:
    blocks = planner.fingerprint.repeated_blocks
    checkpointing = (Checkpointing.every_block(blocks) if planner.fingerprint.checkpointable
                     else Checkpointing.off(blocks))
    counted = with_tokens(count_steps_costs(
        planner.workload, [1, 2], precision=planner.chosen, checkpointing=checkpointing, sharding="fsdp",
        world_size=planner.world_size, for_gpu=planner.target.profile.name), tokens_per_sample(planner.workload))
    model = StepModel(counted, speed_for_profile(planner.target.profile), planner.chosen)
    return [ReferenceStep(model, every_block=bool(checkpointing.blocks),
                          sharded_calls=_sharded_calls(counted[1].collectives))]


def _sharded_calls(collectives) -> tuple:
    """A micro-step's FSDP2 all-gathers and reduce-scatters (not the ring's, not the optimizer's)."""
    return tuple(c for c in collectives if not c.ring and c.kind in ("all_gather", "reduce_scatter")
                 and c.phase != "optimizer")


def recorded_key(setting: SettingTried) -> tuple:
    """What a setting's recorded steps are filed under: its layout, precision and blocks."""
    return (str(setting.sharding), setting.shard_group, setting.parallel, str(setting.precision),
            setting.checkpointing.blocks, setting.checkpointing.total)


def why_predicted_fastest(ranked: list[ConfigurationPredicted], *, network, speed) -> str:
    """The ranking in words: what was ranked, the winner and what it beat, and by what."""
    winner = ranked[0]
    w = winner.step_time
    layouts = sorted({c.layout for c in ranked})
    text = (f"ranked {len(ranked)} configuration(s) (layouts {', '.join(layouts)}; checkpointing "
            f"{', '.join(sorted({c.checkpointing.label for c in ranked}))}; each at its fewest "
            f"accumulation steps, as more steps only add per-step costs) by predicted samples/s per GPU on the "
            f"{speed.name} (roofline) with {_network_words(network)}; fastest: {winner.label()} "
            f"at {w.samples_per_s:.4g} samples/s per GPU ({_split_words(w)})")
    runner_up = next((c for c in ranked[1:] if c.key != winner.key), None)
    if runner_up is not None:
        r = runner_up.step_time
        gain = w.samples_per_s / r.samples_per_s - 1
        text += (f"; the next, {runner_up.label()}, {r.samples_per_s:.4g} samples/s ({_split_words(r)}), "
                 f"{gain:.1%} slower")
    return text


def _split_words(t) -> str:
    return (f"step {t.step_s * 1e3:.4g} ms: compute {t.compute_s * 1e3:.4g} ms, exposed "
            f"communication {t.exposed_comm_s * 1e3:.4g} ms, recompute {t.recompute_s * 1e3:.4g} ms")


def _network_words(network) -> str:
    inter = (f"{network.inter.bandwidth * 8 / 1e9:.4g} Gb/s per GPU between hosts"
             if network.inter is not None else "no network between hosts")
    return (f"{network.intra.bandwidth / 1e9:.4g} GB/s per GPU within hosts of "
            f"{network.gpus_per_node}, {inter}")


def _why_none(settings: list[SettingTried]) -> str:
    return "; ".join(f"{s.layout} {s.precision} checkpointing {s.checkpointing_label}: "
                     f"{s.error or 'no micro-batch fits'}" for s in settings[:6])


__all__ = ["details_upper", "fastest_predicted", "own_bounds", "own_steps", "recorded_key", "reference_steps", "why_predicted_fastest"]
