"""Which samples each optimizer step sees, on each rank and in each micro-batch.

The rule that makes a plan reproducible across splits: one seeded permutation of the dataset per
epoch, cut into *windows* of ``effective_batch`` samples (one window = one optimizer step), then
each window into per-rank shares, then each share into micro-batches. The samples of a window
therefore depend only on the seed, the epoch and the effective batch, never on micro-batch,
accumulation steps or world size.

The last window of an epoch may be partial; its share is split evenly over the ranks. A last
window with fewer samples than ranks is dropped (a rank with nothing to compute would leave DDP's
gradient all-reduce waiting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..errors import WorkloadError
from ..planning.policy import even_split


@dataclass(frozen=True)
class Window:
    """One optimizer step's data, seen from one rank."""

    step: int
    """Optimizer steps before this one (0-based, counted over all epochs)."""
    epoch: int
    index: int
    """Position of the window within its epoch."""
    samples: int
    """Samples in the whole window, all ranks together."""
    start: int
    stop: int
    """This rank's share: positions [start, stop) of the window."""
    micro_batches: tuple[int, ...]
    """This rank's micro-batch sizes, as planned (before any out-of-memory split)."""


class WindowLayout:
    """Pure arithmetic: windows per epoch and each rank's share and micro-batches of a window."""

    def __init__(self, *, effective_batch: int, micro_batches: list[int], world_size: int,
                 rank: int, dataset_size: int | None):
        self.effective_batch = effective_batch
        self.micro_batches = tuple(micro_batches)
        self.world_size = world_size
        self.rank = rank
        self.dataset_size = dataset_size
        self.windows_per_epoch = windows_per_epoch(dataset_size, effective_batch, world_size)

    def window(self, step: int) -> Window:
        if self.windows_per_epoch is None:
            epoch, index, samples = 0, step, self.effective_batch
        else:
            epoch, index = divmod(step, self.windows_per_epoch)
            samples = min(self.effective_batch, self.dataset_size - index * self.effective_batch)
        if samples == self.effective_batch:
            per_rank = sum(self.micro_batches)
            start = self.rank * per_rank
            return Window(step=step, epoch=epoch, index=index, samples=samples, start=start,
                          stop=start + per_rank, micro_batches=self.micro_batches)
        return self._partial(step, epoch, index, samples)

    def _partial(self, step, epoch, index, samples) -> Window:
        shares = even_split(samples, self.world_size)[::-1]  # larger shares on the first ranks
        start = sum(shares[: self.rank])
        share = shares[self.rank]
        # Every rank must run the same number of micro-steps (DDP syncs on the last one), sized
        # by the largest share so no micro-batch exceeds the plan's largest.
        steps = math.ceil(shares[0] / max(self.micro_batches))
        return Window(step=step, epoch=epoch, index=index, samples=samples, start=start,
                      stop=start + share, micro_batches=tuple(even_split(share, steps)))


def windows_per_epoch(dataset_size: int | None, effective_batch: int, world_size: int) -> int | None:
    """Optimizer steps per epoch: full windows, plus a partial one with at least a sample per rank."""
    if dataset_size is None:
        return None
    full, rest = divmod(dataset_size, effective_batch)
    return full + (1 if rest >= world_size else 0)


def split_micro_batches(sizes, level: int) -> list[int]:
    """Each size cut into 2**level near-equal pieces (out-of-memory recovery), smallest first.

    Sorting puts any empty pieces first, so the last micro-step of a window, the one that
    synchronises gradients under DDP, always has samples.
    """
    pieces = 2 ** level
    return sorted(size for total in sizes for size in even_split(total, pieces))


def epoch_permutation(dataset_size: int, *, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


class _RankWindowSampler:
    """A batch sampler yielding this rank's sample indices for each window, from a start step.

    It plays the part of ``DistributedSampler`` (a per-epoch reshuffle, one share per rank) but
    cuts by windows, so shares do not depend on the world size.
    """

    def __init__(self, layout: WindowLayout, *, seed: int, start_step: int, stop_step: int):
        self.layout, self.seed = layout, seed
        self.start_step, self.stop_step = start_step, stop_step

    def __len__(self):
        return self.stop_step - self.start_step

    def __iter__(self) -> Iterator[list[int]]:
        permutation, epoch = None, None
        for step in range(self.start_step, self.stop_step):
            window = self.layout.window(step)
            if window.epoch != epoch:
                epoch = window.epoch
                permutation = epoch_permutation(self.layout.dataset_size, seed=self.seed, epoch=epoch)
            first = window.index * self.layout.effective_batch
            yield permutation[first + window.start: first + window.stop].tolist()


def dataset_batches(dataset, layout: WindowLayout, *, seed: int, start_step: int, stop_step: int,
                    num_workers: int = 0, pin_memory: bool = False,
                    collate_fn: Callable[[list], Any] | None = None) -> Iterator[Any]:
    """This rank's share of each window from ``start_step``, collated into one batch.

    With the model file's ``collate_fn`` the share is a ``SampleWindow`` instead: each
    micro-batch is collated on its own when sliced, so variable-length examples are padded to
    the longest of their micro-batch (as the probe measured), not of the whole window.
    """
    sampler = _RankWindowSampler(layout, seed=seed, start_step=start_step, stop_step=stop_step)
    # The loader's own generator keeps it from drawing on the global RNG (resume must find that
    # RNG exactly as an uninterrupted run left it).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         pin_memory=pin_memory and collate_fn is None,
                                         collate_fn=None if collate_fn is None else _WindowOf(collate_fn),
                                         generator=torch.Generator().manual_seed(seed))
    return iter(loader)


class SampleWindow:
    """A rank's share of a window as uncollated samples; slicing collates the slice."""

    def __init__(self, samples: list, collate_fn: Callable[[list], Any]):
        self.samples, self.collate_fn = samples, collate_fn

    def __len__(self) -> int:
        return len(self.samples)

    def collate(self, start: int, stop: int):
        return self.collate_fn(self.samples[start:stop])


class _WindowOf:
    """The DataLoader's collate_fn: keeps the samples for per-micro-batch collation (a class, not
    a closure, so worker processes can pickle it)."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> SampleWindow:
        return SampleWindow(samples, self.collate_fn)


def synthetic_batches(make_batch: Callable[[int], Any], layout: WindowLayout, *, seed: int,
                      start_step: int, stop_step: int) -> Iterator[Any]:
    """Without a dataset: ``make_batch(effective_batch)`` per window, seeded by the step.

    Every rank builds the whole window and keeps its share, so the data is the same whatever the
    split; the global RNG is forked so training's own random state is untouched.
    """
    for step in range(start_step, stop_step):
        window = layout.window(step)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + step)
            batch = make_batch(window.samples)
        yield slice_batch(batch, window.start, window.stop)


def slice_batch(batch, start: int, stop: int):
    """Samples [start, stop) of a batch (tensor, dict, tuple/list or namedtuple of tensors)."""
    if isinstance(batch, SampleWindow):
        return batch.collate(start, stop)
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return {key: slice_batch(value, start, stop) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(value, start, stop) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(value, start, stop) for value in batch)
    return batch


def dataset_size(dataset, *, source: str) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise WorkloadError(
            f"{source}: build_dataset() returned a {type(dataset).__name__} without a length; the "
            f"training loop needs a map-style dataset (with __len__ and __getitem__) to cut it into "
            f"windows of the effective batch"
        ) from None
