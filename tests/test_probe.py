import gc
import json
import traceback

import pytest
import torch
from torch import nn

import autotune
from autotune import ProbeError, ProbeResult, Workload, WorkloadError, probe
from autotune.memory import CPUMemoryBackend
from autotune.precision import Precision
from autotune.probing.trial import TrialSession


class Blocks(nn.Module):
    """Small model with repeated blocks, so checkpointing has something to wrap."""

    def __init__(self, width=64, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_xy(n, width=64):
    return torch.randn(n, width), torch.randn(n, 1)


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def small_workload(**overrides):
    pieces = dict(model=Blocks, make_batch=make_xy, loss_fn=mse, source="tests/blocks")
    pieces.update(overrides)
    return Workload(**pieces)


LIMIT = "4MiB"


def independent_fit(workload, n, limit=LIMIT, **setting):
    """Run one trial at n in a fresh session: does it fit under the same budget?"""
    backend = CPUMemoryBackend(memory_limit=limit)
    with TrialSession(workload, backend, precision=Precision(setting.get("precision", "fp32")),
                      checkpointing=setting.get("checkpointing", False)) as session:
        return session.run(n).fits


@pytest.mark.parametrize("setting", [
    # fp32 keeps the promise in the fast suite; the other settings (about 18 s) are slow.
    {}, *(pytest.param(s, marks=pytest.mark.slow)
          for s in ({"precision": "bf16"}, {"precision": "fp16"}, {"checkpointing": True})),
])
def test_probe_finds_the_exact_largest_micro_batch(setting):
    workload = small_workload()
    result = probe(workload, device="cpu", memory_limit=LIMIT, **setting)
    n = result.max_micro_batch
    assert n > 4
    assert independent_fit(workload, n, **setting)
    assert not independent_fit(workload, n + 1, **setting)
    assert result.precision == setting.get("precision", "fp32")
    assert result.checkpointing.enabled == setting.get("checkpointing", False)
    assert [t.micro_batch for t in result.trials if t.fits and t.micro_batch == n]
    assert result.oom_count == sum(not t.fits for t in result.trials) >= 1


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_checkpointing_and_bf16_each_fit_more_than_fp32_without():
    workload = small_workload()
    plain = probe(workload, device="cpu", memory_limit=LIMIT).max_micro_batch
    assert probe(workload, device="cpu", memory_limit=LIMIT, checkpointing=True).max_micro_batch > plain
    assert probe(workload, device="cpu", memory_limit=LIMIT, precision="bf16").max_micro_batch > plain


def test_upper_bound_caps_the_search():
    result = probe(small_workload(), device="cpu", memory_limit=LIMIT, max_micro_batch=7)
    assert result.max_micro_batch == 7 and result.capped
    assert max(t.micro_batch for t in result.trials) == 7
    assert all(t.fits for t in result.trials)


def test_trial_measures_a_steady_state_step_with_optimizer_state():
    workload = small_workload()
    params = sum(p.numel() * 4 for p in Blocks().parameters())
    backend = CPUMemoryBackend(memory_limit="1GiB")
    with TrialSession(workload, backend, precision=Precision.FP32, checkpointing=False) as session:
        trial = session.run(8)
    # parameters + AdamW's exp_avg and exp_avg_sq exist before the step begins
    assert trial.baseline_bytes >= 3 * params
    # gradients exist during the optimizer step on top of that
    assert trial.step_peak_bytes >= 4 * params


def test_a_model_that_does_not_fit_at_one_says_how_far_over_and_what_helps():
    # Long sequences: the activations of one sample, not the weights, pass the budget.
    def long_xy(n):
        return torch.randn(n, 2048, 64), torch.randn(n, 2048, 1)

    with pytest.raises(ProbeError) as info:
        probe(small_workload(make_batch=long_xy), device="cpu", memory_limit="4MiB")
    message = str(info.value)
    assert "micro-batch 1" in message and "x the" in message
    assert "bf16" in message and "--checkpointing on" in message and "FSDP" in message


def test_weights_gradients_and_state_over_budget_are_not_told_to_try_bf16_or_checkpointing():
    # They were: autocast keeps fp32 weights, gradients and optimizer state, and checkpointing
    # saves activations; neither shrinks what does not fit.
    with pytest.raises(ProbeError) as info:
        probe(small_workload(), device="cpu", memory_limit="1.5MiB")
    message = str(info.value)
    assert "micro-batch 1 needs" in message and "x the 1.50 MiB budget" in message
    helps = message.split("What would help:")[1]
    assert "bf16" not in helps and "--checkpointing" not in helps
    assert "--sharding fsdp" in helps and "fsdp-offload" in helps
    assert "an optimizer with less state" in helps


def test_parameters_alone_over_budget_is_a_probe_error_with_the_measured_need():
    with pytest.raises(ProbeError) as info:
        probe(small_workload(), device="cpu", memory_limit="100KiB")
    message = str(info.value)
    assert "micro-batch 1 needs" in message and "x the 100.00 KiB budget" in message


def test_errors_that_are_not_out_of_memory_are_not_swallowed_and_keep_their_cause():
    class Broken(Blocks):
        def forward(self, x):
            if x.shape[0] > 3:
                return torch.mm(x, torch.ones(3, 3))  # a genuine shape error from torch
            return super().forward(x)

    with pytest.raises(autotune.errors.StepError) as info:
        probe(small_workload(model=Broken), device="cpu", memory_limit=LIMIT)
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and not autotune.is_oom_error(cause)
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert "forward" in frames  # the user's frame is still in the original traceback


@pytest.mark.slow
def test_cuda_style_out_of_memory_from_the_model_is_treated_as_not_fitting():
    class FakeCudaOOM(Blocks):
        def forward(self, x):
            if x.shape[0] > 37:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
            return super().forward(x)

    result = probe(small_workload(model=FakeCudaOOM), device="cpu", memory_limit="1GiB")
    assert result.max_micro_batch == 37


def test_probe_leaves_no_trace_in_memory():
    backend = CPUMemoryBackend(memory_limit=LIMIT)
    gc.collect()
    before = backend.current_bytes()
    probe(small_workload(), backend=backend, checkpointing=True)
    gc.collect()
    assert backend.current_bytes() == before


def test_probe_leaves_a_user_model_instance_as_it_was():
    model = Blocks()
    model.eval()
    model.head.weight.grad = torch.full_like(model.head.weight, 3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    workload = small_workload(model=model)
    probe(workload, device="cpu", memory_limit=LIMIT, checkpointing=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model.head.weight.grad, torch.full_like(model.head.weight, 3.0))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "head.weight")
    assert not model.training
    assert all("forward" not in vars(block) for block in model.blocks)  # checkpointing removed


def test_checkpointing_needs_repeated_blocks():
    workload = small_workload(model=lambda: nn.Linear(64, 1))
    with pytest.raises(WorkloadError) as info:
        probe(workload, device="cpu", memory_limit=LIMIT, checkpointing=True)
    assert "checkpointing" in str(info.value)


def test_loss_sum_and_count_losses_are_probed():
    def token_loss(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y, reduction="sum"), x.shape[0]

    result = probe(small_workload(loss_fn=token_loss), device="cpu", memory_limit=LIMIT, max_micro_batch=16)
    assert result.max_micro_batch == 16


def test_probe_result_round_trips_through_json():
    result = probe(small_workload(), device="cpu", memory_limit=LIMIT)
    data = json.loads(json.dumps(result.to_dict()))
    again = ProbeResult.from_dict(data)
    assert again == result
    assert again.memory_model.predict(again.max_micro_batch) > 0


def test_bad_arguments_are_errors_not_asserts():
    with pytest.raises(ProbeError):
        probe(small_workload(), device="cpu", memory_limit=LIMIT, max_micro_batch=0)
    with pytest.raises(autotune.ConfigError):
        probe(small_workload(), device="cpu", precision="fp8")
