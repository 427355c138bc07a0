"""The CUDA caching-allocator model (autotune.memory.cuda_allocator) against the rules of
c10/cuda/CUDACachingAllocator.cpp, exact to the byte, and how CUDA estimates use it."""

import json

import pytest
import torch
from click.testing import CliRunner

import autotune
from autotune.cli.main import cli
from autotune.gpus.catalog import load_profile
from autotune.gpus.fixed_costs import NCCL_BUFFSIZE, nccl_buffer_bytes
from autotune.memory.cpu import StorageTracker, counting, tracking_resizes
from autotune.memory.cuda_allocator import (
    AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel, allocation_size,
    cublas_workspaces, replay, round_size,
)
from autotune.memory.fake import EstimateMemoryBackend, is_hopper

from conftest import EXAMPLES

KiB, MiB = 1024, 1024 * 1024
TINY_LM = EXAMPLES / "tiny_lm.py"
MLP = EXAMPLES / "mlp.py"

pytestmark = pytest.mark.usefixtures("one_thread")


def run(*events, conf=None, limit=None):
    model = CachingAllocatorModel(AllocatorConfig.parse(conf), limit=limit)
    for event in events:
        getattr(model, event[0])(*event[1:])
    return model


def mallocs(*sizes):
    return [("malloc", i, size) for i, size in enumerate(sizes)]


# -- rounding and segment sizes ---------------------------------------------------------------

