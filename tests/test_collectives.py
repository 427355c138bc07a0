"""Collectives that leave nothing of this process with gloo's worker threads (autotune.distributed.collectives).

A rank whose last act was a plain gloo collective could abort at exit ("terminate called without an
active exception"): the worker thread still held the tensor and needed the GIL to free it while the
interpreter shut down. Seen in CI, under load, at the end of torchrun runs of plan() and train().
"""

import pytest
import torch
import torch.distributed as dist

from autotune.distributed import collectives


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_collective_returns_only_once_no_worker_holds_its_tensor(gloo_group):
    # A plain dist.all_reduce returned with the worker still holding its tensor in about 1 call
    # in 40 here (torch 2.14): 400 calls would show it.
    for value in range(400):
        tensor = torch.full((4,), float(value))
        assert collectives.all_reduce(tensor) is tensor
        assert tensor._use_count() == 1  # this Python reference only
        assert tensor.tolist() == [float(value)] * 4
    assert collectives.min_across_ranks(7) == 7


def test_settle_runs_one_collective_per_worker_thread(gloo_group, monkeypatch):
    seen = []
    monkeypatch.setattr(collectives, "_wait_released", lambda tensor: seen.append(tensor._use_count()))
    collectives.settle()
    assert len(seen) == collectives._worker_threads() == 2  # gloo's default


def test_settle_waits_until_every_worker_thread_sleeps(gloo_group, monkeypatch):
    # A worker the others beat to settle's collectives may still hold a tensor of an earlier one,
    # runnable but not yet scheduled: CI saw a rank of a 4-rank FSDP run abort at exit so. Settle
    # returns after two polls in a row that find every worker asleep.
    states = iter([["R", "S"], ["S", "S"], ["S", "D"], ["S", "S"], ["S", "S"], ["R", "R"]])
    polls = []
    monkeypatch.setattr(collectives, "_worker_states", lambda: polls.append(1) or next(states))
    collectives.settle()
    assert len(polls) == 5


def test_the_worker_threads_are_found_by_name():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        collectives.all_reduce(torch.zeros(1))
        # Process groups of earlier tests in this process may have left workers of their own.
        assert len(collectives._worker_states()) >= collectives._worker_threads()
        collectives.settle()
        assert set(collectives._worker_states()) == {"S"}
    finally:
        dist.destroy_process_group()


def test_settle_without_a_process_group_does_nothing():
    assert not dist.is_initialized()
    collectives.settle()


def test_only_the_ranks_of_a_real_process_group_agree_on_trials(gloo_group):
    # The estimate's fake process group (one process standing for N ranks) has no other ranks
    # to agree with; its trials keep raising at the budget, which is what makes them quick.
    from autotune.distributed.environment import real_ranks as _real_ranks
    from autotune.distributed.sharding.ranks import fake_process_group

    assert _real_ranks() == 1  # a real group, but of one rank
    dist.destroy_process_group()
    try:
        with fake_process_group(4):
            assert dist.get_world_size() == 4 and _real_ranks() == 1
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_oom_recovery_on_a_ddp_without_the_reset_hook_names_the_torch_and_the_way_out():
    from autotune.distributed import process_group
    from autotune.errors import TrainError

    model = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    object.__setattr__(model, "reducer", object())  # a reducer without _reset_state
    with pytest.raises(TrainError) as caught:
        process_group.forget_failed_window(model)
    message = str(caught.value)
    assert torch.__version__ in message and "reducer._reset_state" in message and "headroom" in message
