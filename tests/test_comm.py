"""The communication model: alpha–beta times per collective, the host boundary, the runtime's
overlap, and the links read from GPU profiles (autotune.timing.comm)."""

import math

import pytest

from autotune.errors import ConfigError
from autotune.gpus.catalog import load_profile
from autotune.timing.comm import (Link, Network, call_time, collective_time, exposed_communication,
                                  network_from_profile, ring_exposure)
from autotune.timing.costs import CollectiveCall

ALPHA, BW = 5e-6, 100e9
LINK = Link(bandwidth=BW, latency=ALPHA)


@pytest.mark.parametrize("kind, factor, steps", [
    ("all_gather", 7 / 8, 3), ("reduce_scatter", 7 / 8, 3), ("all_reduce", 2 * 7 / 8, 6),
    ("broadcast", 1.0, 3), ("all_to_all", 7 / 8, 3), ("send", 1.0, 1), ("recv", 1.0, 1)])
def test_alpha_beta_time_of_each_collective(kind, factor, steps):
    n = 3e9
    assert collective_time(kind, n, 8, LINK) == pytest.approx(steps * ALPHA + factor * n / BW, rel=1e-12)


def test_latency_term_is_a_tree_and_one_rank_costs_nothing():
    # ceil(log2 6) = 3 steps; a group of one moves nothing.
    assert collective_time("all_gather", 0, 6, LINK) == pytest.approx(3 * ALPHA)
    assert collective_time("all_reduce", 1e9, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("gather", 1, 2, LINK)


INTRA, INTER = Link(400e9, 3e-6), Link(50e9, 10e-6)
NET = Network(intra=INTRA, inter=INTER, gpus_per_node=8)


def test_host_boundary_picks_the_link():
    assert NET.link(8) is INTRA
    assert NET.link(16) is INTER
    # Hybrid sharding's replica group: 2 ranks, 8 apart, in a world of 16, crosses hosts.
    assert NET.link(2, world_size=16, contiguous=False) is INTER
    assert NET.link(2, world_size=8, contiguous=False) is INTRA
    unknown = Network(intra=INTRA, inter=None, gpus_per_node=4)
    with pytest.raises(ConfigError, match="--network-gbps"):
        unknown.link(8)


# Unit link (1 B/s, no latency) and groups of 2: an all-gather or reduce-scatter of n bytes takes
# n / 2 s, an all-reduce n s, so the expected exposures below are plain arithmetic.
UNIT = Network(intra=Link(1.0, 0.0), inter=None, gpus_per_node=8)


def calls(phase, kind, sizes):
    return [CollectiveCall(kind=kind, bytes=2 * s, group_size=2, phase=phase) for s in sizes]


def test_fsdp_forward_prefetch_hides_all_but_the_first_gather():
    # 4 blocks, 10 s of forward each: gathers of 3, 12, 8, 15 s -> 3 + (12-10) + 0 + (15-10).
    split = exposed_communication(calls("forward", "all_gather", [3, 12, 8, 15]), {"forward": 40.0}, UNIT)
    assert split.exposed["forward"] == pytest.approx(3 + 2 + 0 + 5)
    assert split.total["forward"] == pytest.approx(38)


def test_fsdp_backward_hides_gather_and_reduce_scatter_pairs_under_each_block():
    # 3 blocks of 5 s backward: gathers 2, 4, 1 and reduce-scatters 3, 2, 6. Exposed: the first
    # gather (2), the last reduce-scatter (6), and per later block the pair past 5 s:
    # (4 + 3 - 5) + (1 + 2 - 5 -> 0).
    timed = calls("backward", "all_gather", [2, 4, 1]) + calls("backward", "reduce_scatter", [3, 2, 6])
    split = exposed_communication(timed, {"backward": 15.0}, UNIT)
    assert split.exposed["backward"] == pytest.approx(2 + 6 + 2 + 0)


def test_recompute_counts_as_backward_compute_and_its_gathers_as_backward():
    timed = calls("recompute", "all_gather", [2, 4, 1]) + calls("backward", "reduce_scatter", [3, 2, 6])
    split = exposed_communication(timed, {"backward": 10.0, "recompute": 5.0}, UNIT)
    assert split.exposed == {"backward": pytest.approx(10)}


def test_ddp_buckets_overlap_the_backward_but_the_last():
    buckets = [CollectiveCall(kind="all_reduce", bytes=b, group_size=2, phase="backward") for b in (4, 6, 3)]
    hidden = exposed_communication(buckets, {"backward": 20.0}, UNIT)
    assert hidden.exposed["backward"] == pytest.approx(3)
    slow = exposed_communication(buckets, {"backward": 7.0}, UNIT)
    assert slow.exposed["backward"] == pytest.approx(3 + (10 - 7))


def test_optimizer_and_forward_all_reduces_are_exposed():
    timed = (calls("optimizer", "all_reduce", [1, 1])
             + [CollectiveCall(kind="all_reduce", bytes=5, group_size=2, phase="forward")])
    split = exposed_communication(timed, {"forward": 100.0, "optimizer": 100.0}, UNIT)
    assert split.exposed == {"optimizer": pytest.approx(4), "forward": pytest.approx(5)}


def test_links_from_the_h100_profile_and_overrides():
    h100 = load_profile("h100-80gb")
    net = network_from_profile(h100)
    assert net.intra.bandwidth == pytest.approx(450e9)  # NVLink 4: 900 GB/s both ways
    assert net.inter.bandwidth == pytest.approx(400e9 / 8)  # NDR 400 Gb/s per GPU
    assert net.intra.latency == pytest.approx(3.4e-6) and net.inter.latency == pytest.approx(9.6e-6)
    assert net.gpus_per_node == 8
    faster = network_from_profile(h100, network_gbps=800, gpus_per_node=4)
    assert faster.inter.bandwidth == pytest.approx(100e9) and faster.gpus_per_node == 4
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ConfigError, match="--network-gbps"):
            network_from_profile(h100, network_gbps=bad)
    with pytest.raises(ConfigError, match="--gpus-per-node"):
        network_from_profile(h100, gpus_per_node=0)


