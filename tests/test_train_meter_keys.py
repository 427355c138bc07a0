"""The training loop's CPU meter counts what the probe counts, for Hugging Face models whose config
has ``use_cache=True`` too (issue 20).

The meter leaves some storages out of a step's peak (the window's batch, what only an aliasing op
shows it) by key, and a key is the storage's address: once a left-out storage died, a storage
allocated at its address was left out too. GPT-2's key-value cache makes small tensors with
``torch.tensor([])`` (seen through ``lift_fresh``, an aliasing op) and then allocates attention
outputs at their addresses, so the trained peak came out 1.8 MB (7%) under the plan's.
"""

from __future__ import annotations

import gc

import pytest
import torch

import autotune
from autotune.training.metrics import _MeterMode, _StepTracker

from real_models import real_path


def test_a_left_out_storage_is_forgotten_when_it_dies():
    batch = torch.zeros(1024)
    tracker = _StepTracker(ignored=[batch.untyped_storage()])
    key = batch.untyped_storage()._cdata
    assert key in tracker.ignored
    del batch
    gc.collect()
    # Its address may now be another storage's, which the step allocates and must count.
    assert key not in tracker.ignored


def test_a_tensor_made_by_torch_tensor_in_the_step_is_counted():
    tracker = _StepTracker()
    with _MeterMode(tracker):
        made = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert tracker.current == made.untyped_storage().nbytes() == 16


def test_gpt2_with_its_cache_on_trains_to_the_plans_peak(tmp_path):
    path = real_path("gpt2")
    plan = autotune.plan(path, target_batch=8, micro_batch=8, memory_limit="128MiB",
                         device="cpu", precision="fp32", checkpointing="off")
    model = autotune.load_workload(path).new_model()
    assert model.config.use_cache  # what this test is about: the forward builds a DynamicCache
    autotune.save_plan(plan, tmp_path / "plan.json")
    trained = autotune.train(tmp_path / "plan.json", path, steps=2, progress=False)
    peaks = [m["peak_memory_bytes"] for m in trained.metrics]
    predicted = plan.predicted_peak_bytes
    # The step's only bytes the meter does not count are its micro-batch's (a view of the window's
    # batch on the CPU, a copy the probe counted): 4 KiB of token ids here.
    assert all(abs(peak - predicted) <= 0.01 * predicted for peak in peaks[1:]), (peaks, predicted)
    assert all(0 <= predicted - peak <= 8 * 64 * 8 for peak in peaks[1:]), (peaks, predicted)
