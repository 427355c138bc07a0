"""Same windows whatever the split: samples per optimizer step depend only on seed and epoch."""

import pytest
import torch

from autotune.training.data import (WindowLayout, dataset_batches, even_split, split_micro_batches,
                                 synthetic_batches)

N = 53


def _window_samples(micro_batches, world_size, *, steps, effective=12):
    """{step: sorted sample ids} over all ranks, and each rank's micro-batch sizes."""
    dataset = torch.utils.data.TensorDataset(torch.arange(N))
    samples, sizes = {}, {}
    for rank in range(world_size):
        layout = WindowLayout(effective_batch=effective, micro_batches=micro_batches,
                              world_size=world_size, rank=rank, dataset_size=N)
        batches = dataset_batches(dataset, layout, seed=7, start_step=0, stop_step=steps)
        for step, (ids,) in enumerate(batches):
            window = layout.window(step)
            assert len(ids) == window.stop - window.start == sum(window.micro_batches)
            assert max(window.micro_batches) <= max(micro_batches)
            samples.setdefault(step, []).extend(ids.tolist())
            sizes.setdefault(step, []).append(len(window.micro_batches))
    for step, ranks in sizes.items():
        assert len(set(ranks)) == 1, f"step {step}: ranks run different numbers of micro-steps"
    return {step: sorted(ids) for step, ids in samples.items()}


def test_windows_identical_for_every_split_and_world_size():
    steps = 10  # 53 samples, windows of 12: 4 full + a partial window of 5 per epoch, 2 epochs
    reference = _window_samples([12], 1, steps=steps)
    for micro_batches, world_size in [([3, 3, 3, 3], 1), ([5, 4, 3], 1), ([2, 4], 2), ([1, 1, 1], 4)]:
        assert _window_samples(micro_batches, world_size, steps=steps) == reference
    # each epoch is a permutation of the whole dataset, reshuffled the next epoch
    first = sum((reference[s] for s in range(5)), [])
    assert sorted(first) == list(range(N))
    assert reference[5] != reference[0]


def test_partial_window_smaller_than_world_size_is_dropped():
    layout = WindowLayout(effective_batch=10, micro_batches=[5], world_size=2, rank=0, dataset_size=21)
    assert layout.windows_per_epoch == 2
    layout = WindowLayout(effective_batch=10, micro_batches=[5], world_size=2, rank=0, dataset_size=22)
    assert layout.windows_per_epoch == 3


@pytest.mark.parametrize("sizes, level, expected", [
    ([8, 8], 1, [4, 4, 4, 4]),
    ([43, 42, 42], 1, [21, 21, 21, 21, 21, 22]),
    ([3, 1], 1, [0, 1, 1, 2]),  # empty pieces first: the last micro-step always has samples
])
def test_oom_split(sizes, level, expected):
    assert split_micro_batches(sizes, level) == expected
    assert sum(split_micro_batches(sizes, level)) == sum(sizes)


def test_even_split():
    assert even_split(11, 3) == [3, 4, 4]
    assert even_split(2, 3) == [0, 1, 1]


def test_synthetic_batches_are_the_same_window_for_every_split():
    def make_batch(n):
        return torch.randn(n, 2)  # draws from the global RNG: seeded per step by the loop

    def windows(micro_batches, world_size):
        out = []
        for rank in range(world_size):
            layout = WindowLayout(effective_batch=8, micro_batches=micro_batches,
                                  world_size=world_size, rank=rank, dataset_size=None)
            out.append(torch.stack(list(synthetic_batches(make_batch, layout, seed=0, start_step=0,
                                                          stop_step=3))))
        return torch.cat(out, dim=1)

    state = torch.get_rng_state()
    assert torch.equal(windows([8], 1), windows([2, 2], 2))
    assert torch.equal(torch.get_rng_state(), state)
