"""Variable-length data as Hugging Face users have it: collate_fn in the model-file contract."""

import dataclasses

import pytest

from autotune.training.api import train

from real_models import real_model
from train_helpers import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def test_variable_length_examples_train_with_the_files_collate_fn():
    # Without collate_fn, default_collate died: "stack expects each tensor to be equal size".
    workload = real_model("gpt2_varlen")
    assert workload.collate_fn is not None
    widths = []
    collate = workload.collate_fn

    def recording(examples):
        batch = collate(examples)
        widths.append((len(examples), batch["input_ids"].shape[1],
                       max(len(e["input_ids"]) for e in examples)))
        return batch

    workload = dataclasses.replace(workload, collate_fn=recording)
    result = train(make_plan([4, 4]), workload, steps=2, progress=False, measure_noise_scale=False)
    assert result.steps == 2 and len(result.metrics) == 2
    # Each micro-batch is collated on its own: 4 examples, padded to its own longest.
    assert [n for n, _, _ in widths] == [4] * 4
    assert all(width == longest for _, width, longest in widths)
