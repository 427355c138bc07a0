"""``autotune.plan()``: the one impure step of planning.

It inspects the workload (parameter bytes, optimizer, BatchNorm), probes the settings the request
needs, and hands everything to the pure planner (``autotune.planner``). Under torchrun every rank
probes its own device and the ranks agree on the smallest answer (all-reduce MIN), so they all
build the same plan.
"""

from __future__ import annotations

import datetime
import os

import torch

from .checkpointing import repeated_blocks
from .errors import ConfigError, PlanError, ProbeError
from .memory import backend_for
from .plan import Plan, SettingTried, WorkloadFingerprint
from .planner import (PlanRequest, build_plan, checkpointing_worth_probing, choose_precision,
                      ddp_bucket_bytes, evaluate_setting, usable_bytes)
from .precision import Precision, supports_bf16
from .probe import probe
from .workload import Workload, load_workload

PRECISION_CHOICES = ("auto", *(p.value for p in Precision))
CHECKPOINTING_CHOICES = ("auto", "on", "off")


def plan(
    workload,
    *,
    target_batch: int,
    world_size: int | None = None,
    device=None,
    precision: str = "auto",
    checkpointing: str = "auto",
    memory_limit=None,
    headroom: float = 0.1,
    micro_batch: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    lr_rule: str = "auto",
) -> Plan:
    """Plan how to train ``workload`` at an effective batch of exactly ``target_batch``.

    ``world_size`` defaults to torch.distributed's world size when initialised, else the
    WORLD_SIZE environment variable, else 1. ``precision`` is auto|fp32|bf16|fp16 and
    ``checkpointing`` auto|on|off ("auto": only where it buys something). ``headroom`` is the
    fraction of the budget kept free. ``micro_batch`` pins the micro-batch. ``base_lr`` at
    ``base_batch`` (default: BASE_LR / BASE_BATCH in the model file) is rescaled by ``lr_rule``.
    """
    workload = load_workload(workload)
    if precision not in PRECISION_CHOICES:
        raise ConfigError(f"--precision {precision!r} is not a precision; use one of "
                          f"{', '.join(PRECISION_CHOICES)}")
    distributed = _distributed()
    world_size = _resolve_world_size(world_size, distributed)
    backend = backend_for(device, memory_limit)
    info = backend.info()
    chosen, precision_reason = choose_precision(
        precision, device_kind=backend.device.type, bf16_supported=supports_bf16(backend.device))
    fingerprint = fingerprint_workload(workload)
    request = PlanRequest(
        target_batch=target_batch, world_size=world_size, precision=chosen,
        precision_reason=precision_reason, checkpointing=checkpointing, headroom=headroom,
        micro_batch=micro_batch, lr_rule=lr_rule,
        base_lr=base_lr if base_lr is not None else workload.base_lr,
        base_batch=base_batch if base_batch is not None else workload.base_batch,
        dataset_size=_dataset_size(workload), distributed=distributed,
    )
    if checkpointing == "on" and not fingerprint.checkpointable:
        raise PlanError(f"--checkpointing on: {workload.source} has no repeated blocks (an "
                        f"nn.ModuleList or nn.Sequential of layers) to checkpoint; use auto or off")
    usable = usable_bytes(info.budget_bytes, headroom)
    extra = ddp_bucket_bytes(world_size, fingerprint.param_bytes)
    agree = _min_across_ranks if distributed else None

    def try_setting(checkpoint: bool) -> SettingTried:
        setting = _probe_setting(workload, backend, chosen, checkpoint, request.wanted_micro_batch)
        return evaluate_setting(setting, usable=usable, extra_bytes=extra, agree=agree)

    settings = [try_setting(checkpointing == "on")]
    if checkpointing_worth_probing(settings[0], request, fingerprint):
        settings.append(try_setting(True))
    return build_plan(request, workload=fingerprint, settings=settings, device=info,
                      versions=current_versions(),
                      created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _probe_setting(workload, backend, precision: str, checkpoint: bool, upper: int) -> SettingTried:
    try:
        result = probe(workload, precision=precision, checkpointing=checkpoint, max_micro_batch=upper,
                       backend=backend)
    except ProbeError as exc:
        # Not fitting is an answer for this setting (another may fit); the message is kept.
        return SettingTried(precision=precision, checkpointing=checkpoint, error=str(exc))
    return SettingTried(precision=precision, checkpointing=checkpoint, probe=result)


def fingerprint_workload(workload: Workload) -> WorkloadFingerprint:
    """What the plan needs to know about the model: sizes, optimizer, BatchNorm, repeated blocks."""
    model = workload.new_model()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optimizer = workload.new_optimizer(trainable) if trainable else None
    lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
    return WorkloadFingerprint(
        source=workload.source,
        file_sha256=workload.file_sha256,
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in trainable),
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        optimizer_lr=float(lr) if isinstance(lr, (int, float)) else None,
        batchnorm=any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        checkpointable=any(any(True for _ in b.parameters()) for b in repeated_blocks(model)),
    )


def _dataset_size(workload: Workload) -> int | None:
    # Only for warmup advice in optimizer steps; an unsized (iterable) dataset gives none.
    if workload.build_dataset is None:
        return None
    dataset = workload.build_dataset()
    try:
        return len(dataset)
    except TypeError:
        return None


def current_versions() -> dict:
    from . import __version__  # imported late: the package imports this module

    return {"autotune": __version__, "torch": torch.__version__, "cuda": torch.version.cuda}


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _resolve_world_size(world_size: int | None, distributed: bool) -> int:
    if distributed:
        ranks = torch.distributed.get_world_size()
        if world_size is not None and world_size != ranks:
            raise ConfigError(f"--world-size {world_size} differs from the {ranks} ranks torchrun "
                              f"started; omit --world-size or launch {world_size} processes")
        return ranks
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return 1
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={env!r} is not a positive int; "
                          f"unset it or pass --world-size N")
    return value


def _min_across_ranks(value: int) -> int:
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())
