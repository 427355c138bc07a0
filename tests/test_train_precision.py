"""fp16 with GradScaler (a forced inf skips exactly one step) and bf16 training on the examples."""

import math

import pytest
import torch

from autotune.training import train
from train_helpers import make_plan, mean_loss, mlp_workload, params_of


def test_fp16_forced_inf_skips_one_step_halves_scale_and_holds_the_scheduler():
    calls = {"n": 0}

    def loss_with_one_inf(model, batch):
        calls["n"] += 1
        loss = mean_loss(model, batch)
        return loss * math.inf if calls["n"] == 4 else loss  # step 2, its second micro-batch

    workload = mlp_workload(64, dtype=torch.float32, loss_fn=loss_with_one_inf)
    result = train(make_plan([4, 4], precision="fp16", lr=0.1, warmup=10), workload, steps=4,
                   progress=False)
    assert result.skipped_steps == 1
    assert [m["skipped_steps"] for m in result.metrics] == [0, 1, 1, 1]
    assert result.scaler.get_scale() == 2.0 ** 16 / 2
    assert result.scheduler.last_epoch == 3  # 4 optimizer steps, one skipped
    lrs = [m["lr"] for m in result.metrics]
    assert lrs[2] == lrs[1] and lrs[1] > lrs[0] and lrs[3] > lrs[2]
    assert result.metrics[1]["grad_norm"] is None or not math.isfinite(result.metrics[1]["grad_norm"])
    assert torch.isfinite(params_of(result.model)).all()


def test_fp16_skipped_step_leaves_parameters_unchanged():
    def always_inf(model, batch):
        return mean_loss(model, batch) * math.inf

    workload = mlp_workload(64, dtype=torch.float32, loss_fn=always_inf)
    torch.manual_seed(0)
    before = params_of(workload.new_model())
    result = train(make_plan([8], precision="fp16"), workload, steps=2, progress=False)
    assert result.skipped_steps == 2
    assert torch.equal(params_of(result.model), before)


@pytest.mark.parametrize("example, micro_batches", [("cnn_bn.py", [8, 8]), ("gpt_varlen.py", [8, 8])])
def test_bf16_reduces_the_loss_on_bundled_examples(examples_dir, example, micro_batches):
    result = train(make_plan(micro_batches, precision="bf16"), examples_dir / example, steps=12,
                   progress=False)
    losses = [m["loss"] for m in result.metrics]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
