"""Communication time: every collective of a step timed by an alpha–beta model, and what of it the
runtime leaves exposed.

A collective over ``p`` ranks moving ``n`` bytes takes ``steps * alpha + factor * n / bandwidth``:

- all-gather and reduce-scatter: ring factor ``(p - 1) / p`` (``n`` is the whole, unsharded
  buffer: each rank sends and receives all shards but its own);
- all-reduce: ``2 (p - 1) / p`` (a reduce-scatter then an all-gather);
- broadcast: ``1`` (pipelined), all-to-all: ``(p - 1) / p``, send/recv: ``1``;
- latency: a tree's ``ceil(log2 p)`` steps (twice for all-reduce; one for send/recv), as NCCL's
  tree and PAT algorithms take over where latency matters.

The link is the slowest the group crosses: a group within one host runs over the GPU-to-GPU links
(NVLink, else PCIe), one spanning hosts over each GPU's network share. A group of consecutive ranks
(FSDP's shard group, a whole world) spans hosts when it has more ranks than a host has GPUs; the
replica group of hybrid sharding (ranks a shard group apart) spans hosts whenever the world does.

Overlap is the runtime's own (``exposed_communication``):

- FSDP2 forward: the next block's all-gather is prefetched while this block computes, so the first
  all-gather is exposed and each later one only by what exceeds a block's compute;
- FSDP2 backward: the all-gather of the block before and the reduce-scatter of the block after run
  under this block's backward; the last reduce-scatter has nothing left to hide behind;
- DDP: bucket all-reduces run under the backward; the last bucket is exposed;
- all-reduces outside the backward (tensor parallelism's, gradient-norm clipping's) and every
  collective of the optimizer phase are exposed.

Blocks are taken as equal: a phase's compute is split evenly over its collectives of one kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv", "all_to_all")


@dataclass(frozen=True)
class Link:
    """One GPU's share of a link: bandwidth in bytes/s (one direction) and latency per step (s)."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ConfigError(f"link bandwidth {self.bandwidth!r} B/s must be a positive number")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ConfigError(f"link latency {self.latency!r} s must be a number of seconds, 0 or more")


@dataclass(frozen=True)
class Network:
    """Where the host boundary is and the links on either side of it."""

    intra: Link
    """GPU to GPU within a host (NVLink, else PCIe)."""
    inter: Link | None
    """Each GPU's share of the network between hosts; None where unknown (then only groups within
    one host can be timed)."""
    gpus_per_node: int

    def link(self, group_size: int, *, world_size: int | None = None, contiguous: bool = True) -> Link:
        """The link a group of ``group_size`` ranks is bound by (see the module's docstring)."""
        span = group_size if contiguous or world_size is None else world_size
        if span <= self.gpus_per_node:
            return self.intra
        if self.inter is None:
            raise ConfigError(f"a group of {span} ranks spans hosts of {self.gpus_per_node} GPUs "
                              f"(--gpus-per-node), and the GPU profile has no network figures; "
                              f"give --network-gbps (each GPU's share of the network, Gb/s)")
        return self.inter


def terms(kind: str, group_size: int) -> tuple[float, int]:
    """(bandwidth factor, latency steps) of one collective over ``group_size`` ranks."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")
    p = group_size
    if p <= 1 and kind not in ("send", "recv"):
        return 0.0, 0
    tree = math.ceil(math.log2(p)) if p > 1 else 1
    return {
        "all_gather": ((p - 1) / p, tree),
        "reduce_scatter": ((p - 1) / p, tree),
        "all_reduce": (2 * (p - 1) / p, 2 * tree),
        "broadcast": (1.0, tree),
        "all_to_all": ((p - 1) / p, tree),
        "send": (1.0, 1),
        "recv": (1.0, 1),
    }[kind]


def collective_time(kind: str, nbytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective (the alpha–beta model of the module's docstring)."""
    factor, steps = terms(kind, group_size)
    return steps * link.latency + factor * nbytes / link.bandwidth


@dataclass(frozen=True)
class CommSplit:
    """A step's communication: all of it and what is exposed, in seconds, by phase."""

    total: dict
    exposed: dict

    @property
    def total_s(self) -> float:
        return sum(self.total.values())

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed.values())


def call_time(call, network: Network, *, world_size: int | None = None, hybrid: bool = False) -> float:
    """One recorded collective (a ``CollectiveCall``) on ``network``. ``hybrid``: hybrid sharding,
    whose all-reduces run across replica groups (ranks a shard group apart)."""
    contiguous = not (hybrid and call.kind == "all_reduce")
    link = network.link(call.group_size, world_size=world_size, contiguous=contiguous)
    return collective_time(call.kind, call.bytes, call.group_size, link)


def exposed_communication(calls, compute_s: dict, network: Network, *, world_size: int | None = None,
                          hybrid: bool = False) -> CommSplit:
    """What of ``calls`` (CollectiveCalls in the order the step issued them) the runtime leaves
    exposed, given the compute seconds of each phase (forward, backward, recompute, optimizer)."""
    by_phase: dict[str, list[tuple[str, float]]] = {}
    for call in calls:
        if call.ring:
            raise ValueError("ring attention's collectives overlap its own steps: ring_exposure")
        seconds = call_time(call, network, world_size=world_size, hybrid=hybrid)
        # FSDP2 gathers a checkpointed block before its recompute: one backward for the overlap.
        phase = "backward" if call.phase == "recompute" else call.phase
        by_phase.setdefault(phase, []).append((call.kind, seconds))
    total = {phase: sum(s for _, s in timed) for phase, timed in by_phase.items()}
    forward = compute_s.get("forward", 0.0)
    # Checkpointed blocks recompute their forward inside the backward, under the same prefetch.
    backward = compute_s.get("backward", 0.0) + compute_s.get("recompute", 0.0)
    exposed = {}
    for phase, timed in by_phase.items():
        if phase == "forward":
            exposed[phase] = _prefetched(timed, forward)
        elif phase == "backward":
            exposed[phase] = _under_backward(timed, backward)
        else:
            exposed[phase] = sum(s for _, s in timed)
    return CommSplit(total=total, exposed=exposed)