def test_a_profile_without_a_network_plans_within_one_host_only():
    net = network_from_profile(load_profile("rtx-4090"))
    assert net.inter is None and net.link(8) is net.intra
    assert network_from_profile(load_profile("rtx-4090"), network_gbps=25).inter.bandwidth == pytest.approx(25e9 / 8)


def test_profile_link_fields_are_checked(tmp_path):
    from test_profiles import GOOD, write

    assert load_profile(write(tmp_path, GOOD)).gpu_link_gb_per_s is None  # optional: older files load
    good = load_profile(write(tmp_path, GOOD + "gpu_link_gb_per_s = 300\nnetwork_gbps = 200\n"
                                          "gpu_link_latency_us = 3\nnetwork_latency_us = 9\n"
                                          "gpus_per_node = 4\n", "links.toml"))
    assert (good.gpu_link_gb_per_s, good.network_gbps, good.gpus_per_node) == (300, 200, 4)
    for line in ("gpu_link_gb_per_s = 0", "network_latency_us = -1", "gpus_per_node = 2.5",
                 "gpus_per_node = 0"):
        with pytest.raises(ConfigError, match=line.split()[0]):
            load_profile(write(tmp_path, GOOD + line + "\n", "bad.toml"))
    with pytest.raises(ConfigError, match="gpu_link_gb_per_s"):
        network_from_profile(load_profile(write(tmp_path, GOOD)))


def test_ring_attention_hides_each_collective_under_one_ring_step_but_a_backward_rings_last():
    # torch's ring (cp 4, its default all-gather rotation): per block a key/value all-gather in
    # forward (waited after the first step's kernel), in backward another, then one gradient
    # all-to-all per step, each waited after the next step's kernel, the last after the ring.
    def ring(kind, phase, nbytes):
        return CollectiveCall(kind=kind, bytes=nbytes, group_size=4, phase=phase, ring=True)

    gather, grads = 400e6, 100e6
    calls = [ring("all_gather", "forward", gather), ring("all_gather", "recompute", gather),
             ring("all_gather", "backward", gather), *[ring("all_to_all", "backward", grads)] * 4,
             ring("all_gather", "recompute", gather), ring("all_gather", "backward", gather),
             *[ring("all_to_all", "backward", grads)] * 4]
    t_gather, t_a2a = (call_time(calls[0], NET), call_time(calls[3], NET))
    cover = {"forward": 0.5 * t_gather, "recompute": 2 * t_gather, "backward": 0.5 * t_a2a}
    split = ring_exposure(calls, cover, NET)
    assert split.total["forward"] == pytest.approx(t_gather)
    assert split.exposed["forward"] == pytest.approx(0.5 * t_gather)
    assert split.exposed["recompute"] == 0.0 and split.total["recompute"] == pytest.approx(2 * t_gather)
    # Backward: 2 gathers and 6 all-to-alls half hidden, the 2 rings' last all-to-alls whole.
    assert split.exposed["backward"] == pytest.approx(2 * (t_gather - 0.5 * t_a2a) + 6 * 0.5 * t_a2a + 2 * t_a2a)
    with pytest.raises(ValueError, match="ring_exposure"):
        exposed_communication(calls, {"forward": 1.0, "backward": 1.0}, NET)
