"""CUDA backend checks; they run only where torch sees a CUDA device (marker: gpu)."""

import gc

import pytest
import torch
from torch import nn

from autotune import Workload, probe
from autotune.memory import CUDAMemoryBackend, describe_cuda_devices
from autotune.precision import Precision
from autotune.probing.trial import TrialSession

pytestmark = pytest.mark.gpu

WIDTH = 1024


def build_model():
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                           for _ in range(4)), nn.Linear(WIDTH, 1))


def make_batch(n):
    return torch.randn(n, WIDTH), torch.randn(n, 1)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


WORKLOAD = Workload(model=build_model, make_batch=make_batch, loss_fn=loss_fn, source="tests/gpu-mlp")


def _fits(n, limit, precision="fp32"):
    backend = CUDAMemoryBackend(0, memory_limit=limit)
    with TrialSession(WORKLOAD, backend, precision=Precision(precision), checkpointing=False) as session:
        return session.run(n).fits


def test_cuda_devices_are_described():
    devices = describe_cuda_devices()
    assert devices and devices[0]["total_bytes"] > 0 and devices[0]["name"]
    info = CUDAMemoryBackend(0).info()
    free, _ = torch.cuda.mem_get_info(0)
    assert free <= info.budget_bytes <= free + torch.cuda.memory_reserved(0)


@pytest.mark.parametrize("limit, precision", [("1GiB", "fp32"), ("2GiB", "fp32"), ("1GiB", "bf16")])
def test_probe_is_exact_under_an_emulated_smaller_card(limit, precision):
    result = probe(WORKLOAD, device="cuda", memory_limit=limit, precision=precision)
    n = result.max_micro_batch
    assert n > 1
    assert _fits(n, limit, precision)
    assert not _fits(n + 1, limit, precision)
    budget = result.budget_bytes
    assert all(t.peak_bytes <= budget for t in result.trials if t.fits)


def test_the_allocator_cap_is_set_during_the_probe_and_restored_after():
    backend = CUDAMemoryBackend(0, memory_limit="1GiB")
    total = torch.cuda.get_device_properties(0).total_memory
    with backend.tracking():
        assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(2**30 / total)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(1.0)


def test_probe_returns_cuda_memory_to_its_pre_probe_level():
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    probe(WORKLOAD, device="cuda", memory_limit="1GiB")
    gc.collect()
    assert torch.cuda.memory_allocated(0) == before


def test_the_answer_keeps_reserved_memory_within_the_budget():
    limit = 1536 * 2**20
    n = probe(WORKLOAD, device="cuda", memory_limit=limit).max_micro_batch
    backend = CUDAMemoryBackend(0, memory_limit=limit)
    with TrialSession(WORKLOAD, backend, precision=Precision.FP32, checkpointing=False) as session:
        trial = session.run(n)
        reserved = backend.peak_reserved_bytes()
    assert trial.fits
    assert trial.peak_bytes <= reserved <= limit


def test_each_cuda_trial_carries_the_memory_picture():
    backend = CUDAMemoryBackend(0, memory_limit="2GiB")
    with TrialSession(WORKLOAD, backend, precision=Precision.FP32, checkpointing=False) as session:
        trial = session.run(64)
    assert trial.fits and trial.reserved_peak_bytes >= trial.peak_bytes
    assert trial.alloc_retries is not None and trial.alloc_retries >= 0
    if trial.nvml_used_bytes is not None:  # NVML counts the context and the cache too
        assert trial.nvml_used_bytes >= torch.cuda.memory_reserved(0)
    (first, *_) = describe_cuda_devices()
    assert first["reserved_peak_bytes"] >= first["allocated_peak_bytes"] > 0


def test_a_trial_reserved_peak_is_its_own_not_the_trial_before():
    backend = CUDAMemoryBackend(0, memory_limit="2GiB")
    with TrialSession(WORKLOAD, backend, precision=Precision.FP32, checkpointing=False) as session:
        large = session.run(4096)
        small = session.run(1)
    # Before the fix the second trial reported the first one's reserved peak.
    assert small.reserved_peak_bytes < large.reserved_peak_bytes


def test_training_reports_the_allocated_peak_and_reserved(tmp_path):
    from autotune import train
    from train_helpers import make_plan

    result = train(make_plan([32, 32]), WORKLOAD, steps=2, device="cuda", progress=False)
    last = result.metrics[-1]
    assert last["peak_memory_kind"] == "allocated" and last["peak_memory_bytes"] > 0
    assert last["reserved_peak_bytes"] >= last["peak_memory_bytes"] and last["rss_peak_bytes"] is None
