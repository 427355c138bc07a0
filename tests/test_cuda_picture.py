"""The CUDA memory picture (allocated, reserved, allocator retries, NVML used), tested with the CUDA
calls faked: devices, each trial, the plan's warning and the printed tables. No GPU needed."""

import json

import pytest
import torch
from click.testing import CliRunner

from autotune.cli.format import format_probe
from autotune.cli.main import cli
from autotune.memory import CPUMemoryBackend, cuda as cuda_backend
from autotune.planning.planfile import plan_from_json, plan_to_json
from autotune.planning.policy import PlanRequest, allocator_warnings, build_plan
from autotune.precision import Precision
from autotune.probing.trial import TrialSession
from plan_helpers import MiB, device, fingerprint, linear_probe, setting
from train_helpers import mlp_workload


class FakeCuda:
    """torch.cuda's memory counters for one device, set by the test."""

    def __init__(self):
        self.allocated = self.allocated_peak = 100 * MiB
        self.reserved = self.reserved_peak = 300 * MiB
        self.retries = 2

    def memory_stats(self, device=None):
        return {"allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.allocated_peak,
                "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.reserved_peak,
                "num_alloc_retries": self.retries}

    def reset_peak_memory_stats(self, device=None):
        self.allocated_peak, self.reserved_peak = self.allocated, self.reserved


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    calls = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "mem_get_info": lambda device=None: (6000 * MiB, 8192 * MiB),
        "memory_reserved": lambda device=None: fake.reserved,
        "memory_allocated": lambda device=None: fake.allocated,
        "max_memory_reserved": lambda device=None: fake.reserved_peak,
        "max_memory_allocated": lambda device=None: fake.allocated_peak,
        "memory_stats": fake.memory_stats, "reset_peak_memory_stats": fake.reset_peak_memory_stats,
        "synchronize": lambda device=None: None, "get_device_name": lambda device=None: "Fake GPU",
        "is_bf16_supported": lambda: True,
    }
    for name, function in calls.items():
        monkeypatch.setattr(torch.cuda, name, function)
    monkeypatch.setattr(cuda_backend, "nvml_device",
                        lambda index: {"name": "Fake GPU", "total": 8192 * MiB, "used": 2500 * MiB})
    return fake


def test_devices_show_allocated_reserved_retries_and_nvml_used(fake_cuda):
    listed = CliRunner().invoke(cli, ["devices", "--json"])
    assert listed.exit_code == 0, listed.output
    (gpu,) = json.loads(listed.stdout)["cuda"]
    assert gpu["used_bytes_nvml"] == 2500 * MiB
    assert (gpu["allocated_bytes"], gpu["reserved_peak_bytes"], gpu["alloc_retries"]) == (100 * MiB, 300 * MiB, 2)
    text = CliRunner().invoke(cli, ["devices"]).stdout
    assert "NVML used" in text and "2.44 GiB" in text and "reserved now/peak" in text
    assert "300.00 MiB / 300.00 MiB" in text and "every process and CUDA context" in text


def test_a_cuda_trial_reports_its_reserved_peak_across_phases_and_its_own_retries(fake_cuda):
    backend = cuda_backend.CUDAMemoryBackend(0)
    backend.begin_trial()
    fake_cuda.reserved_peak = 700 * MiB  # the activation phase
    backend.reset_peak()  # between phases: torch forgets the reserved peak, the backend does not
    fake_cuda.reserved_peak = 400 * MiB
    fake_cuda.retries = 5
    assert backend.memory_picture() == {"reserved_peak_bytes": 700 * MiB, "alloc_retries": 3,
                                        "nvml_used_bytes": 2500 * MiB}
    backend.begin_trial()
    assert backend.memory_picture()["alloc_retries"] == 0


class PictureBackend(CPUMemoryBackend):
    """The CPU backend, reporting a CUDA-like picture for each trial."""

    def memory_picture(self):
        return {"reserved_peak_bytes": 12345, "alloc_retries": 1, "nvml_used_bytes": 42}


def test_every_trial_carries_the_picture_and_plan_files_keep_it(one_thread):
    workload = mlp_workload()
    with TrialSession(workload, CPUMemoryBackend(), precision=Precision.FP32, checkpointing=False) as s:
        plain = s.run(4)
    assert plain.fits and plain.reserved_peak_bytes is None and plain.alloc_retries is None
    with TrialSession(workload, PictureBackend(), precision=Precision.FP32, checkpointing=False) as s:
        trial = s.run(4)
    assert trial.reserved_peak_bytes == 12345 and trial.alloc_retries == 1
    assert trial.nvml_used_bytes == 42


def _with_picture(probe, reserved_factor, retries=0):
    for t in probe.trials:
        t.reserved_peak_bytes = int(t.peak_bytes * reserved_factor)
        t.alloc_retries = retries
        t.nvml_used_bytes = t.reserved_peak_bytes + 400 * MiB
    return probe


def _plan(probe):
    request = PlanRequest(target_batch=64, world_size=1, checkpointing="off", headroom=0.0)
    return build_plan(request, workload=fingerprint(), settings=[setting(probe, headroom=0.0)],
                      device=device(), versions={"autotune": "0.1.0", "torch": "2.x", "cuda": "12"},
                      created_at="2025-01-01T00:00:00+00:00")


def test_the_plan_warns_when_reserved_runs_well_above_allocated():
    fragmented = _plan(_with_picture(linear_probe(50), 1.6, retries=4))
    assert any("torch reserved" in w and "expandable_segments" in w for w in fragmented.warnings)
    assert any("retried cudaMalloc 12 time(s)" in w for w in fragmented.warnings)  # 3 trials, 4 each
    tidy = _plan(_with_picture(linear_probe(50), 1.05))
    assert not allocator_warnings(tidy.chosen_setting)
    assert not any("reserved" in w for w in _plan(linear_probe(50)).warnings)  # CPU: no picture
    again = plan_from_json(plan_to_json(fragmented))
    assert again.settings[0].probe.trials[0].reserved_peak_bytes == fragmented.settings[0].probe.trials[0].reserved_peak_bytes


def test_probe_table_shows_the_picture_on_cuda_only():
    probe = _with_picture(linear_probe(50), 1.5, retries=1)
    text = format_probe(probe, "model.py")
    assert "reserved" in text and "retries" in text and "NVML used" in text
    assert "reserved" not in format_probe(linear_probe(50), "model.py")
