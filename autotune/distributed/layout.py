"""A plan's parallel layout: how the world's ranks divide the model besides sharding it.

Pure values, no process group or device needed. A ``Layout`` says how many ranks split each
layer's matrices (``tp``, tensor parallel), each sample's sequence (``cp``, context parallel) and
the stack of blocks (``pp``, pipeline parallel, with its schedule); the ranks left over are the
data-parallel ones, which replicate (DDP) or shard (FSDP2) what each of those ranks holds. Every
rank of one data-parallel group computes on the same samples, so a plan's split divides the target
batch over ``data_parallel(world_size)`` ranks, not over the world.

The mesh follows torchtitan's dimension order (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``,
``tp``; the last varies fastest), so tensor- and context-parallel groups are runs of neighbouring
ranks and stay inside a host when the host's GPU count is a multiple of ``tp × cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import Choice
from ..errors import ConfigError, given, option

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class PipelineSchedule(Choice):
    """How a pipeline orders its micro-batches' forward and backward passes.

    - ``1f1b``: one forward, one backward (``Schedule1F1B``); one stage per rank.
    - ``interleaved-1f1b``: 1F1B over several stages per rank (``ScheduleInterleaved1F1B``): a
      smaller bubble for more send/recv.
    - ``zero-bubble``: backward split into input and weight gradients, the weight part filling the
      bubble (``ScheduleInterleavedZeroBubble``); several stages per rank.
    """

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZERO_BUBBLE = "zero-bubble"

    @property
    def interleaved(self) -> bool:
        """Runs several stages per rank."""
        return self is not PipelineSchedule.ONE_F_ONE_B


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Model-parallel degrees of a plan; the default (all 1) is plain data parallelism."""

    tp: int = 1
    """Ranks that split each layer's weight matrices (tensor parallel, with sequence parallel
    for the norms): a divisor of the attention heads."""
    cp: int = 1
    """Ranks that split each sample's sequence (context parallel, ring attention over SDPA)."""
    pp: int = 1
    """Pipeline stages' ranks: the repeated blocks split into ``pp × stages_per_rank`` stages."""
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    stages_per_rank: int = 1
    """Pipeline stages each pipeline rank runs (interleaved schedules: at least 2)."""

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "stages_per_rank"):
            check_degree(name, getattr(self, name))
        object.__setattr__(self, "pp_schedule", PipelineSchedule.parse(self.pp_schedule,
                                                                       option=option("pp_schedule")))
        if self.pp == 1 and (self.stages_per_rank != 1 or self.pp_schedule.interleaved):
            raise ConfigError(f"{given('pp_schedule', self.pp_schedule.value)} and "
                              f"{given('stages_per_rank', self.stages_per_rank)} describe a pipeline, "
                              f"and {given('pp', 1)} has none; add {option('pp')} N (N ≥ 2) or drop them")
        if self.pp_schedule.interleaved and self.stages_per_rank < 2:
            raise ConfigError(f"{given('pp_schedule', self.pp_schedule.value)} runs several stages per "
                              f"rank and {given('stages_per_rank', self.stages_per_rank)} is one; use "
                              f"{option('stages_per_rank')} 2 or more, or {given('pp_schedule', '1f1b')}")
        if not self.pp_schedule.interleaved and self.stages_per_rank != 1:
            raise ConfigError(f"{given('pp_schedule', '1f1b')} runs one stage per rank, not "
                              f"{self.stages_per_rank}; use {given('pp_schedule', 'interleaved-1f1b')} "
                              f"or {option('stages_per_rank')} 1")

    @property
    def model_parallel(self) -> int:
        """Ranks that together hold one copy of the model's computation (tp × cp × pp)."""
        return self.tp * self.cp * self.pp

    @property
    def trivial(self) -> bool:
        """Data parallelism alone (every degree 1)."""
        return self.model_parallel == 1

    @property
    def stages(self) -> int:
        """Pipeline stages in all (1 without a pipeline)."""
        return self.pp * self.stages_per_rank

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel ranks: ranks that see different samples."""
        self.check_world(world_size)
        return world_size // self.model_parallel

    def check_world(self, world_size: int) -> None:
        """A ConfigError unless tp × cp × pp divides ``world_size``."""
        if world_size % self.model_parallel:
            lower = world_size - world_size % self.model_parallel
            fits = [n for n in (lower, lower + self.model_parallel) if n > 0]
            raise ConfigError(f"{self.describe_degrees()} needs a world size that is a multiple of "
                              f"{self.model_parallel}, and {given('world_size', world_size)} is not; "
                              f"use {' or '.join(map(str, fits))} ranks, or smaller degrees")

    def check_hosts(self, gpus_per_node: int | None) -> None:
        """Tensor- and context-parallel groups talk every layer: keep each inside one host."""
        if gpus_per_node is None:
            return
        inside = self.tp * self.cp
        if inside > gpus_per_node or gpus_per_node % inside:
            raise ConfigError(f"{self.describe_degrees()} puts {inside} ranks in each tensor/context-"
                              f"parallel group, which must stay inside one host of "
                              f"{given('gpus_per_node', gpus_per_node)}; use tp × cp dividing "
                              f"{gpus_per_node}, or more GPUs per host")

    def check_model(self, *, heads: int | None = None, kv_heads: int | None = None,
                    blocks: int | None = None) -> None:
        """The limits a model sets: tp divides the attention (and key/value) heads, and the
        pipeline has at most one repeated block per stage."""
        for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
            if count is not None and self.tp > 1 and count % self.tp:
                divisors = [d for d in range(1, count + 1) if count % d == 0]
                raise ConfigError(f"{given('tp', self.tp)} does not divide the model's {count} {name}: "
                                  f"each tensor-parallel rank takes whole heads; use one of "
                                  f"{', '.join(map(str, divisors))}")
        if blocks is not None and self.stages > blocks:
            raise ConfigError(f"{self.describe_degrees()} needs {self.stages} pipeline stages and the "
                              f"model has {blocks} repeated block(s), at least one per stage; use "
                              f"{option('pp')} × {option('stages_per_rank')} ≤ {blocks}")

    def mesh_dims(self, world_size: int, shard_group: int | None = None) -> list[tuple[str, int]]:
        """The device mesh's (name, size) dims, in ``MESH_ORDER``, leaving out the size-1 ones
        except ``dp_shard``. ``shard_group``: data-parallel ranks that share one sharded copy
        (hybrid sharding), default all of them."""
        dp = self.data_parallel(world_size)
        group = dp if shard_group is None else shard_group
        if dp % group:
            raise ConfigError(f"{given('shard_group', group)} does not divide the {dp} data-parallel "
                              f"ranks of {self.describe_degrees()} on {world_size}")
        sizes = {"pp": self.pp, "dp_replicate": dp // group, "dp_shard": group, "cp": self.cp,
                 "tp": self.tp}
        return [(name, sizes[name]) for name in MESH_ORDER if sizes[name] > 1 or name == "dp_shard"]

    def coordinates(self, rank: int, world_size: int, shard_group: int | None = None) -> dict[str, int]:
        """``rank``'s index along each mesh dim (row-major, the last dim fastest)."""
        dims = self.mesh_dims(world_size, shard_group)
        coords = {}
        for name, size in reversed(dims):
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name, _ in dims}

    def data_rank(self, rank: int, world_size: int) -> int:
        """Which data-parallel rank ``rank`` is (ranks with the same one see the same samples)."""
        # dp_replicate and dp_shard are neighbours in the mesh order, so a rank's data-parallel
        # index is the same however they divide the data-parallel ranks.
        return self.coordinates(rank, world_size)["dp_shard"]

    def describe_degrees(self) -> str:
        """"tp 8 × pp 4 (interleaved-1f1b, 2 stages per rank)", or "no model parallelism"."""
        parts = [f"{name} {getattr(self, name)}" for name in ("tp", "cp", "pp") if getattr(self, name) > 1]
        if not parts:
            return "no model parallelism"
        return " × ".join(parts) + self._pipeline_suffix()

    def describe(self, world_size: int, data_parallel_name: str) -> str:
        """The whole layout as torchtitan's runs are described: "FSDP 32 × TP 8" (the
        data-parallel part named ``data_parallel_name``, e.g. "FSDP" or "DDP")."""
        parts = [f"{data_parallel_name} {self.data_parallel(world_size)}"]
        parts += [f"{name.upper()} {getattr(self, name)}" for name in ("tp", "cp", "pp")
                  if getattr(self, name) > 1]
        return " × ".join(parts) + self._pipeline_suffix()

    def _pipeline_suffix(self) -> str:
        """" (interleaved-1f1b, 2 stages per rank)" for a pipeline, else nothing."""
        if self.pp == 1:
            return ""
        stages = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
        return f" ({self.pp_schedule}{stages})"

    def to_dict(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "pp_schedule": self.pp_schedule.value,
                "stages_per_rank": self.stages_per_rank}

    @classmethod
    def from_dict(cls, data: dict | None) -> "Layout":
        return cls(**(data or {}))


def check_degree(name: str, value, *, auto_taken: bool = False) -> None:
    """Raises ``ConfigError`` unless ``value`` is a positive int (``auto_taken``: where "auto" is
    also taken, the message says so)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = ' or "auto" to search it' if auto_taken else ""
        raise ConfigError(f"{given(name, value)} is not a number of ranks; give a positive int "
                          f"(1: not split this way){also}")


def parse_layout(*, tp=1, cp=1, pp=1, pp_schedule=None, stages_per_rank=None) -> Layout:
    """A ``Layout`` from options; an interleaved schedule without ``stages_per_rank`` gets 2."""
    schedule = PipelineSchedule.parse(pp_schedule or PipelineSchedule.ONE_F_ONE_B, option=option("pp_schedule"))
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule.interleaved else 1
    return Layout(tp=tp, cp=cp, pp=pp, pp_schedule=schedule, stages_per_rank=stages_per_rank)


__all__ = ["Layout", "MESH_ORDER", "PipelineSchedule", "check_degree", "parse_layout"]
