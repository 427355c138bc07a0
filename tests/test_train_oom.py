"""Runtime out-of-memory recovery: the window is redone in smaller micro-batches, same result."""

import pytest
import torch

from autotune.training import TrainError, train
from train_helpers import OOMOnce, build_mlp, make_plan, mlp_workload, params_of


def _workload(**oom):
    return mlp_workload(64, model=lambda: OOMOnce(build_mlp(), **oom))


def test_injected_oom_is_recovered_with_the_same_parameters(capsys):
    plan = make_plan([8, 8], lr=0.1)
    clean = train(plan, _workload(), steps=3, progress=False)
    recovered = train(plan, _workload(fail_at={4}), steps=3, progress=False)  # step 2, 2nd micro
    assert recovered.oom_recoveries == 1
    assert [m["oom_recoveries"] for m in recovered.metrics] == [0, 1, 1]
    assert [m["accumulation_steps"] for m in recovered.metrics] == [2, 4, 2]
    assert recovered.micro_batches == [8, 8]  # one recovery: the plan's split is kept
    torch.testing.assert_close(params_of(recovered.model), params_of(clean.model), rtol=1e-12, atol=1e-12)
    assert "out of memory at step 2 with micro-batch 8" in capsys.readouterr().err


def test_repeated_ooms_keep_the_smaller_micro_batch(capsys):
    plan = make_plan([8, 8], lr=0.1)
    clean = train(plan, _workload(), steps=4, progress=False)
    result = train(plan, _workload(fail_above=4), steps=4, progress=False)
    assert result.oom_recoveries == 2
    assert result.micro_batches == [4, 4, 4, 4]
    assert [m["micro_batch"] for m in result.metrics] == [4, 4, 4, 4]
    torch.testing.assert_close(params_of(result.model), params_of(clean.model), rtol=1e-12, atol=1e-12)
    assert "keeping micro-batch 4 (4 accumulation steps)" in capsys.readouterr().err


def test_oom_at_micro_batch_one_is_a_clear_error():
    with pytest.raises(TrainError, match="micro-batch of 1 sample ran out of memory"):
        train(make_plan([2]), _workload(fail_above=0), steps=1, progress=False)


def test_a_non_oom_error_propagates_untouched():
    def broken(model, batch):
        raise ValueError("shape mismatch in the user's loss")

    with pytest.raises(ValueError, match="shape mismatch"):
        train(make_plan([4]), mlp_workload(64, loss_fn=broken), steps=1, progress=False)
