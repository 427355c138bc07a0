"""``autotune.plan()``: the one impure step of planning.

It inspects the workload (parameter bytes, optimizer, BatchNorm), probes the settings the request
needs, and hands everything to the pure planner (``autotune.planning.policy``). Under torchrun every rank
probes its own device and the ranks agree on the smallest answer (all-reduce MIN), so they all
build the same plan.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
from typing import Callable

import torch

from ..workload.activation_checkpointing import (checkpointable_blocks, checkpointing_futile,
                                                 checkpointing_refusal)
from ..workload.checkpoint_count import Checkpointing, CheckpointingRequest
from ..version import __version__
from torch._subclasses.fake_tensor import FakeTensorMode

from ..distributed.context_parallel import check_seq_len as check_cp_seq_len
from ..distributed import collectives
from ..compiled import eager_module, with_compile
from ..errors import ConfigError, EstimateUnavailable, PlanError, ProbeError, given, option
from ..memory.fake import EstimateMemoryBackend, fake_tensor_limits
from ..memory.fake_build import build_fake_model, estimate_caveat
from ..memory import backend_for
from ..memory.frozen_heap import frozen_heap
from ..planning.types import Plan, SettingTried, ThroughputOutcome, WorkloadFingerprint
from ..planning.policy import (PlanRequest, SyncOnLast, build_plan, checkpointing_worth_probing,
                      choose_precision, cpu_precision, ddp_bucket_bytes, evaluate_setting, fewest_steps,
                      first_shard_group, predicted_blocks, predicted_group_max, setting_extra_bytes,
                      settings_below_fewest, micro_batch_for_steps,
                      sharding_worth_estimating, split_for, usable_bytes)
from ..distributed.layout import Layout, check_degree, parse_layout
from ..planning.layouts import is_auto
from ..workload.model_shape import ModelShape, model_shape
from .layout_search import search_layout
from ..distributed.sharding.settings import Sharding, resolve_shard_group
from ..precision import Precision, scaler_settings, supports_bf16
from ..gpus.catalog import load_profile
from ..gpus.target import profile_target
from ..probing.api import probe, window_trial
from ..probing.share import window_steps
from ..probing.blocks import learn_block_model, prove_fewest_blocks
from ..probing.result import ProbeResult
from ..probing.trial import SetupOutOfMemory
from ..timing.recorded import recording_session
from ..units import format_bytes
from ..tuning.search import (DEFAULT_BUDGET_S, build_candidates,
                                search_throughput, setting_key, study_name, why_fastest)
from ..tuning.measure import compare_configurations, measure_configuration
from .eval_batch import plan_eval_batch
from .predicted import fastest_predicted, recorded_key
from .request import PlanOptions
from . import tokens
from ..distributed import environment
from ..workload.contract import Workload, load_workload
from ..workload.dataset_batch import check_default_collate



@frozen_heap()
def plan(
    workload,
    *,
    target_batch: int | None = None,
    world_size: int | None = None,
    device=None,
    precision: str = "auto",
    checkpointing="auto",
    memory_limit=None,
    headroom: float = 0.1,
    micro_batch: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    lr_rule: str = "auto",
    optimize: str = "memory",
    budget=DEFAULT_BUDGET_S,
    storage: str | None = None,
    gpu=None,
    grad_scaler=None,
    even: bool = False,
    sharding: str = "auto",
    shard_group: int | None = None,
    gpus_per_node: int | None = None,
    network_gbps: float | None = None,
    seq_len=None,
    target_tokens: int | None = None,
    seq_multiple: int = 1,
    eval_batch: bool = True,
    max_eval_batch: int | None = None,
    compile=None,
    tp: int | str = 1,
    cp: int | str = 1,
    pp: int | str = 1,
    pp_schedule: str | None = None,
    stages_per_rank: int | None = None,
) -> Plan:
    """Plan how to train ``workload`` at an effective batch of exactly ``target_batch``.

    ``seq_len`` (N or "auto") plans at ``make_batch(n, seq_len)``; ``target_tokens`` asks for
    that many tokens per optimizer step instead of ``target_batch`` samples (micro-batches ×
    seq_len × world size, exactly). "auto" takes the longest length, a multiple of
    ``seq_multiple``, whose accumulation micro-step fits at micro-batch 1 (see
    ``autotune.orchestration.tokens``); the plan records ``seq_len`` and ``target_tokens``.

    ``world_size`` defaults to torch.distributed's world size when initialised, else the
    WORLD_SIZE environment variable, else 1. ``precision`` is auto|fp32|bf16|fp16 and
    ``checkpointing`` auto|on|off, a count K of the model's repeated blocks or a fraction such as
    "1/3" (K spread evenly; "auto": the fewest blocks that buy the fewest accumulation steps,
    proved with real trials at K and K - 1). ``headroom`` is the
    fraction of the budget kept free. ``micro_batch`` pins the micro-batch. ``base_lr`` at
    ``base_batch`` (default: BASE_LR / BASE_BATCH in the model file) is rescaled by ``lr_rule``.

    ``optimize="memory"`` plans the largest micro-batch that fits (the fewest accumulation steps);
    with ``gpu``, ``"throughput"`` ranks every layout, checkpointing setting and split that fits by
    predicted throughput (``autotune.timing``; ``gpus_per_node`` and ``network_gbps`` override the
    profile's host size and per-GPU network) and records the prediction as ``plan.step_time``;
    without it, ``"throughput"`` measures the configurations that keep the batch exact (precisions the device
    supports under "auto", checkpointing off/on under "auto", every fitting split) for ``budget``
    ("60s", "2m" or seconds) and plans the fastest. ``storage`` (an Optuna URL such as
    ``sqlite:///autotune.db``) keeps the study so a rerun reuses what was measured.

    ``gpu`` (a bundled GPU profile name such as "a100-40gb", or a profile .toml path) plans for
    that GPU without it: budget and precision support from the profile, memory estimated on fake
    tensors; the plan is marked ``estimated`` (check it on the device with ``autotune verify``).

    ``grad_scaler`` (a ``GradScalerSettings`` or a dict of some of init_scale, growth_factor,
    backoff_factor, growth_interval; the rest are torch's defaults) records the fp16 GradScaler's
    knobs in the plan, for ``train`` and the DeepSpeed export.
    ``even=True`` plans equal micro-batches (the fewest that fit), for runners that take one
    micro-batch size (HF Trainer, DeepSpeed, Lightning, Accelerate); autotune's own loop also
    takes uneven splits (13 + 13 + 13 + 13 + 12), which need fewer accumulation steps.
    ``sharding`` is auto|ddp|fsdp|fsdp-offload (see ``autotune.sharding``); ``shard_group`` shards
    within groups of that many ranks and replicates across groups (default: the world size).
    Under "auto" a replica is probed first; where it leaves accumulation steps to save (or fits
    nowhere) and there is more than one rank, FSDP2 is estimated per rank on fake tensors with a
    fake process group, on the full world first and then on smaller shard groups (the smallest
    that reaches as few steps, searched from where the world's probe predicts it: a rank holds
    more the smaller its group), and the plan takes the fewest steps, the least communication
    among equals. ``plan.reasons["sharding"]``
    says why.

    ``eval_batch`` (default on) also plans the largest eval micro-batch (``plan.eval_micro_batch``:
    the forward alone under ``no_grad``, optimizer state alive, proved with real forwards),
    at most ``max_eval_batch``.

    ``compile`` (True: inductor, or a torch.compile backend name) plans the compiled training
    step: the probes' real trials run it (batch sizes dynamic), the plan records ``compile`` and
    ``autotune train`` trains compiled; a ``build_model`` that returns a compiled module is
    planned compiled without it. Compiled plans are DDP replicas (``sharding`` auto or ddp).

    ``tp``, ``cp`` and ``pp`` split each rank's work further (tensor, context and pipeline
    parallel, see ``autotune.Layout``; ``pp_schedule`` 1f1b|interleaved-1f1b|zero-bubble with
    ``stages_per_rank`` stages on each pipeline rank): the target then divides over the
    world_size / (tp × cp × pp) data-parallel ranks, and ``sharding``/``shard_group`` apply
    to those. The plan records the split as ``plan.parallel``. Any of them "auto" searches the
    layouts (``autotune.planning.layouts``: the splits that fit the world, the hosts
    (``gpus_per_node``, default the GPU profile's), the heads and the blocks, cheapest
    communication first with early stops) and plans the fewest accumulation steps, then the least
    communication (with ``gpu`` and ``optimize="throughput"``: the most samples/s predicted);
    ``plan.reasons["layout"]`` says which layouts were tried and why this one won.
    """
    # "auto" degrees: the layout search plans each candidate (orchestration.layout_search).
    degrees = dict(tp=tp, cp=cp, pp=pp, pp_schedule=pp_schedule, stages_per_rank=stages_per_rank)
    if gpu is not None and isinstance(precision, str):
        # Before the model is loaded (GPT-2 took 17 s to be told the T4 has no bf16).
        load_profile(gpu).require(precision.lower())
    searching = any(is_auto(v) for v in (tp, cp, pp))
    for name, value in dict(tp=tp, cp=cp, pp=pp).items():  # before the model loads
        if not is_auto(value):
            check_degree(name, value, auto_taken=True)
    parallel = Layout() if searching else parse_layout(**degrees)
    workload = with_compile(load_workload(workload), compile)
    if searching and workload.compile is not None:
        raise ConfigError(f"{option('compile')} with a layout search ({given('tp', tp)}, "
                          f"{given('cp', cp)}, {given('pp', pp)}): compiled steps are planned for "
                          f"DDP replicas only; plan without one of them")
    if workload.compile is not None:
        if not parallel.trivial:
            raise ConfigError(f"{option('compile')} with {parallel.describe_degrees()}: compiled "
                              f"steps are planned for DDP replicas only; plan without one of them")
        if sharding not in ("auto", "ddp"):
            raise ConfigError(f"{given('sharding', sharding)} with {option('compile')}: compiled "
                              f"steps are planned for DDP replicas only; use {given('sharding', 'ddp')} "
                              f"or plan without {option('compile')}")
        sharding = "ddp"
    tokens.check_token_options(target_batch=target_batch, target_tokens=target_tokens,
                               seq_len=seq_len, seq_multiple=seq_multiple)
    token_request = None
    if seq_len is not None or target_tokens is not None:
        workload.check_takes_seq_len()
        token_request = tokens.resolve(
            target_batch=target_batch, target_tokens=target_tokens, seq_len=seq_len,
            seq_multiple=seq_multiple, world_size=parallel.data_parallel(environment.resolve_world_size(
                world_size, environment.torchrun_group())),
            longest=lambda: _longest_at_one(workload, device=device, memory_limit=memory_limit,
                                            gpu=gpu, precision=precision,
                                            checkpointing=checkpointing, headroom=headroom,
                                            world_size=world_size, seq_multiple=seq_multiple))
        check_cp_seq_len(token_request.seq_len, parallel.cp, option="seq_len")
        workload, target_batch = workload.at_seq_len(token_request.seq_len), token_request.target_batch
    options = PlanOptions(
        target_batch=target_batch, world_size=world_size, device=device, precision=precision,
        checkpointing=checkpointing, memory_limit=memory_limit, headroom=headroom,
        micro_batch=micro_batch, base_lr=base_lr, base_batch=base_batch, lr_rule=lr_rule,
        optimize=optimize, budget=budget, storage=storage, gpu=gpu, grad_scaler=grad_scaler,
        even=even, sharding=sharding, shard_group=shard_group, gpus_per_node=gpus_per_node,
        network_gbps=network_gbps, eval_batch=eval_batch, max_eval_batch=max_eval_batch,
        parallel=parallel)
    inspected = inspect_workload(workload)
    # Every candidate layout's planner runs the same fake step to see that it can: once is enough.
    make_planner = functools.partial(_Planner, estimable=set())
    planned = (search_layout(workload, options, degrees, make_planner=make_planner, inspected=inspected)
               if searching else make_planner(workload, options, inspected=inspected).run())
    caveat = estimate_caveat(workload)
    if planned.estimated and caveat is not None:  # real trials would have measured it
        planned.warnings.append(caveat)
    futile = _futile_checkpointing(checkpointing, planned)
    if futile is not None:
        planned.warnings.append(futile)
    planned.reasons["batch_shapes"] = tokens.batch_shapes(workload, planned.micro_batch)
    return planned if token_request is None else tokens.with_tokens(planned, token_request)


def _futile_checkpointing(requested, planned) -> str | None:
    """A warning where checkpointing was asked for (not chosen by auto) on blocks it cannot make
    smaller: the plan's peak and step are then what checkpointing off gives, with recomputation."""
    request = CheckpointingRequest.parse(requested, option=option("checkpointing"))
    futile = planned.workload.checkpointing_futile
    if request.auto or request.value == "off" or futile is None or not planned.checkpointing.blocks:
        return None
    return (f"{given('checkpointing', str(request))}: {planned.workload.source}: {futile}; it still "
            f"recomputes every checkpointed block in backward. Plan with {given('checkpointing', 'auto')} "
            f"(it keeps checkpointing only where a larger micro-batch then fits) or "
            f"{given('checkpointing', 'off')}")


def _longest_at_one(workload, *, device, memory_limit, gpu, precision, checkpointing,
                    headroom, world_size, seq_multiple):
    """``seq_len="auto"``: the longest length at micro-batch 1 in the setting that saves the most
    activations among those asked for (checkpointing every block under "auto"), within the
    budget less the headroom and DDP's buckets."""
    target = (profile_target(gpu, device=device, memory_limit=memory_limit, world_size=world_size)
              if gpu is not None else None)
    backend = target.backend if target else backend_for(device, memory_limit)
    chosen, _ = (target.choose_precision(precision) if target else choose_precision(
        precision, device_kind=backend.device.type, bf16_supported=supports_bf16(backend.device)))
    fingerprint = fingerprint_workload(workload)
    request = _requested_blocks(checkpointing, fingerprint)
    blocks = ("on" if fingerprint.checkpointable else "off") if request.auto else request
    world = environment.resolve_world_size(world_size, environment.torchrun_group())
    limit = (usable_bytes(backend.info().budget_bytes, headroom)
             - ddp_bucket_bytes(world, fingerprint.param_bytes))
    found = tokens.longest_at_one(workload, backend, device=device, limit_bytes=limit,
                                  precision=chosen, checkpointing=blocks, seq_multiple=seq_multiple)
    if environment.torchrun_group():
        # Every rank probed its own device: all plan the shortest answer, or they would differ.
        found.max_seq_len = collectives.min_across_ranks(found.max_seq_len)
    return found


class _Planner:
    """One ``plan()`` call: the device, the request and what was probed so far; its methods probe
    settings and layouts and hand them to the pure policy."""

    def __init__(self, workload: Workload, options: PlanOptions, *, inspected=None, estimable=None):
        # inspected: the model's (fingerprint, ModelShape), where plan() already built it;
        # estimable: the precisions whose fake step another planner of this workload ran.
        self.workload = workload
        self.options = options
        self.distributed = options.distributed
        self.world_size = options.world_size
        # --gpu: plan for a profile's device on fake tensors, without it (see autotune.gpus.target).
        self.target = (profile_target(options.gpu, device=options.device, memory_limit=options.memory_limit,
                                      world_size=self.world_size)
                       if options.gpu is not None else None)
        self.backend = self.target.backend if self.target else backend_for(options.device, options.memory_limit)
        if self.target:
            # Each trial of a CUDA estimate runs on a fresh build: one asked twice (a layout
            # screen's, then the probe's) is answered from the first (probing.fresh_trials).
            self.backend.trials_memo = {}
        self.info = self.backend.info()
        self.chosen, precision_reason = (
            self.target.choose_precision(options.precision) if self.target else choose_precision(
                options.precision, device_kind=self.backend.device.type,
                bf16_supported=supports_bf16(self.backend.device)))
        estimable = set() if estimable is None else estimable
        if self.target and self.chosen not in estimable:
            self.target.check_estimable(workload, self.chosen)
            estimable.add(self.chosen)
        self.fingerprint, shape = inspected or inspect_workload(workload)
        self.shape = shape
        self.checkpointing = _requested_blocks(options.checkpointing, self.fingerprint)
        self.request = PlanRequest(
            target_batch=options.target_batch, world_size=self.world_size, precision=self.chosen,
            precision_reason=precision_reason, checkpointing=self.checkpointing,
            headroom=options.headroom, micro_batch=options.micro_batch, lr_rule=options.lr_rule,
            base_lr=options.base_lr if options.base_lr is not None else workload.base_lr,
            base_batch=options.base_batch if options.base_batch is not None else workload.base_batch,
            dataset_size=_dataset_size(workload), distributed=self.distributed, even=options.even,
            grad_scaler=scaler_settings(options.grad_scaler),
            sharding=("ddp" if options.optimize == "throughput" and options.gpu is None
                      else str(options.sharding)),
            parallel=options.parallel,
        )
        if not options.parallel.trivial:
            options.parallel.check_hosts(options.gpus_per_node or (
                self.target.profile.gpus_per_node if self.target else None))
            options.parallel.check_model(blocks=self.fingerprint.repeated_blocks
                                         if options.parallel.pp > 1 else None,
                                         heads=shape.heads, kv_heads=shape.kv_heads)
        self.usable = usable_bytes(self.info.budget_bytes, options.headroom)
        self.extra = ddp_bucket_bytes(self.world_size, self.fingerprint.param_bytes)
        self.agree = collectives.min_across_ranks if self.distributed else None
        total = self.fingerprint.repeated_blocks
        # The setting probed first: off under "auto", else the one asked for, on the model's blocks.
        self.first = (Checkpointing.off(total) if self.checkpointing.auto
                      else self.checkpointing.resolve(total, option=option("checkpointing"),
                                                      source=self.fingerprint.source))
        self.every_block = Checkpointing.every_block(total)
        self.created_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.sync_estimates: dict = {}
        self.offload_last_resort = True
        """Under sharding auto, where nothing fits on the device, probe fsdp-offload. A layout
        search defers it for data parallel until no layout fits on the device."""
        self.every_block_first = False
        """Probe every block checkpointed before none (``try_layout``): set by the layout search
        where a screen found the layout fits with every block checkpointed, the least it holds."""
        self.sharded_every_block_first = False
        """Probe every block checkpointed first for sharded settings (``try_layout``): set by the
        layout search for data parallel, whose FSDP settings have no fewest-blocks search to
        lose (a replica's does) and 405B's fits nowhere, which every block shows first."""
        self.likely_without_checkpointing: Callable[[], int] | None = None
        """Where set (a layout search), the largest micro-batch this planner's layout likely fits
        without checkpointing, guessed from the trials data parallelism ran (0: none): where
        the search without checkpointing runs below every block's answer, ranked by time
        (``_every_block_first``), it starts there. A guess orders the trials, never the answer."""
        self.search_details = True
        """Search the smaller shard groups that reach as few steps and estimate the sync-on-last
        window. A layout search defers both to the layout it chooses: neither changes what it
        ranks by (steps, bubble, bytes communicated)."""
        self._settings_tried: dict = {}
        self.recorded_steps: dict = {}
        """Steps the probes counted as they ran, and those the ranking counted since, by
        ``recorded_key`` (``--optimize throughput --gpu``)."""
        self.sync_on_last_upper: float | None = None
        """Ranked by predicted throughput, the most samples/s per GPU the last plan could reach
        with its sync-on-last window, where that was not estimated (``search_details`` off);
        else its own prediction."""
        self.step_models: list = []
        """(setting, counted steps, StepModel) of each setting the throughput ranking timed: a
        layout search bounds the other layouts by data parallelism's (``timing.bound``)."""

    @property
    def memoized(self) -> bool:
        """Whether a trial asked again is answered from the memo (a --gpu estimate's fresh
        trials), so that running this planner again repeats no trial."""
        return getattr(self.backend, "trials_memo", None) is not None  # only fake tensors keep one

    @property
    def estimated_for(self) -> str | None:
        return self.target.profile.name if self.target else None

    def run(self) -> Plan:
        options = self.options
        if options.optimize == "throughput":
            result = self._fastest() if self.target is None else fastest_predicted(self)
        elif options.precision == "auto" and self.target is None and self.backend.device.type == "cpu":
            result = _cpu_auto_precision(self.settings_in, self.build, bf16=supports_bf16(self.backend.device),
                                         reaches_fewer=self.reaches_fewer_steps)
        else:
            result = self.build(self.chosen, self.settings_in(self.chosen))
        if options.eval_batch:
            result = plan_eval_batch(result, self.workload, self.backend, usable=self.usable,
                                     extra=self.extra, upper=options.max_eval_batch, agree=self.agree)
        if self.distributed:
            collectives.settle()  # every rank got here: the caller may exit right away
        return result

    def _fastest(self) -> Plan:
        precisions = ([self.chosen] if self.options.precision != "auto"
                      else _supported_precisions(self.backend.device))
        # Replicas only: the search measures in this one process (it is refused under torchrun).
        settings = [s for candidate in precisions
                    for s in _with_blocks_below_fewest(self.try_layout((Sharding.DDP, None), precision_=candidate),
                                                      usable=self.usable, extra=self.extra)]
        return _fastest_plan(self.workload, self.backend, self.request, self.fingerprint, settings, self.info,
                             usable=self.usable, extra=self.extra, budget_s=self.options.budget_s,
                             storage=self.options.storage, created_at=self.created_at,
                             estimated_for=self.estimated_for)

    def try_setting(self, checkpoint, precision: Precision | None = None, layout=(Sharding.DDP, None),
                    upper: int | None = None, hint: int | None = None, least: int | None = None) -> SettingTried:
        # Asked again (a layout search plans its chosen layout again, in detail): where the memo
        # would answer every trial, the setting it gave, itself (a probe asked again could
        # take another path to the same answer, and record other trials).
        key = (repr(checkpoint), repr(precision), repr(layout), upper, hint, least)
        if key in self._settings_tried:
            return self._settings_tried[key]
        # Ranked by predicted throughput for a GPU: the probe's one-step trials are counted as they
        # run (autotune.timing.recorded), so the ranking need not run them again.
        steps = {} if self.options.optimize == "throughput" and self.target else None
        # What the plan may hold, the same on every rank (each has its own budget): the probe's
        # search below the budget reads it, and ranks whose trials run collectives must agree.
        limit = self.usable - (0 if layout[0].sharded else self.extra)
        limit = self.agree(limit) if self.agree is not None else limit
        setting = _probe_setting(self.workload, self.backend, precision or self.chosen, checkpoint,
                                 upper or self.request.wanted_micro_batch, layout=layout,
                                 world_size=self.world_size, hint=hint, share=self.request.share,
                                 parallel=self.request.parallel,
                                 session_type=recording_session(steps) if steps is not None else None,
                                 limit=limit, least=least)
        if steps:
            self.recorded_steps[recorded_key(setting)] = steps
        tried = evaluate_setting(setting, usable=self.usable, agree=self.agree,
                                 extra_bytes=setting_extra_bytes(setting, self.world_size,
                                                                 self.fingerprint.param_bytes))
        if self.memoized:
            self._settings_tried[key] = tried
        return tried

    def try_layout(self, layout, upper: int | None = None, *, precision_: Precision | None = None,
                   hints=(), known_first: SettingTried | None = None, least: int | None = None) -> list[SettingTried]:
        # hints: where each probe's search starts, in the order the settings are tried.
        # known_first: the first setting's answer where it is already known without a probe.
        # least: only ``upper`` is worth a trial (see search_with_share).
        precision_ = precision_ or self.chosen
        hints = [*hints, None, None]
        request_ = dataclasses.replace(self.request, precision=precision_)
        if ((self.every_block_first or self.sharded_every_block_first and layout[0].sharded)
                and known_first is None and self.checkpointing.auto
                and self.fingerprint.checkpointable and not self.fingerprint.checkpointing_futile):
            return self._every_block_first(layout, upper, precision_, hint=hints[1], least=least)
        found = [known_first or self.try_setting(self.first, precision_, layout=layout, upper=upper,
                                                 hint=hints[0], least=least)]
        if checkpointing_worth_probing(found[0], request_, self.fingerprint, upper=upper):
            found.append(self.try_setting(self.every_block, precision_, layout=layout, upper=upper,
                                          hint=hints[1], least=least))
            # The fewest blocks are proved by local trials on a replica; ranks would have to agree.
            if not self.distributed and not layout[0].sharded:
                fewest = _fewest_blocks_setting(self.workload, self.backend, request_, found[0], found[1],
                                                usable=self.usable, extra=self.extra)
                if fewest is not None:
                    found.append(fewest)
        return found

    def _every_block_first(self, layout, upper, precision_, *, hint, least) -> list[SettingTried]:
        """Every block checkpointed, probed first; then none, at its micro-batch only. A rank holds
        at least as much without checkpointing as with every block checkpointed (each block's
        activations instead of its input), so none can only tie that micro-batch's steps (and
        takes it then: no recomputation): the first probe's search below it is not run. 8B at
        sequence 131072 under CP 8 searched micro-batches 8, 3, 2 and 1 without checkpointing (18
        CPU s), all out of memory; 70B under TP 2 searched 4, 2 and 1 (16 CPU s)."""
        on = self.try_setting(self.every_block, precision_, layout=layout, upper=upper, hint=hint,
                              least=least)
        micro_batch = on.allowed_micro_batch
        if micro_batch < 1:
            return [on]  # fits nowhere: nor does it without checkpointing
        if self.options.optimize == "throughput":
            # Ranked by time, none at a smaller micro-batch (more steps, no recompute) may win:
            # its search runs, below the micro-batch every block reached. 8B's FSDP 8 searched
            # micro-batches 8, 3, 2 and 1 without checkpointing (all out of memory) before. It
            # starts where a layout search's guess puts it (``likely_without_checkpointing``),
            # at 1 where nothing is likely to fit: 1 alone proves that, and where it fits its
            # trial is the baseline the search's estimates grow from. 8B's FSDP 8 halved to 2,
            # then 1, both out of memory (5.4 CPU s; 2.1 from 1, traced); the wide decoder's FSDP 4 fits
            # at 2, where its replicas fitted (one trial, as halving took).
            guess = self.likely_without_checkpointing
            hint = None if guess is None else min(max(guess(), 1), micro_batch)
            return [self.try_setting(self.first, precision_, layout=layout, upper=micro_batch, hint=hint), on]
        off = self.try_setting(self.first, precision_, layout=layout, upper=micro_batch, least=micro_batch)
        off.only_micro_batch = micro_batch
        return [off, on]

    def reaches_fewer_steps(self, precision_: Precision, steps: int) -> tuple[bool, int] | None:
        """Whether ``precision_`` plans fewer than ``steps`` accumulation steps, asked as one trial
        per checkpointing setting at the micro-batch that takes ``steps`` - 1 (that micro-batch
        too); None where a search answers instead (several ranks, a pinned micro-batch)."""
        request = self.request
        if (steps < 2 or self.distributed or self.world_size > 1 or request.micro_batch is not None
                or request.even or self.options.sharding not in ("auto", "ddp")):
            return None
        needed = micro_batch_for_steps(request, steps - 1)
        found = self.try_layout((Sharding.DDP, None), upper=needed, precision_=precision_, least=needed)
        fewest = fewest_steps(found, dataclasses.replace(request, precision=precision_))
        return fewest is not None and fewest < steps, needed

    def settings_in(self, precision_: Precision) -> list[SettingTried]:
        return _probe_layouts(functools.partial(self.try_layout, precision_=precision_),
                              dataclasses.replace(self.request, precision=precision_),
                              self.options.sharding, self.options.shard_group, self.request.data_parallel,
                              self.usable, offload=self.offload_last_resort,
                              smaller_groups=self.search_details)

    def build(self, precision_: Precision, settings: list[SettingTried], reason: str | None = None,
              **recorded) -> Plan:
        # recorded: build_plan's considered= and throughput= (a ranked plan's records).
        request_ = dataclasses.replace(self.request, precision=precision_,
                                       precision_reason=reason or self.request.precision_reason)

        def made(sync_on_last=None) -> Plan:
            return build_plan(request_, workload=self.fingerprint, settings=settings, device=self.info,
                              versions=current_versions(), created_at=self.created_at,
                              estimated_for=self.estimated_for, sync_on_last=sync_on_last, **recorded)

        planned = made()
        if not self.distributed:
            planned = _measure_planned(planned, made, self.workload, self.backend, self.world_size,
                                       self.usable, self.fingerprint.param_bytes)
        if (not planned.sharding.sharded or planned.accumulation_steps < 2 or not self.search_details
                or planned.parallel.pp > 1):
            return planned
        # The probe's sharded windows reduce-scattered every micro-step; the other option, holding
        # the unsharded gradients until the last micro-step, is estimated for the chosen split. Not
        # for a pipeline: its schedule reduce-scatters a stage's gradients on its last backward
        # whatever the plan says, and a [first, second, last] window of it ran 3 of its
        # micro-batches, not all, so the plan stated a peak below its own window's.
        key = (planned.label(), str(planned.sharding), planned.shard_group)
        if key not in self.sync_estimates:
            self.sync_estimates[key] = _sync_on_last(self.workload, self.backend, planned, self.world_size,
                                                     limit=self.usable)
        return made(self.sync_estimates[key])


def _cpu_auto_precision(settings_in, build, *, bf16: bool, reaches_fewer) -> Plan:
    """fp32, or bf16 where it plans fewer accumulation steps (see policy.cpu_precision).

    Where fp32 planned, bf16 is first asked only whether it reaches one step fewer
    (``reaches_fewer``, one trial per checkpointing setting): bf16's own search runs only where
    it does. The README's quickstart searched bf16 in full, about 40% of its planning time on a
    CPU where bf16 autocast is slow, to learn that bf16 needed as many steps."""
    tried = {Precision.FP32: settings_in(Precision.FP32)}
    plans = {}
    try:
        plans[Precision.FP32] = build(Precision.FP32, tried[Precision.FP32])
    except PlanError as exc:
        fp32_error = exc
    if bf16 and Precision.FP32 in plans and plans[Precision.FP32].accumulation_steps > 1:
        fp32_steps = plans[Precision.FP32].accumulation_steps
        asked = reaches_fewer(Precision.BF16, fp32_steps)
        if asked is not None and not asked[0]:
            _, reason = cpu_precision(fp32_steps, None, bf16_short_of=asked[1])
            return build(Precision.FP32, tried[Precision.FP32], reason)
    if bf16 and (Precision.FP32 not in plans or plans[Precision.FP32].accumulation_steps > 1):
        tried[Precision.BF16] = settings_in(Precision.BF16)
        try:
            plans[Precision.BF16] = build(Precision.BF16, tried[Precision.BF16])
        except PlanError:
            pass  # bf16 does not fit either: fp32's answer (or error) stands
    if not plans:
        raise fp32_error
    steps = {p: plan.accumulation_steps for p, plan in plans.items()}
    chosen, reason = cpu_precision(steps.get(Precision.FP32), steps.get(Precision.BF16))
    chosen = Precision.parse(chosen)
    return build(chosen, tried[chosen], reason)


def _probe_layouts(try_layout, request: PlanRequest, sharding: str, shard_group, world_size: int,
                   usable: int, *, offload: bool = True, smaller_groups: bool = True):
    """Every setting probed, ddp first, then fsdp on growing shard groups, then fsdp-offload where
    nothing else fits and ``offload`` allows (the planner's order of preference among plans with
    equally few accumulation steps). ``world_size``: the data-parallel ranks the shard groups
    divide. ``smaller_groups`` False: fsdp over the whole world only (the fewest steps any group
    reaches)."""
    if sharding == "auto" and not request.parallel.trivial:
        sharding = "fsdp"  # model-parallel layouts hold the data-parallel copies with FSDP2 only
    if sharding != "auto":
        chosen = Sharding.parse(sharding)
        group = resolve_shard_group(shard_group, world_size) if chosen.sharded else None
        return try_layout((chosen, group))
    settings = try_layout((Sharding.DDP, None))
    if not sharding_worth_estimating(settings, request):
        return settings
    groups = ([shard_group] if shard_group is not None
              else [g for g in range(2, world_size + 1) if world_size % g == 0])
    # The whole world first: it holds the least per rank, so it gives the fewest steps any shard
    # group can reach; then the smallest group that reaches as few.
    world = try_layout((Sharding.FSDP, groups[-1]))
    by_group = {groups[-1]: world}
    best = fewest_steps(world, request)
    if smaller_groups and best is not None and best < (fewest_steps(settings, request) or math.inf):
        # A smaller group is only worth it at the micro-batch that reaches as few steps: the
        # probe need not look further.
        needed = micro_batch_for_steps(request, best)

        def reaches(group: int) -> bool:
            # Each probe starts where the whole world's probe of the same checkpointing predicts.
            hints = [predicted_group_max(s.probe, world_size=groups[-1], group=group, upper=needed)
                     for s in world]
            # Only ``needed`` is worth a trial: below it the group takes more steps (8B on 8
            # H100s: groups 2 and 4 cannot reach FSDP 8's micro-batch 3, and their probes
            # searched micro-batches 1 and 2 on four full builds, about 25 CPU s).
            by_group[group] = try_layout((Sharding.FSDP, group), upper=needed, hints=hints,
                                         known_first=_no_fit_on_smaller_group(world[0], group),
                                         least=needed)
            return fewest_steps(by_group[group], request) == best

        first = first_shard_group(world, groups[:-1], micro_batch=needed, usable=usable,
                                  world_size=groups[-1])
        _smallest_passing(groups[:-1], reaches, first=first)
    sharded = [s for group in sorted(by_group) for s in by_group[group]]
    offloaded = []
    if offload and fewest_steps(settings + sharded, request) is None:
        # The last resort: shards, gradients and optimizer state in host memory, over the whole
        # world. Only where nothing fits on the device: where something does, fewer
        # accumulation steps rarely pay for the host traffic and a CPU optimizer step (and
        # estimating it would cost every large model's plan one more search).
        offloaded = try_layout((Sharding.FSDP_OFFLOAD, groups[-1]))
    return settings + sharded + offloaded


def _no_fit_on_smaller_group(on_world: SettingTried, group: int) -> SettingTried | None:
    """The answer for a smaller shard group of a setting that fitted nowhere on the whole world,
    without a probe: a rank of a smaller group holds more (larger shards, the same gathered blocks
    and activations), so it cannot fit either. None where the whole world's setting fitted."""
    if on_world.probe is not None:
        return None
    # Tried at one micro-batch only (every block checkpointed first): at that one.
    at = on_world.only_micro_batch or 1
    where = "fitted nowhere" if at == 1 else f"did not fit at micro-batch {at}"
    return dataclasses.replace(
        on_world, shard_group=group,
        error=(f"does not fit at micro-batch {at}: it {where} on shard group "
               f"{on_world.shard_group}, and a rank of a smaller group holds more (not estimated)"))


def _with_blocks_below_fewest(settings: list[SettingTried], *, usable: int, extra: int) -> list[SettingTried]:
    """One precision's settings and, where the planner proved the fewest blocks K, the Ks below it
    that reach micro-batches in between (see policy.settings_below_fewest): the search times them."""
    fewest = next((s for s in settings if s.checkpointing and s.blocks
                   and s.probe is not None and s.probe.block_model is not None), None)
    if fewest is None:
        return settings
    fewer = [s for s in settings if not s.checkpointing]
    return settings + settings_below_fewest(fewest, fewer, usable=usable, extra_bytes=extra)


def _smallest_passing(candidates: list, passes, *, first: int):
    """The first of ``candidates`` that ``passes``, where passing is monotone (once one passes,
    every later one does) and a passing one lies beyond the list; None where none passes.

    Starts at index ``first`` (a prediction), then its neighbour on the side the answer lies,
    then halves what is left: with a good prediction two calls prove the answer."""
    lo, hi = -1, len(candidates)  # candidates[lo] fails, candidates[hi] passes (or lies beyond)
    index, calls = first, 0
    while hi - lo > 1:
        index = min(max(index, lo + 1), hi - 1)
        if passes(candidates[index]):
            hi = index
        else:
            lo = index
        calls += 1
        index = (index - 1 if index == hi else index + 1) if calls == 1 else (lo + hi) // 2
    return candidates[hi] if hi < len(candidates) else None


def _supported_precisions(device) -> list[Precision]:
    # fp16 autocast on the CPU is slow and rarely what anyone trains with; CUDA has it everywhere.
    found = [Precision.FP32]
    if supports_bf16(device):
        found.append(Precision.BF16)
    if device.type == "cuda":
        found.append(Precision.FP16)
    return found


def _fastest_plan(workload, backend, request, fingerprint, settings, info, *, usable, extra, budget_s,
                  storage, created_at, estimated_for) -> Plan:
    """Measure the configurations and plan the fastest (the planner still makes the split)."""
    candidates = build_candidates(settings, share=request.share, usable=usable, extra_bytes=extra,
                                  pinned_micro_batch=request.micro_batch)
    name = study_name(workload_key=fingerprint.file_sha256 or fingerprint.source,
                      target_batch=request.target_batch, world_size=request.world_size,
                      device=f"{info.kind}-{info.name}", pinned_micro_batch=request.micro_batch)
    result = search_throughput(
        candidates, lambda config, seconds: measure_configuration(workload, backend, config, seconds=seconds),
        lambda configs, seconds: compare_configurations(workload, backend, configs, seconds=seconds),
        budget_s=budget_s, usable_bytes=usable, study_name=name, storage=storage)
    if result.winner is None:
        notes = "; ".join(f"{r.label()}: {r.note}" for r in result.records[:6])
        raise PlanError(f"--optimize throughput: no configuration fits and ran within the budget "
                        f"({notes}); lower --headroom, give it more memory or use --optimize memory")
    winner = result.winner
    setting = next(s for s in settings if setting_key(s) == (winner.precision, winner.checkpointing))
    if request.micro_batch is None:
        # The planner splits the share into the fewest steps of at most the allowed micro-batch;
        # allowing exactly the winner's makes it plan the split that was measured.
        setting = dataclasses.replace(setting, allowed_micro_batch=winner.micro_batch)
    request = dataclasses.replace(
        request, precision=winner.precision,
        checkpointing=CheckpointingRequest.parse(winner.checkpointing),
        precision_reason=f"{winner.precision}: the fastest measured (see throughput)")
    throughput = ThroughputOutcome(records=result.records, reason=why_fastest(result))

    def made(sync_on_last=None) -> Plan:
        return build_plan(request, workload=fingerprint, settings=[setting], device=info,
                          versions=current_versions(), created_at=created_at, considered=settings,
                          throughput=throughput, estimated_for=estimated_for, sync_on_last=sync_on_last)

    # The winner's micro-batch is often below the probe's trials (a smaller one ran faster),
    # where the probe's model may miss either way: measured as the memory rule's plan is (gpt2
    # in bf16 at 16 x 2 trained at 21.75 MB where the line from its one trial at 32 drew 21.64).
    planned = _measure_planned(made(), made, workload, backend, request.world_size, usable,
                               fingerprint.param_bytes)
    for record in planned.throughput:
        # Its row states the plan's peak (the table read 20.64 MiB beside the plan's 20.75).
        if (record.fits and (record.precision, record.checkpointing, record.micro_batches)
                == (planned.precision, planned.checkpointing, list(planned.micro_batches))):
            record.predicted_peak_bytes = planned.predicted_peak_bytes
    return planned


MEASURE_PLANNED = 4
"""Trials ``plan()`` runs at most to measure the planned micro-batch where it was predicted."""


def _measure_planned(planned: Plan, made, workload, backend, world_size: int, usable: int,
                     param_bytes: int) -> Plan:
    """The plan, with the peak of its own micro-batch measured where the probe only predicted it,
    and, for a CUDA estimate, measured again where the probe's trial was not its session's first.

    Below the largest micro-batch that fits, memory is convex in n (a max of affine pieces), so
    a line fitted to the largest trials under-predicts there, by as much as the pieces'
    intercepts (a window's in-place gradient add, a single step's end of backward): the plan's
    own micro-batch is measured with the probe's trial (a window with accumulation).

    A modelled caching allocator's reserved peak depends on the trials its session ran before
    (where the segments that outlive a trial were cut): 8B at sequence 131072 under CP 8 read
    47.48 GiB as the probe's third trial, 49.26 GiB as a run's first step. A run starts fresh, so
    the plan's trial runs in a session of its own (``EstimateMemoryBackend.fresh``) unless it was
    the first (or ran fresh: ``Trial.first_in_session``).

    Where the measured peak passes the budget less the headroom the setting allows no more than
    one micro-batch below, and the plan is made again (at most ``MEASURE_PLANNED`` times; then the
    prediction stands)."""
    fresh = set()
    for _ in range(MEASURE_PLANNED):
        setting = planned.chosen_setting
        probe_ = setting.probe if setting is not None else None
        if probe_ is None:
            return planned
        probed = probe_.trial_at(planned.micro_batch)
        again = (probed is not None and _modelled_allocator(backend) and id(probed) not in fresh
                 and probe_.trials.index(probed) > 0 and not probed.first_in_session)
        if probed is not None and not again:
            return planned
        try:
            trial = window_trial(workload, backend.fresh() if again else backend,
                                 micro_batch=planned.micro_batch,
                                 window=window_steps(planned.micro_batch, probe_.share),
                                 precision=setting.precision,
                                 checkpointing=planned.checkpointing,
                                 sharding=setting.sharding, world_size=world_size,
                                 shard_group=setting.shard_group, reduce_every_micro_step=True,
                                 parallel=setting.parallel)
        except EstimateUnavailable:
            return planned
        if trial is None:
            return planned
        if again:
            probe_.trials.remove(probed)  # the plan states the fresh session's peak
            fresh.add(id(trial))
        probe_.trials.append(trial)
        extra = setting_extra_bytes(setting, world_size, param_bytes)
        if not trial.fits or trial.peak_bytes + extra > usable:
            setting.allowed_micro_batch = min(setting.allowed_micro_batch, planned.micro_batch - 1)
        try:
            planned = made(None)
        except PlanError:
            return planned
    return planned


def _modelled_allocator(backend) -> bool:
    return isinstance(backend, EstimateMemoryBackend) and backend.allocator is not None




def _sync_on_last(workload, backend, planned: Plan, world_size: int, *, limit: int) -> SyncOnLast | None:
    """The plan's window with gradient sync on its last micro-step only (None: no estimate).

    A first micro-step at 1 (it leaves the same unsharded gradients), the largest micro-batch
    with sync off (no smaller than any micro-step before the last, and with every gradient alive
    at least what the real first one holds) and, with three or more, the last as it is planned
    (sync on, reduce-scattering while the unsharded gradients are held). ``limit``: what the plan
    holds at most (a sharded plan's budget less the headroom: no DDP buckets); a window whose
    tensors alone pass it stops there (``SyncOnLast.at_least_bytes``)."""
    split = planned.micro_batches
    sizes = [1, max(split)] + ([split[-1]] if len(split) >= 3 else [])
    try:
        trial = window_trial(workload, backend, micro_batch=planned.micro_batch,
                             window=planned.accumulation_steps, precision=planned.precision,
                             checkpointing=planned.checkpointing, sharding=planned.sharding,
                             world_size=world_size, shard_group=planned.shard_group,
                             reduce_every_micro_step=False, micro_batches=sizes,
                             parallel=planned.parallel, limit=limit)
    except EstimateUnavailable:
        return None
    return SyncOnLast(micro_batch=planned.micro_batch, steps=planned.accumulation_steps,
                      peak_bytes=trial.peak_bytes if trial is not None and trial.fits else None,
                      at_least_bytes=(trial.peak_bytes if trial is not None and trial.past_limit is not None
                                      else None),
                      held_gradient_bytes=trial.held_gradient_bytes if trial is not None else None,
                      allocated_peak_bytes=trial.allocated_peak_bytes if trial is not None else None)


def _requested_blocks(value, fingerprint: WorkloadFingerprint) -> CheckpointingRequest:
    """"auto", "off", "on" or a count strictly between (a fraction resolved on the model)."""
    name = option("checkpointing")
    request = CheckpointingRequest.parse(value, option=name)
    if request.auto or request.value == "off":
        return request
    if fingerprint.checkpointing_refused:
        raise PlanError(f"{name} {request}: {fingerprint.source}: {fingerprint.checkpointing_refused}; "
                        f"use auto or off")
    if not fingerprint.checkpointable:
        raise PlanError(f"{name} {request}: {fingerprint.source} has no repeated blocks (an "
                        f"nn.ModuleList or nn.Sequential of layers) to checkpoint; use auto or off")
    return CheckpointingRequest.parse(request.resolve(fingerprint.repeated_blocks, option=name,
                                                      source=fingerprint.source))


def _probe_setting(workload, backend, precision, checkpoint, upper: int, *,
                   layout=(Sharding.DDP, None), world_size: int = 1,
                   hint: int | None = None, share: int | None = None, parallel=None,
                   session_type=None, limit: int | None = None, least: int | None = None) -> SettingTried:
    sharding, group = layout
    parallel = parallel if parallel is not None else Layout()
    # Where the probe finds nothing, the setting is what was asked (its blocks not counted).
    tried = dict(precision=precision, checkpointing=Checkpointing.parse(checkpoint), sharding=sharding,
                 shard_group=group, parallel=parallel)
    # Replicated probes keep the call they always had (tests stand in for probe with it). A
    # sharded layout that does not fit is one of several tried: no extra step to say by how much.
    layout_args = (dict(sharding=sharding, world_size=world_size, shard_group=group, explain=False,
                        hint=hint) if sharding.sharded or not parallel.trivial else {})
    if not parallel.trivial:
        layout_args["parallel"] = parallel
    try:
        # share: micro-batches below it accumulate, and are probed as accumulation windows.
        result = probe(workload, precision=precision, checkpointing=checkpoint, max_micro_batch=upper,
                       backend=backend, share=share, limit=limit, least=least, **layout_args,
                       **({"session_type": session_type} if session_type is not None else {}))
    except SetupOutOfMemory as exc:
        return SettingTried(**tried, error=str(exc), state_fits=False)
    except ProbeError as exc:
        # Not fitting is an answer for this setting (another may fit); the message is kept.
        return SettingTried(**tried, error=str(exc))
    return SettingTried(precision=precision, checkpointing=result.checkpointing,
                        sharding=sharding, shard_group=group, probe=result, parallel=parallel)


def _fewest_blocks_setting(workload, backend, request: PlanRequest, off: SettingTried,
                           on: SettingTried, *, usable: int, extra: int) -> SettingTried | None:
    """Under "auto", when checkpointing every block cuts accumulation steps: the fewest blocks
    that reach the same micro-batch, predicted from the per-block saving learned on fake tensors
    and proved with real trials at K (fits) and K - 1 (does not). None when all are needed (the
    proof is then kept on ``on``) or nothing fewer can be proved."""
    split, off_split = split_for(on.allowed_micro_batch, request), split_for(off.allowed_micro_batch, request)
    if on.probe is None or split is None or (off_split is not None and len(off_split) <= len(split)):
        return None
    total, micro_batch = on.probe.total_blocks or 0, max(split)
    if total < 2:
        return None
    precision = Precision.parse(on.precision)
    model = learn_block_model(workload, backend, precision=precision,
                              micro_batches=(max(1, micro_batch // 2), micro_batch))
    base = off.probe or on.probe
    predicted = predicted_blocks(base, model, micro_batch, usable, extra) if model else None
    start = min(max(predicted or total - 1, 1), total)
    proof = prove_fewest_blocks(workload, backend, precision=precision, micro_batch=micro_batch,
                                start=start, limit_bytes=usable - extra, window=len(split))
    if not proof.blocks:
        return None
    if proof.blocks >= total:
        on.fewer_blocks_trial = proof.fewer
        return None
    blocks, trial = proof.blocks, proof.trials[proof.blocks]
    tried = ", ".join(f"{k}: {format_bytes(t.peak_bytes)}{'' if t.fits else ' (out of memory)'}"
                      for k, t in sorted(proof.trials.items()))
    said = (f"the per-block saving learned on fake tensors predicted {predicted} block(s)" if model
            else "no estimate on fake tensors, so real trials from all blocks down")
    memory_model = (model.for_blocks(base.memory_model, blocks, fitted_at=base.checkpointing.count or 0)
                    if model else on.probe.memory_model)
    result = ProbeResult(
        max_micro_batch=micro_batch, upper_bound=micro_batch, capped=True, trials=[trial],
        memory_model=memory_model, device=on.probe.device, precision=on.precision,
        checkpointing=Checkpointing.of(blocks, total), total_blocks=total, block_model=model,
        seconds=proof.seconds, oom_count=sum(not t.fits for t in proof.trials.values()),
        share=request.share, compiled=on.probe.compiled, compile_backend=on.probe.compile_backend,
        notes=[f"checkpointing {Checkpointing.of(blocks, total)} at micro-batch {micro_batch}: {said}; "
               f"real trials by blocks checkpointed: {tried}"])
    setting = SettingTried(precision=on.precision, checkpointing=result.checkpointing,
                           probe=result, fewer_blocks_trial=proof.fewer)
    return evaluate_setting(setting, usable=usable, extra_bytes=extra)


def fingerprint_workload(workload: Workload) -> WorkloadFingerprint:
    """What the plan needs to know about the model: sizes, optimizer, BatchNorm, repeated blocks
    (``inspect_workload``'s first half)."""
    return inspect_workload(workload)[0]


def inspect_workload(workload: Workload) -> tuple[WorkloadFingerprint, ModelShape]:
    """The model's fingerprint and the shapes a parallel layout depends on (heads, width, blocks).

    Read from a model built on fake tensors (shapes and dtypes, no data; or on the meta device,
    see ``memory.fake_build``): planning a model never allocates its weights. A model whose
    construction fake tensors cannot run is built for real.
    """
    if workload.model_is_instance:
        return _inspected(workload, workload.model)  # already built: nothing to save
    try:
        with fake_tensor_limits(workload), FakeTensorMode(allow_non_fake_inputs=True):
            return _inspected(workload, build_fake_model(workload))
    except EstimateUnavailable:
        pass  # the probe's real trials build it anyway (--gpu refused such a model earlier)
    return _inspected(workload, workload.new_model())


def _inspected(workload: Workload, model: torch.nn.Module) -> tuple[WorkloadFingerprint, ModelShape]:
    return _fingerprint(workload, model), model_shape(eager_module(model))


def _fingerprint(workload: Workload, model: torch.nn.Module) -> WorkloadFingerprint:
    model = eager_module(model)  # build_model()'s torch.compile: the blocks are the module's
    params = list(model.parameters())
    blocks = checkpointable_blocks(model)
    refused = checkpointing_refusal(model) if blocks else None
    trainable = [p for p in params if p.requires_grad]
    optimizer = workload.new_optimizer(trainable) if trainable else None
    lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
    return WorkloadFingerprint(
        source=workload.source,
        file_sha256=workload.file_sha256,
        param_count=sum(_weights(p) for p in params),
        trainable_param_count=sum(_weights(p) for p in trainable),
        param_bytes=sum(p.numel() * p.element_size() for p in trainable),
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        # A NaN or infinite LR is no LR to keep (and JSON cannot hold it).
        optimizer_lr=float(lr) if isinstance(lr, (int, float)) and math.isfinite(lr) else None,
        optimizer_settings=optimizer_settings(optimizer) if optimizer is not None else None,
        batchnorm=any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        checkpointable=bool(blocks) and refused is None,
        checkpointing_refused=refused,
        checkpointing_futile=checkpointing_futile(model, blocks) if blocks and refused is None else None,
        repeated_blocks=len(blocks),
        has_dataset=workload.build_dataset is not None,
    )


def _weights(param: torch.Tensor) -> int:
    """The weights a parameter holds: a quantized one (bitsandbytes' 4-bit, two to a byte) keeps
    its original shape in its ``quant_state``."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else param.numel()


_OPTIMIZER_SETTINGS = ("momentum", "dampening", "nesterov", "betas", "eps", "weight_decay", "amsgrad",
                       "alpha", "centered", "lr_decay")


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict:
    """Param group 0's hyperparameters that other runners' optimizers take (finite numbers,
    bools and pairs of them; JSON holds nothing else)."""
    group = optimizer.param_groups[0]

    def plain(value):
        if isinstance(value, bool):
            return True
        if isinstance(value, (int, float)):
            return math.isfinite(value)
        return isinstance(value, (tuple, list)) and all(plain(v) and not isinstance(v, bool) for v in value)

    return {key: (list(group[key]) if isinstance(group[key], tuple) else group[key])
            for key in _OPTIMIZER_SETTINGS if key in group and plain(group[key])}


def _dataset_size(workload: Workload) -> int | None:
    # Only for warmup advice in optimizer steps; an unsized (iterable) dataset gives none.
    if workload.build_dataset is None:
        return None
    dataset = workload.build_dataset()
    if workload.collate_fn is None:
        # Before any probe: `autotune train` would fail in its first step otherwise.
        check_default_collate(dataset, source=workload.source)
    try:
        return len(dataset)
    except TypeError:
        return None


def current_versions() -> dict:

    return {"autotune": __version__, "torch": torch.__version__, "cuda": torch.version.cuda}


