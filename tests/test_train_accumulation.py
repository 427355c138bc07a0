"""Exact accumulation: any micro x accum split gives the large-batch step (relative error <= 1e-5)."""

import pytest
import torch

from autotune.training import train
from autotune.training.data import epoch_permutation
from train_helpers import (initial_params, make_plan, mlp_workload, params_of, relative_error,
                           token_loss, token_workload)


def _reference_steps(workload, windows, *, seed=0):
    """A hand-written large-batch SGD loop: one full-window batch per optimizer step."""
    torch.manual_seed(seed)
    model = workload.new_model()
    optimizer = workload.new_optimizer(model.parameters())
    dataset = workload.build_dataset()
    for indices in windows:
        batch = dataset[indices]
        loss, count = workload.loss(model, batch)
        (loss if count is None else loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


def _windows(n, effective, steps):
    permutation = epoch_permutation(n, seed=0, epoch=0)
    return [permutation[i * effective:(i + 1) * effective] for i in range(steps)]


@pytest.mark.parametrize("micro_batches, n, steps", [
    ([4, 4, 4, 4], 64, 1),        # even
    ([7, 5, 4], 64, 1),           # uneven (a planned 16 = 7 + 5 + 4)
    ([4, 4, 4, 4], 27, 2),        # a partial last window of 11 samples, split 3 + 4 + 4
])
def test_split_matches_one_large_batch_step(micro_batches, n, steps):
    workload = mlp_workload(n)
    start = initial_params(workload)
    result = train(make_plan(micro_batches), workload, steps=steps, progress=False)
    expected = _reference_steps(workload, _windows(n, sum(micro_batches), steps))
    assert result.steps == steps
    assert relative_error(params_of(result.model) - start, expected - start) <= 1e-5


def test_token_counts_need_token_weighting_not_one_over_accum():
    workload = token_workload(32)
    start = initial_params(workload)
    effective, micro = 16, [4, 4, 4, 4]
    window = _windows(32, effective, 1)[0]
    expected = _reference_steps(workload, [window])

    ours = train(make_plan(micro), workload, steps=1, progress=False)
    assert relative_error(params_of(ours.model) - start, expected - start) <= 1e-5

    # What 1/accum normalisation does: each micro-batch's own token mean, divided by 4.
    torch.manual_seed(0)
    model = workload.new_model()
    optimizer = workload.new_optimizer(model.parameters())
    dataset = workload.build_dataset()
    for part in window.split(4):
        loss_sum, count = token_loss(model, dataset[part])
        (loss_sum / count / len(micro)).backward()
    optimizer.step()
    naive = params_of(model)
    assert relative_error(naive - start, expected - start) > 1e-2


def test_window_mean_loss_is_the_large_batch_loss():
    workload = token_workload(32)
    window = _windows(32, 16, 1)[0]
    torch.manual_seed(0)
    model = workload.new_model()
    loss_sum, count = token_loss(model, workload.build_dataset()[window])
    result = train(make_plan([5, 6, 5]), workload, steps=1, progress=False)
    assert result.metrics[0]["loss"] == pytest.approx(float((loss_sum / count).detach()), rel=1e-9)


def test_the_plans_lr_rescales_each_parameter_group_alike():
    # docs/fine-tuning.md's recipe: a no-decay group at a third of the optimizer's LR. The loop
    # set every group to the plan's LR, training that group at 3× its intended LR.
    import dataclasses

    def grouped(params):
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                                  {"params": [p for p in params if p.ndim < 2], "lr": 1e-4,
                                   "weight_decay": 0.0}], lr=3e-4)

    workload = dataclasses.replace(mlp_workload(16), build_optimizer=grouped)
    result = train(make_plan([4, 4], lr=6e-4), workload, steps=1, progress=False)
    assert [g["lr"] for g in result.optimizer.param_groups] == pytest.approx([6e-4, 2e-4])
    single = train(make_plan([4, 4], lr=6e-4), mlp_workload(16, optimizer="adamw"), steps=1, progress=False)
    assert [g["lr"] for g in single.optimizer.param_groups] == pytest.approx([6e-4])
