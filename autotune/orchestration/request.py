"""What ``plan()`` was asked, checked before any work: every option on its own and against the
others, in the caller's words (``precision=`` from Python, ``--precision`` from the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed import environment
from ..distributed.sharding.settings import Sharding, resolve_shard_group
from ..errors import ConfigError, given, option
from ..precision import Precision
from ..tuning.search import DEFAULT_BUDGET_S, check_storage, parse_duration
from ..workload.checkpoint_count import CheckpointingRequest

PRECISION_CHOICES = ("auto", *(p.value for p in Precision))
OPTIMIZE_CHOICES = ("memory", "throughput")


@dataclass
class PlanOptions:
    """``plan()``'s keyword arguments. ``world_size`` becomes the resolved one (torchrun's,
    WORLD_SIZE's or 1); ``budget_s`` is the throughput search's budget in seconds."""

    target_batch: int
    world_size: int | None = None
    device: object = None
    precision: str = "auto"
    checkpointing: object = "auto"
    memory_limit: object = None
    headroom: float = 0.1
    micro_batch: int | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    lr_rule: str = "auto"
    optimize: str = "memory"
    budget: object = DEFAULT_BUDGET_S
    storage: str | None = None
    gpu: object = None
    grad_scaler: object = None
    even: bool = False
    sharding: str = "auto"
    shard_group: int | None = None
    eval_batch: bool = True
    max_eval_batch: int | None = None
    distributed: bool = False
    """Set here: planned by every rank of a torchrun launch."""
    budget_s: float | None = None
    """Set here: ``budget`` in seconds (throughput only)."""

    def __post_init__(self):
        self.checkpointing = CheckpointingRequest.parse(self.checkpointing, option=option("checkpointing"))
        if self.sharding != "auto":
            Sharding.parse(self.sharding)
        if self.precision not in PRECISION_CHOICES:
            raise ConfigError(f"{given('precision', self.precision)} is not a precision; use one of "
                              f"{', '.join(PRECISION_CHOICES)}")
        if self.optimize not in OPTIMIZE_CHOICES:
            raise ConfigError(f"{given('optimize', self.optimize)} is not a goal; use one of "
                              f"{', '.join(OPTIMIZE_CHOICES)}")
        throughput = self.optimize == "throughput"
        if self.even and throughput:
            raise ConfigError(f"{option('even')} with {given('optimize', 'throughput')}: the throughput "
                              f"search measures uneven splits too; use {given('optimize', 'memory')} with "
                              f"{option('even')}, or {option('micro_batch')} N with N dividing the "
                              f"per-device share")
        if throughput:
            self.budget_s = parse_duration(self.budget, option=option("budget"))
            check_storage(self.storage)
        if self.max_eval_batch is not None and (isinstance(self.max_eval_batch, bool) or not isinstance(
                self.max_eval_batch, int) or self.max_eval_batch < 1):
            raise ConfigError(f"{given('max_eval_batch', self.max_eval_batch)} must be a positive "
                              f"int (the largest eval micro-batch to plan), e.g. {option('max_eval_batch')} 256")
        if self.max_eval_batch is not None and not self.eval_batch:
            skip = "--no-eval-batch" if option("eval_batch").startswith("--") else "eval_batch=False"
            raise ConfigError(f"{option('max_eval_batch')} caps the eval batch, which {skip} "
                              f"skips; drop one of them")
        self.distributed = environment.torchrun_group()
        if self.distributed and throughput:
            raise ConfigError(f"{given('optimize', 'throughput')} measures in one process; plan "
                              f"without torchrun (the plan is the same on every rank of identical devices)")
        self.world_size = environment.resolve_world_size(self.world_size, self.distributed)
        if self.shard_group is not None:
            resolve_shard_group(self.shard_group, self.world_size, option=option("shard_group"))
        if throughput and self.sharding not in ("auto", "ddp"):
            raise ConfigError(f"{given('optimize', 'throughput')} measures replicated (ddp) "
                              f"configurations in one process; use {given('optimize', 'memory')} with "
                              f"{given('sharding', self.sharding)}")
