"""What ``plan()`` was asked, checked before any work: every option on its own and against the
others, in the caller's words (``precision=`` from Python, ``--precision`` from the CLI)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..distributed import environment
from ..distributed.layout import Layout
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
    gpus_per_node: int | None = None
    """--gpu only: GPUs per host (the host boundary for communication); default: the profile's."""
    network_gbps: float | None = None
    """--gpu only: each GPU's share of the network between hosts, Gb/s; default: the profile's."""
    eval_batch: bool = True
    max_eval_batch: int | None = None
    parallel: Layout = Layout()
    """The tensor/context/pipeline split (``plan(tp=, cp=, pp=, ...)``)."""
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
        data_parallel = self.parallel.data_parallel(self.world_size)
        if not self.parallel.trivial and self.sharding == "ddp":
            raise ConfigError(f"{given('sharding', 'ddp')} with {self.parallel.describe_degrees()}: "
                              f"model-parallel layouts train with FSDP2 over their data-parallel "
                              f"ranks; use {given('sharding', 'fsdp')} or auto")
        if self.shard_group is not None:
            resolve_shard_group(self.shard_group, data_parallel, option=option("shard_group"))
        for name, value in (("gpus_per_node", self.gpus_per_node), ("network_gbps", self.network_gbps)):
            if value is not None and self.gpu is None:
                raise ConfigError(f"{given(name, value)} describes the hosts of a GPU you plan for "
                                  f"without it; add {option('gpu')} NAME, or drop {option(name)}")
        if self.network_gbps is not None and not (isinstance(self.network_gbps, (int, float))
                                                  and math.isfinite(self.network_gbps)
                                                  and self.network_gbps > 0):
            raise ConfigError(f"{given('network_gbps', self.network_gbps)}: give each GPU's share of "
                              f"the network between hosts in Gb/s, a positive number such as 400")
        if self.gpus_per_node is not None and not (isinstance(self.gpus_per_node, int)
                                                   and self.gpus_per_node >= 1):
            raise ConfigError(f"{given('gpus_per_node', self.gpus_per_node)}: give the GPUs in one "
                              f"host, a whole number of at least 1")
        if throughput and self.gpu is None and self.sharding not in ("auto", "ddp"):
            raise ConfigError(f"{given('optimize', 'throughput')} measures replicated (ddp) "
                              f"configurations in one process; use {given('optimize', 'memory')} with "
                              f"{given('sharding', self.sharding)}")
        if throughput and self.gpu is None and not self.parallel.trivial:
            raise ConfigError(f"{given('optimize', 'throughput')} measures replicated (ddp) "
                              f"configurations in one process; use {given('optimize', 'memory')} with "
                              f"{self.parallel.describe_degrees()}")