def ring_exposure(calls, cover: dict, network: Network, *, world_size: int | None = None) -> CommSplit:
    """Context parallelism's ring collectives (``CollectiveCall.ring``, in the order the step
    issued them) as torch's ring attention overlaps them (``_templated_ring_attention`` and its
    backward, torch/distributed/tensor/experimental/_context_parallel/_attention.py): each is
    waited for after one ring step's attention kernel, which hides it (``cover``: one attention
    kernel's seconds, by phase): the key/value all-gather under the first step's, each gradient
    all-to-all under the next step's. The last all-to-all of a backward ring is waited for after
    the ring's last step, with nothing left to hide it: exposed whole."""
    total: dict[str, float] = {}
    exposed: dict[str, float] = {}
    for i, call in enumerate(calls):
        seconds = call_time(call, network, world_size=world_size)
        following = calls[i + 1] if i + 1 < len(calls) else None
        ends_ring = (call.phase == "backward" and call.kind == "all_to_all"
                     and (following is None or following.kind != "all_to_all" or following.phase != "backward"))
        hidden = 0.0 if ends_ring else cover.get(call.phase, 0.0)
        total[call.phase] = total.get(call.phase, 0.0) + seconds
        exposed[call.phase] = exposed.get(call.phase, 0.0) + max(0.0, seconds - hidden)
    return CommSplit(total=total, exposed=exposed)


def _prefetched(timed, compute: float) -> float:
    """FSDP2's forward: the first all-gather waits, each later one hides under a block's compute."""
    gathers = [s for kind, s in timed if kind == "all_gather"]
    others = sum(s for kind, s in timed if kind != "all_gather")
    if not gathers:
        return others
    per_block = compute / len(gathers)
    return others + gathers[0] + sum(max(0.0, s - per_block) for s in gathers[1:])


def _under_backward(timed, compute: float) -> float:
    """The backward's collectives. FSDP2: block i's backward hides the all-gather of the block
    before it and the reduce-scatter of the block after it (they share the links), so the first
    all-gather and the last reduce-scatter are exposed, and each block's pair only by what exceeds
    its compute. DDP (no all-gathers): the buckets' all-reduces run under the rest of the backward,
    the last bucket exposed."""
    gathers = [s for kind, s in timed if kind == "all_gather"]
    reduces = [s for kind, s in timed if kind in ("reduce_scatter", "all_reduce")]
    exposed = sum(s for kind, s in timed if kind not in ("all_gather", "reduce_scatter", "all_reduce"))
    if not gathers:
        return exposed + (reduces[-1] + max(0.0, sum(reduces[:-1]) - compute) if reduces else 0.0)
    # Pair block i's backward with the all-gather after the first and the reduce-scatter before
    # the last: the first all-gather and the last reduce-scatter have no compute to hide under.
    exposed += gathers[0] + (reduces[-1] if reduces else 0.0)
    later, earlier = gathers[1:], reduces[:-1]
    pairs = max(len(later), len(earlier))
    if not pairs:
        return exposed
    per_block = compute / (pairs + 1)
    later, earlier = later + [0.0] * pairs, earlier + [0.0] * pairs
    return exposed + sum(max(0.0, later[i] + earlier[i] - per_block) for i in range(pairs))


def network_from_profile(profile, *, gpus_per_node: int | None = None,
                         network_gbps: float | None = None) -> Network:
    """The profile's links, with ``--gpus-per-node`` and ``--network-gbps`` in their place."""
    if profile.gpu_link_gb_per_s is None:
        raise ConfigError(f"GPU profile {profile.id} has no gpu_link_gb_per_s (GPU-to-GPU bandwidth "
                          f"within a host); add it (and gpu_link_latency_us) to time communication")
    intra = Link(profile.gpu_link_gb_per_s * 1e9, profile.gpu_link_latency_us * 1e-6)
    gbps = network_gbps if network_gbps is not None else profile.network_gbps
    if network_gbps is not None and not (math.isfinite(network_gbps) and network_gbps > 0):
        raise ConfigError(f"--network-gbps {network_gbps}: give each GPU's share of the network "
                          f"between hosts in Gb/s, a positive number such as 400")
    inter = (Link(gbps * 1e9 / 8, profile.network_latency_us * 1e-6) if gbps is not None else None)
    per_node = gpus_per_node if gpus_per_node is not None else profile.gpus_per_node
    if not (isinstance(per_node, int) and per_node >= 1):
        raise ConfigError(f"--gpus-per-node {per_node}: give the GPUs in one host, a whole number "
                          f"of at least 1")
    return Network(intra=intra, inter=inter, gpus_per_node=per_node)


__all__ = ["CommSplit", "KINDS", "Link", "Network", "call_time", "collective_time",
           "exposed_communication", "network_from_profile", "terms"]
