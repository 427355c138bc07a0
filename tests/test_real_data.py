"""Variable-length data as Hugging Face users have it: collate_fn in the model-file contract."""

import dataclasses

import pytest
import torch

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


def test_a_dataset_without_make_batch_probes_its_largest_examples():
    # A Hugging Face model file has a dataset and a collate_fn, not a batch factory.
    workload = real_model("bert_dataset")
    batch = workload.batch(3)
    dataset = workload.build_dataset()
    longest = max(len(e["input_ids"]) for e in dataset)
    assert batch["input_ids"].shape == (3, longest)
    assert batch["attention_mask"].all()  # the largest examples: no padding at all here
    assert workload.batch(len(dataset) + 1)["input_ids"].shape[0] == len(dataset) + 1


def test_estimate_of_a_dataset_only_model_file_leaves_its_examples_real():
    from autotune import estimate_peak

    workload = real_model("bert_dataset")
    assert estimate_peak(workload, 4) > 0  # the dataset is read (and kept) during the estimate
    assert type(workload.batch(2)["input_ids"]) is torch.Tensor  # real, not fake


@pytest.mark.slow
def test_probe_of_a_dataset_only_model_file():
    from autotune import probe

    result = probe(real_model("bert_dataset"), memory_limit="64MiB", max_micro_batch=8)
    assert result.max_micro_batch == 8 and result.estimated_max_micro_batch == 8


def test_model_file_needs_make_batch_or_a_dataset(tmp_path):
    from autotune.errors import WorkloadError
    from autotune.workload.contract import load_workload

    path = tmp_path / "model.py"
    path.write_text("import torch\n\ndef build_model():\n    return torch.nn.Linear(2, 2)\n")
    with pytest.raises(WorkloadError, match=r"must define make_batch\(\).*or build_dataset\(\)"):
        load_workload(path)
