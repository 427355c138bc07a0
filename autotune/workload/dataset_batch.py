"""The probe's batch for a model file without ``make_batch``: the dataset's largest examples.

A Hugging Face-style model file has a dataset (and a ``collate_fn`` that pads), not a batch
factory. The memory a step needs grows with the examples' sizes, so the probe must see the
largest: ``LargestExamples(n)`` collates the n largest examples (by their number of elements),
cycling through them again when n is larger than the dataset. The order is found once, on first
use, by reading every example's size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.data import default_collate

from ..errors import WorkloadError


class LargestExamples:
    """``make_batch(batch_size)`` built from ``build_dataset()`` and ``collate_fn``."""

    def __init__(self, build_dataset: Callable[[], Any], collate_fn: Callable[[list], Any] | None,
                 *, source: str):
        self.build_dataset, self.collate_fn, self.source = build_dataset, collate_fn, source
        self._dataset = None
        self._order: list[int] | None = None

    def __call__(self, batch_size: int):
        # The dataset is read with real tensors even while an estimate runs on fake ones (it is
        # cached for the real trials); the collated batch is made in whatever mode is active.
        with unset_fake_temporarily():
            dataset, order = self._largest_first()
            examples = [dataset[order[i % len(order)]] for i in range(batch_size)]
        return (self.collate_fn or default_collate)(examples)

    def _largest_first(self):
        if self._order is None:
            dataset = self.build_dataset()
            try:
                count = len(dataset)
            except TypeError:
                raise WorkloadError(
                    f"{self.source}: without make_batch the probe builds its batch from "
                    f"build_dataset()'s largest examples, which needs a dataset with a length "
                    f"(got a {type(dataset).__name__}); define make_batch(batch_size)") from None
            if count == 0:
                raise WorkloadError(f"{self.source}: build_dataset() is empty; the probe needs "
                                    f"examples (or define make_batch(batch_size))")
            if self.collate_fn is None:
                check_default_collate(dataset, source=self.source)
            sizes = [example_size(dataset[i]) for i in range(count)]
            # Stable: among equal sizes the dataset's own order, so the batch is reproducible.
            self._dataset = dataset
            self._order = sorted(range(count), key=lambda i: -sizes[i])
        return self._dataset, self._order


CHECKED_EXAMPLES = 256
"""How many of the dataset's examples (spread evenly) ``check_default_collate`` compares."""


def check_default_collate(dataset, *, source: str) -> None:
    """Without a ``collate_fn``, the training loop batches ``build_dataset()``'s examples with
    torch's default_collate, which stacks them: examples of different shapes (variable-length
    sequences) fail there, in the first step of ``autotune train``, after a plan made from
    ``make_batch`` looked fine. Checked before planning and before training, on up to
    ``CHECKED_EXAMPLES`` examples spread over the dataset; a dataset without a length is left to
    the loop."""
    try:
        count = len(dataset)
    except TypeError:
        return
    if count < 2:
        return
    checked = min(count, CHECKED_EXAMPLES)
    indices = sorted({i * count // checked for i in range(checked)})
    first = dataset[indices[0]]
    shape = _shapes(first)
    other = next((i for i in indices[1:] if _shapes(dataset[i]) != shape), indices[1])
    try:
        default_collate([first, dataset[other]])
    except (RuntimeError, TypeError, ValueError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WorkloadError(
            f"{source}: build_dataset()'s examples cannot be batched without a collate_fn: torch's "
            f"default_collate, which the training loop uses then, fails on examples {indices[0]} "
            f"and {other} ({type(exc).__name__}: {detail}; their shapes: {_describe(shape)} and "
            f"{_describe(_shapes(dataset[other]))}). Define collate_fn(examples) in the model file, "
            f"e.g. padding sequences to the longest of the list (see examples/gpt_varlen.py); "
            f"the probe then measures those padded batches too"
        ) from exc


def _shapes(example):
    """The tensor shapes of an example's structure (what default_collate must stack)."""
    if isinstance(example, torch.Tensor):
        return tuple(example.shape)
    if isinstance(example, dict):
        return tuple((key, _shapes(value)) for key, value in example.items())
    if isinstance(example, (list, tuple)):
        return tuple(_shapes(value) for value in example)
    shape = getattr(example, "shape", None)  # numpy arrays
    return tuple(shape) if isinstance(shape, tuple) else type(example).__name__


def _describe(shapes) -> str:
    text = repr(shapes)
    return text if len(text) <= 120 else text[:117] + "..."


def example_size(example) -> int:
    """Elements in an example: tensor elements, list items, one per other scalar."""
    if isinstance(example, torch.Tensor):
        return example.numel()
    if isinstance(example, dict):
        return sum(example_size(v) for v in example.values())
    if isinstance(example, (list, tuple)):
        return sum(example_size(v) for v in example)
    size = getattr(example, "size", None)  # numpy arrays
    return int(size) if isinstance(size, int) else 1