@pytest.mark.parametrize("nbytes, rounded", [
    (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512),
])
def test_sizes_round_up_to_512_bytes(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize("nbytes, divisions, rounded", [
    (1200 * KiB, 4, 1280 * KiB),  # [1 MiB, 2 MiB) in quarters of 256 KiB
    (1280 * KiB, 4, 1280 * KiB),  # on a division already
    (MiB, 4, MiB),                # a power of two stays
    (1025 * KiB, 2, 1536 * KiB),  # halves of 512 KiB
    (1500, 4, 1536),              # not above 512 x 4: plain 512 B rounding
    (3000, 8, 3072),              # 3000 <= 4096: plain 512 B rounding
])
def test_roundup_power2_divisions(nbytes, divisions, rounded):
    assert round_size(nbytes, divisions) == rounded


@pytest.mark.parametrize("size, segment", [
    (512, 2 * MiB), (MiB, 2 * MiB),                            # small pool: 2 MiB segments
    (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),          # (1, 10) MiB: 20 MiB segments
    (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB), (11 * MiB + 512, 12 * MiB),  # rounded to 2 MiB
    (12 * MiB, 12 * MiB),
])
def test_segment_sizes(size, segment):
    assert allocation_size(size) == segment


# -- replays ----------------------------------------------------------------------------------

def test_small_requests_share_one_2mib_segment():
    three = run(*mallocs(600 * KiB, 600 * KiB, 600 * KiB))
    assert (three.reserved, three.segments_created) == (2 * MiB, 1)
    assert three.allocated == 3 * 600 * KiB and three.requested == 3 * 600 * KiB
    # 1800 KiB used, 248 KiB left: a fourth needs a second segment.
    assert run(*mallocs(*[600 * KiB] * 4)).reserved == 4 * MiB


def test_a_5mib_request_takes_a_20mib_segment_and_the_rest_serves_others():
    model = run(*mallocs(5 * MiB))
    assert model.reserved == 20 * MiB and model.allocated == 5 * MiB
    assert run(*mallocs(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB)).reserved == 20 * MiB
    assert run(*mallocs(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB)).reserved == 40 * MiB


def test_an_11mib_request_gets_12mib():
    model = run(*mallocs(11 * MiB))
    # The 1 MiB left is not more than 1 MiB: no split, the block is all 12 MiB.
    assert model.reserved == 12 * MiB and model.allocated == 12 * MiB and model.requested == 11 * MiB


def test_large_pool_splits_only_above_1mib():
    whole = run(*mallocs(11 * MiB, int(1.5 * MiB)))  # nothing left in the 12 MiB block
    assert whole.reserved == 32 * MiB
    split = run(*mallocs(10 * MiB + 512 * KiB, int(1.5 * MiB)))  # 1.5 MiB left: split, reused
    assert split.reserved == 12 * MiB and split.allocated == 12 * MiB


def test_small_pool_splits_down_to_512_bytes():
    model = run(*mallocs(MiB, MiB - 512, 512))
    assert model.reserved == 2 * MiB and model.segments_created == 1
    assert run(*mallocs(MiB, MiB - 512, 513)).reserved == 4 * MiB


def test_frees_are_cached_and_reused_never_returned():
    model = run(("malloc", "a", 11 * MiB), ("free", "a"))
    assert model.reserved == 12 * MiB and model.allocated == 0
    model.malloc("b", 11 * MiB)
    assert model.reserved == 12 * MiB and model.segments_created == 1


def test_best_fit_takes_the_smallest_free_block():
    model = run(("malloc", "a", 12 * MiB), ("malloc", "b", 30 * MiB), ("free", "a"), ("free", "b"),
                ("malloc", "c", 11 * MiB), ("malloc", "d", 25 * MiB))
    assert model.reserved == 42 * MiB and model.segments_created == 2


def test_freed_neighbours_merge():
    model = run(*mallocs(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB), ("free", 1), ("free", 2))
    model.malloc("x", 10 * MiB)  # only the merged 10 MiB in the middle holds it
    assert model.reserved == 20 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    conf = "max_split_size_mb:25"
    freed = [("malloc", "a", 30 * MiB), ("free", "a")]
    assert run(*freed, ("malloc", "b", 12 * MiB)).reserved == 30 * MiB  # default: split and reuse
    assert run(*freed, ("malloc", "b", 12 * MiB), conf=conf).reserved == 42 * MiB  # not for < 25
    big = [("malloc", "a", 60 * MiB), ("free", "a")]
    # An oversize block serves a large request within 20 MiB of its size, unsplit.
    within = run(*big, ("malloc", "b", 45 * MiB), conf=conf)
    assert within.reserved == 60 * MiB and within.allocated == 60 * MiB
    assert run(*big, ("malloc", "b", 40 * MiB), conf=conf).reserved == 100 * MiB


def test_empty_cache_releases_only_unused_segments():
    model = run(*mallocs(5 * MiB, 5 * MiB, 11 * MiB), ("free", 0), ("free", 2), ("empty_cache",))
    assert model.reserved == 20 * MiB


def test_expandable_segments_grow_by_pages():
    conf = "expandable_segments:True"
    assert run(*mallocs(11 * MiB, 11 * MiB, 11 * MiB), conf=conf).reserved == 40 * MiB  # 20 MiB pages
    assert run(*mallocs(11 * MiB, 11 * MiB, 11 * MiB)).reserved == 36 * MiB
    assert run(*mallocs(600 * KiB, 600 * KiB, 600 * KiB, 600 * KiB), conf=conf).reserved == 4 * MiB
    # Reserved is the pages covering what is live: empty_cache unmaps the pages no tensor touches.
    model = run(("malloc", "a", 30 * MiB), ("malloc", "b", 30 * MiB), conf=conf)
    assert model.reserved == 60 * MiB
    model.free("a")
    model.empty_cache()
    assert model.reserved == 40 * MiB
    model.malloc("c", 30 * MiB)  # reuses a's place, mapping its page again
    assert model.reserved == 60 * MiB and model.segments_created == 1


def test_a_limit_empties_the_cache_and_retries_then_refuses():
    model = run(("malloc", "a", 11 * MiB), ("free", "a"), ("malloc", "b", 20 * MiB), limit=30 * MiB)
    assert model.reserved == 20 * MiB and model.peak_reserved == 20 * MiB
    with pytest.raises(AllocatorOutOfMemory):
        model.malloc("c", 12 * MiB)
    assert model.reserved == 20 * MiB and "c" not in model._live


def test_allocator_config_parses_pytorch_cuda_alloc_conf():
    conf = AllocatorConfig.parse("expandable_segments:True, max_split_size_mb:10,"
                                 "roundup_power2_divisions:[256:1,512:2,>:8],backend:native")
    assert conf.expandable_segments and conf.max_split_size == 20 * MiB  # torch's floor
    assert conf.roundup_power2_divisions == 8
    assert AllocatorConfig.parse(None) == AllocatorConfig()


# -- the trace from the fake-tensor tracker ----------------------------------------------------

def test_tracker_replays_its_storages_and_their_peak_matches():
    import torch

    tracker = StorageTracker()
    tracker.allocator = CachingAllocatorModel(record=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    with tracking_resizes(tracker), counting(tracker):
        loss = model(torch.randn(32, 64)).sum()
        loss.backward()
        storage = torch.empty(4096).untyped_storage()
        storage.resize_(0)
        storage.resize_(8192)
        del loss, storage
    alloc = tracker.allocator
    assert alloc.peak_requested == tracker.peak and alloc.requested == tracker.current
    assert alloc.peak_reserved >= alloc.peak_allocated >= alloc.peak_requested
    assert any(e[0] == "resize" for e in alloc.events)
    again = replay(alloc.events)
    assert (again.peak_reserved, again.peak_allocated, again.peak_requested) == (
        alloc.peak_reserved, alloc.peak_allocated, alloc.peak_requested)


def test_cpu_estimates_replay_nothing():
    backend = EstimateMemoryBackend(None)
    assert backend.allocator is None and backend.tracker.allocator is None
    assert backend.memory_picture() == {}


def test_cuda_estimates_read_the_allocator_settings_as_torch_does(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert EstimateMemoryBackend(for_cuda=True).allocator.config.expandable_segments
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")  # the newer name wins
    config = EstimateMemoryBackend(for_cuda=True).allocator.config
    assert config.max_split_size == 64 * MiB and not config.expandable_segments


def test_cuda_estimate_peak_is_reserved_and_holds_the_cublas_workspaces():
    peaks = autotune.estimate_cuda_peaks(TINY_LM, [1, 16], gpu_name="NVIDIA H100", precision="bf16")
    cpu = autotune.probing.estimate.estimate_peaks(TINY_LM, [16], precision="bf16")
    for tensors, reserved in peaks.values():
        # 32 MiB cuBLAS + 1 MiB cuBLASLt workspace on Hopper for each of the forward's and the
        # backward's handles, in reserved and not in tensors.
        assert reserved >= tensors + 66 * MiB and reserved % (2 * MiB) == 0
    assert peaks[16][0] >= cpu[16]  # the foreach optimizer path as on CUDA


def _wide_workload():
    """32 MiB of activations per sample: a micro-step at 1 caches segments a step at 4 cannot use."""
    import torch

    from autotune import Workload

    def build():
        return torch.nn.Sequential(torch.nn.Linear(1024, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 1))

    return Workload(model=build, make_batch=lambda n: torch.randn(n, 1024, 1024),
                    loss_fn=lambda model, x: model(x).mean(), source="<wide>")


def test_a_window_trial_reserves_no_stale_segments_of_its_stand_in_micro_step():
    # The window's first micro-step runs at micro-batch 1 in place of one at n; what the modelled
    # allocator cached for it must not stay reserved beside the measured micro-step at n.
    from autotune.probing.api import window_trial

    def overhead(window):
        trial = window_trial(_wide_workload(), EstimateMemoryBackend(for_cuda=True), micro_batch=4,
                             window=window, precision="fp32", checkpointing=False)
        return trial.reserved_peak_bytes - trial.allocated_peak_bytes

    assert overhead(2) <= overhead(1) + 20 * MiB


BLOCKS_MODEL = """
import torch
def build_model():
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
                                 for _ in range(8)))
def make_batch(n):
    return torch.randn(n, 256)
def loss_fn(model, x):
    return model(x).square().mean()
def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def test_a_model_of_identical_blocks_is_estimated_whole_for_cuda(tmp_path):
    # Tensor bytes extend from small builds of a block model; the allocator's reserved memory
    # does not, so a CUDA estimate runs the whole model and its tensors are the CPU estimate's.
    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS_MODEL)
    tensors, reserved = autotune.estimate_cuda_peaks(path, [64])[64]
    assert tensors == autotune.probing.estimate.estimate_peaks(path, [64])[64]
    assert reserved >= tensors


def test_workspaces_and_hopper():
    assert cublas_workspaces(True, {}) == [32 * MiB, MiB] * 2
    assert cublas_workspaces(False, {}) == [8 * MiB + 128 * KiB, MiB] * 2
    assert cublas_workspaces(False, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == [128 * KiB, 128 * KiB] * 2
    assert cublas_workspaces(True, {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == [32 * MiB, 4 * MiB] * 2
    assert is_hopper("NVIDIA H100 80GB HBM3") and is_hopper("NVIDIA GH200 480GB")
    assert not is_hopper("NVIDIA A100-SXM4-80GB") and not is_hopper("")


def test_nccl_buffers():
    assert nccl_buffer_bytes(1) == 0
    per_channel = NCCL_BUFFSIZE + 512 * KiB + 4_915_200
    assert nccl_buffer_bytes(8, {}) == 32 * per_channel
    assert nccl_buffer_bytes(8, {"NCCL_BUFFSIZE": str(MiB), "NCCL_MAX_NCHANNELS": "4"}) == \
        4 * (MiB + 512 * KiB + 4_915_200)


# -- plans and the CLI ---------------------------------------------------------------------------

def test_cpu_plans_carry_no_reserved_memory():
    plan = autotune.plan(MLP, target_batch=64, device="cpu", memory_limit="64MiB")
    trials = plan.chosen_setting.probe.trials
    assert all(t.reserved_peak_bytes is None and t.allocated_peak_bytes is None for t in trials)
    assert "reserved" not in plan.device.budget_source


def test_gpu_plan_states_reserved_above_allocated(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(TINY_LM), "--target-batch", "32", "--gpu",
                                      "h100-80gb", "--world-size", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = autotune.load_plan(out)
    trial = plan.chosen_setting.probe.trial_at(plan.micro_batch)
    # DDP's gradient buckets are added beside the step, as for every DDP plan.
    assert plan.predicted_peak_bytes == trial.peak_bytes + plan.ddp_bucket_bytes
    assert trial.peak_bytes == trial.reserved_peak_bytes
    assert trial.reserved_peak_bytes >= trial.allocated_peak_bytes > 0
    assert "reserved by the caching allocator" in result.output
    profile = load_profile("h100-80gb")
    # Outside torch's allocator: the context and NCCL's buffers; no allocator reserve now.
    assert plan.budget_bytes == profile.memory_bytes - profile.cuda_context_bytes - nccl_buffer_bytes(8)
    shown = CliRunner().invoke(cli, ["show", str(out)])
    assert "tensors allocated" in shown.output


def test_a_gpu_plan_synced_on_the_last_micro_step_states_that_windows_tensors(tmp_path):
    from autotune.probing.api import window_trial
    from autotune.units import format_bytes

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(TINY_LM), "--target-batch", "16", "--gpu", "h100-80gb",
                                      "--world-size", "2", "--sharding", "fsdp", "--micro-batch", "4",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = autotune.load_plan(out)
    assert plan.micro_batches == [4, 4] and plan.reduce_every_micro_step is False
    # The window the plan runs holds this rank's unsharded gradients: its tensors, not those of the
    # probe's window (which reduce-scattered every micro-step).
    backend = EstimateMemoryBackend(None, for_cuda=True, target=plan.device)
    planned = window_trial(TINY_LM, backend, micro_batch=4, window=2, precision=plan.precision,
                           checkpointing=plan.checkpointing, sharding="fsdp", world_size=2,
                           reduce_every_micro_step=False, micro_batches=[1, 4])
    assert plan.predicted_peak_bytes == planned.reserved_peak_bytes
    assert plan.predicted_allocated_bytes == planned.allocated_peak_bytes
    assert plan.predicted_allocated_bytes > plan.planned_trial.allocated_peak_bytes
    shown = CliRunner().invoke(cli, ["show", str(out)])
    assert f"tensors allocated {format_bytes(plan.predicted_allocated_bytes)})" in shown.output


def test_estimate_cli_for_cuda_prints_both():
    # --cuda is the deprecated alias of --gpu (tests/test_estimate_gpu_cli.py): a warning on stderr.
    result = CliRunner().invoke(cli, ["estimate", str(TINY_LM), "--micro-batch", "4", "--cuda",
                                      "A100", "--json"])
    assert result.exit_code == 0, result.output
    peaks = json.loads(result.stdout)["4"]
    assert peaks["reserved_bytes"] >= peaks["allocated_bytes"] + 8 * MiB
    text = CliRunner().invoke(cli, ["estimate", str(TINY_LM), "--micro-batch", "4", "--cuda", "A100"])
    assert "reserved/allocated" in text.output


# -- on a GPU: the model against torch's allocator (they skip without CUDA) ------------------------

REPLAY_ON_CUDA = r"""
import json, sys, torch
events = json.load(open(sys.argv[1]))
torch.cuda.init()
live = {}
for event in events:
    if event[0] == "malloc":
        live[event[1]] = torch.empty(event[2], dtype=torch.uint8, device="cuda")
    elif event[0] == "free":
        live.pop(event[1], None)
    elif event[0] == "resize":
        live[event[1]].untyped_storage().resize_(event[2])
    else:
        torch.cuda.empty_cache()
print(json.dumps([torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()]))
"""


def _step_trace():
    """The ordered allocations of a real CPU training step of a 4-layer MLP (4 MiB weights in
    the large pool, 256 KiB activations in the small one), as the estimate's tracker records them."""
    import torch

    tracker = StorageTracker()
    tracker.allocator = CachingAllocatorModel(record=True)
    with tracking_resizes(tracker), counting(tracker):
        model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        for _ in range(2):
            model(torch.randn(64, 1024)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del model, optimizer
    keys = {}
    return [[e[0], keys.setdefault(e[1], len(keys)), *e[2:]] if len(e) > 1 else list(e)
            for e in tracker.allocator.events]


@pytest.mark.gpu
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_model_reserves_what_torch_reserves_for_the_same_trace(tmp_path, conf):
    import os
    import subprocess
    import sys

    events = _step_trace()
    (tmp_path / "trace.json").write_text(json.dumps(events))
    (tmp_path / "replay.py").write_text(REPLAY_ON_CUDA)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    done = subprocess.run([sys.executable, str(tmp_path / "replay.py"), str(tmp_path / "trace.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reserved, allocated = json.loads(done.stdout.strip().splitlines()[-1])
    model = replay([tuple(e) for e in events], AllocatorConfig.parse(conf))
    assert model.peak_allocated == allocated  # block sizes: the rounding rules
    if conf:
        # Expandable segments: the model's choice of where a block goes is simpler than torch's
        # (see the module's docstring); within one 20 MiB page.
        assert abs(model.peak_reserved - reserved) <= 20 * MiB
    else:
        assert model.peak_reserved == reserved


@pytest.mark.gpu
def test_a_real_cuda_step_reserves_what_the_estimate_says():
    import torch

    from autotune.memory import CUDAMemoryBackend
    from autotune.precision import Precision
    from autotune.probing.trial import TrialSession

    n = 8
    backend = CUDAMemoryBackend(0)
    with TrialSession(autotune.load_workload(TINY_LM), backend, precision=Precision("bf16"),
                      checkpointing=False) as session:
        real = session.run(n)
    tensors, reserved = autotune.estimate_cuda_peaks(TINY_LM, [n], gpu_name=torch.cuda.get_device_name(0),
                                                     precision="bf16")[n]
    # Kernels' own workspaces (cuDNN, attention) and side streams are not on fake tensors: a
    # tenth (and 20 MiB) of slack either way.
    assert abs(reserved - real.reserved_peak_bytes) <= 0.1 * real.reserved_peak_bytes + 20 * MiB
    assert abs(tensors - real.peak_bytes) <= 0.1 * real.peak_bytes + 20 * MiB


def test_a_gpu_plan_states_its_trial_as_a_fresh_session_reaches_it(monkeypatch):
    # A modelled allocator's reserved peak depends on the trials the session ran before (8B at
    # sequence 131072 under CP 8: 47.48 GiB as the probe's third trial, 49.26 GiB as a run's first
    # step). Here the probe's later trials are made to read 1 MiB low, as such a history would
    # (and not to have run fresh, as a CUDA estimate's trials do: the test below): the plan states
    # what its trial reaches in a session of its own.
    from autotune.orchestration import planner
    from autotune.probing.api import window_trial

    probe = planner.probe

    def with_history(*args, **kwargs):
        result = probe(*args, **kwargs)
        for trial in result.trials[1:]:
            trial.peak_bytes -= MiB
            trial.reserved_peak_bytes -= MiB
            trial.first_in_session = None
        return result

    monkeypatch.setattr(planner, "probe", with_history)
    # 3 steps of 21760, the probe's third trial (after 65280, out of memory, and 255).
    plan = autotune.plan(TINY_LM, target_batch=32 * 2040, gpu="h100-80gb", precision="bf16",
                         checkpointing="off")
    trials = plan.chosen_setting.probe.trials
    assert plan.micro_batches == [21760] * 3 and trials[0].micro_batch != 21760
    backend = EstimateMemoryBackend(plan.device.budget_bytes, for_cuda=True, target=plan.device)
    from autotune.probing.share import window_steps

    window = window_steps(plan.micro_batch, plan.chosen_setting.probe.share)
    fresh = window_trial(TINY_LM, backend, micro_batch=plan.micro_batch, window=window,
                         precision="bf16", checkpointing="off")
    assert plan.predicted_peak_bytes == fresh.reserved_peak_bytes + plan.ddp_bucket_bytes
    assert plan.planned_trial.reserved_peak_bytes == fresh.reserved_peak_bytes


def test_every_trial_of_a_gpu_probe_runs_fresh_and_the_plan_needs_no_second_run(monkeypatch):
    # Each trial of a CUDA estimate builds its session and modelled allocator afresh
    # (probing.fresh_trials), as a run's first step starts: the plan's trial, wherever the probe
    # ran it, is what a session of its own reaches, and the planner does not run it again.
    from autotune.orchestration import planner
    from autotune.probing.api import window_trial
    from autotune.probing.share import window_steps

    again = []
    monkeypatch.setattr(planner, "window_trial", lambda *a, **k: again.append(a) or window_trial(*a, **k))
    plan = autotune.plan(TINY_LM, target_batch=32 * 2040, gpu="h100-80gb", precision="bf16",
                         checkpointing="off")
    trials = plan.chosen_setting.probe.trials
    assert len(trials) > 1 and all(t.first_in_session for t in trials)
    assert trials.index(plan.planned_trial) > 0 and not again
    backend = EstimateMemoryBackend(plan.device.budget_bytes, for_cuda=True, target=plan.device)
    fresh = window_trial(TINY_LM, backend, micro_batch=plan.micro_batch,
                         window=window_steps(plan.micro_batch, plan.chosen_setting.probe.share),
                         precision="bf16", checkpointing="off")
    assert plan.planned_trial.reserved_peak_bytes == fresh.reserved_peak_bytes
    assert plan.predicted_peak_bytes == fresh.reserved_peak_bytes + plan.ddp_bucket_bytes



def test_a_fresh_trials_session_read_after_it_ended_builds_nothing():
    # Why nothing fits is read from the probe's session after it ended (its blocks): a session
    # whose trials each build their own (probing.fresh_trials) answers from the last one. Building
    # another there would leave it open, in its fake mode, and the next probe's mesh failed in it
    # (8B at sequence 131072: "cannot be estimated under fake tensors ... .item()").
    from autotune.distributed.sharding.settings import Sharding
    from autotune.memory.fake import on_fake_tensors
    from autotune.probing.affine_blocks import layout_session
    from autotune.probing.estimate import EstimateSession
    from autotune.precision import Precision
    from autotune.probing.fresh_trials import FreshTrialsSession
    from autotune.workload import load_workload
    from autotune.workload.checkpoint_count import CheckpointingRequest

    def fake_mode():
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)

    backend = EstimateMemoryBackend(8 << 30, for_cuda=True)
    with layout_session(on_fake_tensors(load_workload(TINY_LM), foreach=True), backend,
                        session_type=EstimateSession, precision=Precision.BF16,
                        checkpointing=CheckpointingRequest.parse("off", allow_auto=False),
                        sharding=Sharding.parse("fsdp"), world_size=8, shard_group=None) as session:
        assert isinstance(session, FreshTrialsSession)
        with session:
            first = session.run(2)
            last = session.run(1)
        assert first.first_in_session and last.first_in_session and fake_mode() is None
        assert session.total_blocks == 4 and session.checkpointed_blocks == 0
        assert fake_mode() is None and session._full is None


def test_a_gpu_probe_that_fits_nowhere_leaves_no_fake_mode_behind():
    # Why nothing fits is read from the probe's session after it ended (its blocks): a session
    # whose trials each build their own (probing.fresh_trials) answers from the last one, and does
    # not build another, which would stay in its fake mode and break the next probe's mesh.
    from autotune.errors import AutotuneError
    from autotune.probing.api import probe

    for budget in (64 << 10, 24 << 20):  # parameters alone pass it; then one step does
        with pytest.raises(AutotuneError, match="does not fit|pass the"):
            probe(TINY_LM, backend=EstimateMemoryBackend(budget, for_cuda=True), precision="bf16",
                  max_micro_batch=8)
        assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    found = probe(TINY_LM, backend=EstimateMemoryBackend(8 << 30, for_cuda=True), precision="bf16",
                  sharding="fsdp", world_size=4, max_micro_batch=8)
    assert found.max_micro_batch == 8


@pytest.mark.slow  # 13-22 s (four fresh builds): the README's test run stays under 10 minutes
def test_a_fresh_trial_asked_again_is_answered_from_the_planners_memo(examples_dir, monkeypatch):
    # A --gpu planner's backend keeps each fresh trial's answer by setting: a layout screen's
    # trial, asked again by the probe, is not run again (a 70B window of 2 x 2 under TP 2 costs
    # 25 CPU s). Without the memo every trial builds anew.
    from autotune.gpus.target import profile_target
    from autotune.probing import fresh_trials
    from autotune.probing.api import window_trial

    built = []
    original = fresh_trials.FreshTrialsSession._full_session

    def counting_builds(self):
        if self._full is None:
            built.append(self._asked)
        return original(self)

    monkeypatch.setattr(fresh_trials.FreshTrialsSession, "_full_session", counting_builds)
    target = profile_target("h100-80gb", world_size=2)
    model = str(examples_dir / "tiny_lm.py")
    args = dict(micro_batch=2, window=2, precision="bf16", checkpointing="on", sharding="fsdp",
                world_size=2, reduce_every_micro_step=True)
    first = window_trial(model, target.backend, **args)
    assert window_trial(model, target.backend, **args).peak_bytes == first.peak_bytes
    assert len(built) == 2  # no memo: built twice, the same answer
    target.backend.trials_memo = {}
    kept = window_trial(model, target.backend, **args)
    again = window_trial(model, target.backend, **args)
    # The shard group named (as the planner's probe names it) or left to default: the same trial.
    named = window_trial(model, target.backend, shard_group=2, **args)
    assert len(built) == 3
    assert again is not kept and again.peak_bytes == kept.peak_bytes == first.peak_bytes == named.peak_bytes
    assert again.first_in_session
    # Another micro-batch, window, checkpointing or sync is another trial.
    window_trial(model, target.backend, **{**args, "micro_batch": 1})
    window_trial(model, target.backend, **{**args, "window": 1})
    window_trial(model, target.backend, **{**args, "checkpointing": "off"})
    window_trial(model, target.backend, **{**args, "reduce_every_micro_step": False})
    assert len(built) == 7


def test_a_cuda_trial_starts_from_reset_peaks(monkeypatch):
    # Without CUDA: begin_trial must reset torch's peak stats, or the trial's first reset_peak
    # folds the trial before's max_memory_reserved into this one's (seen on an H200).
    import torch

    from autotune.memory.cuda import CUDAMemoryBackend

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 3})
    backend = object.__new__(CUDAMemoryBackend)
    backend.device, backend.index, backend._reserved_peak = torch.device("cuda", 0), 0, 123
    backend.begin_trial()
    assert calls == ["sync", "reset"] and backend._reserved_peak == 0
    assert backend._retries_at_start == 3
