"""The gradient noise scale: the two-batch estimator on problems whose answer is known, its moving
averages, and its wiring into the training loop (which it must never change)."""

import json
import math

import pytest
import torch
from torch import nn

from autotune.training import train
from autotune.training import noise_scale as ns
from autotune.training.data import epoch_permutation
from autotune.workload.contract import Workload
from train_helpers import make_plan, mlp_workload, params_of, token_loss, token_workload


# -- the pure estimator -------------------------------------------------------------------------
def test_two_batch_estimator_is_the_mccandlish_formula():
    small, big, b_small, b_big = 5.0, 2.0, 4, 32
    estimate = ns.two_batch_estimate(small, big, small_batch=b_small, big_batch=b_big)
    assert estimate.grad_sq == pytest.approx((b_big * big - b_small * small) / (b_big - b_small))
    assert estimate.trace == pytest.approx((small - big) / (1 / b_small - 1 / b_big))


def test_the_estimator_needs_two_different_batches():
    with pytest.raises(ValueError, match="small batch < big batch"):
        ns.two_batch_estimate(1.0, 1.0, small_batch=8, big_batch=8)


def test_synthetic_per_sample_gradients_with_known_mean_and_covariance():
    """g_i = G + ξ_i, ξ ~ N(0, diag(σ²)): B_noise = Σσ² / |G|² exactly."""
    generator = torch.Generator().manual_seed(0)
    dim, b_small, b_big, windows = 20, 4, 32, 4000
    mean = torch.linspace(-0.5, 0.5, dim, dtype=torch.float64)
    std = torch.linspace(0.5, 2.0, dim, dtype=torch.float64)
    truth = float((std ** 2).sum() / (mean ** 2).sum())
    grads = mean + std * torch.randn(windows, b_big, dim, generator=generator, dtype=torch.float64)
    small = grads[:, :b_small].mean(1).pow(2).sum(-1)  # the first micro-batch, as in the loop
    big = grads.mean(1).pow(2).sum(-1)
    ema = ns.NoiseScaleEMA()
    for s, b in zip(small.tolist(), big.tolist()):
        ema = ns.update(ema, ns.two_batch_estimate(s, b, small_batch=b_small, big_batch=b_big),
                        decay=0.999)
    assert ema.windows == windows
    assert ema.grad_sq == pytest.approx(float(mean @ mean), rel=0.1)
    assert ema.trace == pytest.approx(float((std ** 2).sum()), rel=0.1)
    assert ns.noise_scale(ema) == pytest.approx(truth, rel=0.1)


def test_the_averages_are_separate_and_bias_corrected():
    first = ns.WindowEstimate(grad_sq=2.0, trace=2.0)      # a window ratio of 1
    second = ns.WindowEstimate(grad_sq=-1.0, trace=10.0)   # negative |G|²: ratio meaningless
    ema = ns.update(ns.update(ns.NoiseScaleEMA(), first, decay=0.5), second, decay=0.5)
    # Bias-corrected: with decay 0.5 the two windows weigh 1/3 and 2/3.
    assert ema.grad_sq == pytest.approx(2.0 / 3 - 2.0 / 3)
    ema = ns.update(ns.update(ns.NoiseScaleEMA(), first, decay=0.9), second, decay=0.9)
    assert ema.grad_sq == pytest.approx((0.9 * 2.0 - 1.0) / 1.9)
    assert ema.trace == pytest.approx((0.9 * 2.0 + 10.0) / 1.9)
    # The ratio of the averages, not an average of per-window ratios (which would be (1 - 10) / 2).
    assert ns.noise_scale(ema, min_windows=2) == pytest.approx((0.9 * 2.0 + 10.0) / (0.9 * 2.0 - 1.0))
    assert ns.NoiseScaleEMA.from_dict(ema.to_dict()) == ema


def test_none_while_undefined():
    good = ns.WindowEstimate(grad_sq=1.0, trace=4.0)
    ema = ns.NoiseScaleEMA()
    assert ns.noise_scale(ema) is None and ema.grad_sq is None
    for _ in range(ns.MIN_WINDOWS - 1):
        ema = ns.update(ema, good)
    assert ns.noise_scale(ema) is None                      # too few windows
    assert ns.noise_scale(ns.update(ema, good)) == pytest.approx(4.0)
    lost = ns.NoiseScaleEMA()
    for _ in range(ns.MIN_WINDOWS):
        lost = ns.update(lost, ns.WindowEstimate(grad_sq=-1.0, trace=4.0))
    assert ns.noise_scale(lost) is None                     # EMA[|G|²] <= 0
    # An fp16 overflow's non-finite window is left out of the averages.
    assert ns.update(ema, ns.WindowEstimate(grad_sq=math.inf, trace=math.nan)) == ema


def test_batch_advice_only_far_beyond_the_noise_scale():
    assert ns.batch_advice(None, 4096) is None
    assert ns.batch_advice(100.0, 512) is None
    warning = ns.batch_advice(10.0, 512)
    assert "512" in warning and "10" in warning and "diminishing returns" in warning


# -- a linear regression, where B_noise is known in closed form ---------------------------------
def linear_regression(dim, *, dtype=torch.float64, lr=1e-3) -> Workload:
    """y = x·w*, x ~ N(0, I), mean squared error: the per-sample gradient at w is
    g = 2(x·δ)x with δ = w − w*, so G = 2δ and tr(Σ) = E|g|² − |G|² = 4|δ|²(d + 2) − 4|δ|²:
    B_noise = tr(Σ)/|G|² = d + 1 at every w (noiseless labels)."""
    w_star = torch.linspace(-1.0, 1.0, dim, dtype=dtype)

    def make_batch(n):
        x = torch.randn(n, dim, dtype=dtype)
        return x, x @ w_star

    def loss(model, batch):
        x, y = batch
        return ((model(x).squeeze(-1) - y) ** 2).mean()

    return Workload(model=lambda: nn.Linear(dim, 1, bias=False).to(dtype), make_batch=make_batch,
                    loss_fn=loss, build_optimizer=lambda params: torch.optim.SGD(params, lr=lr))


def test_training_measures_the_known_noise_scale_of_a_linear_regression():
    dim = 16
    result = train(make_plan([8] * 8), linear_regression(dim), steps=400, progress=False)
    # 400 windows of 8 of 64 samples: over 100 simulated runs every estimate fell within ±30%.
    assert result.noise_scale == pytest.approx(dim + 1, rel=0.35)
    assert result.metrics[-1]["noise_scale"] == result.noise_scale
    assert result.noise_scale_note is None and result.warnings == []


def _grad(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_first_window_rescales_the_micro_batch_gradient_exactly():
    """After one window the (bias-corrected) averages are that window's estimate, from the
    first micro-batch's mean gradient and the window's; [5, 3] runs as [3, 5]."""
    workload = linear_regression(3)
    result = train(make_plan([5, 3]), workload, steps=1, progress=False)
    torch.manual_seed(0)
    model = workload.new_model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        batch = workload.batch(8)
    g_small = _grad(model, workload.loss(model, (batch[0][:3], batch[1][:3]))[0])
    g_big = _grad(model, workload.loss(model, batch)[0])
    expected = ns.two_batch_estimate(float(g_small @ g_small), float(g_big @ g_big),
                                     small_batch=3, big_batch=8)
    record = result.metrics[0]
    assert record["noise_grad_sq_ema"] == pytest.approx(expected.grad_sq, rel=1e-9)
    assert record["noise_trace_ema"] == pytest.approx(expected.trace, rel=1e-9)
    assert record["noise_scale"] is None  # one window is not enough to report


def test_token_counts_are_measured_per_sample():
    """With (loss_sum, count) losses the small and big gradients are both per-sample means of the
    summed loss (the window's sum / C is scaled back by C / N), so B_noise is in samples."""
    workload = token_workload(32)
    result = train(make_plan([4, 4, 4, 4]), workload, steps=1, progress=False)
    torch.manual_seed(0)
    model = workload.new_model()
    window = epoch_permutation(32, seed=0, epoch=0)[:16]
    data = workload.build_dataset()
    g_small = _grad(model, token_loss(model, data[window[:4]])[0]) / 4
    g_big = _grad(model, token_loss(model, data[window])[0]) / 16
    expected = ns.two_batch_estimate(float(g_small @ g_small), float(g_big @ g_big),
                                     small_batch=4, big_batch=16)
    assert result.metrics[0]["noise_grad_sq_ema"] == pytest.approx(expected.grad_sq, rel=1e-9)
    assert result.metrics[0]["noise_trace_ema"] == pytest.approx(expected.trace, rel=1e-9)


def test_fp16_divides_out_the_grad_scaler_scale():
    fp32 = train(make_plan([4, 4]), mlp_workload(64, dtype=torch.float32), steps=1, progress=False)
    fp16 = train(make_plan([4, 4], precision="fp16"), mlp_workload(64, dtype=torch.float32),
                 steps=1, progress=False)
    assert fp16.skipped_steps == 0 and fp16.scaler.get_scale() == 2.0 ** 16  # grads were 65536x
    for key in ("noise_grad_sq_ema", "noise_trace_ema"):
        assert fp16.metrics[0][key] == pytest.approx(fp32.metrics[0][key], rel=2e-2)


@pytest.mark.parametrize("name, workload, micro_batches, precision", [
    ("mean", lambda: mlp_workload(64), [4, 4, 4, 4], "fp32"),
    ("uneven", lambda: mlp_workload(64), [7, 5, 4], "fp32"),
    ("tokens", lambda: token_workload(32), [5, 6, 5], "fp32"),
    ("fp16", lambda: mlp_workload(64, dtype=torch.float32), [4, 4], "fp16"),
])
def test_measuring_leaves_the_parameters_bit_identical(name, workload, micro_batches, precision):
    runs = [train(make_plan(micro_batches, precision=precision, clip=1.0 if name == "mean" else None),
                  workload(), steps=3, progress=False, measure_noise_scale=measure)
            for measure in (True, False)]
    assert runs[0].metrics[-1]["noise_grad_sq_ema"] is not None
    assert runs[1].metrics[-1]["noise_grad_sq_ema"] is None
    assert torch.equal(params_of(runs[0].model), params_of(runs[1].model))
    assert [m["loss"] for m in runs[0].metrics] == [m["loss"] for m in runs[1].metrics]


# -- what a run reports -------------------------------------------------------------------------
def test_metrics_jsonl_carries_the_noise_scale(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = ns.MIN_WINDOWS + 2
    train(make_plan([4, 4]), linear_regression(3), steps=steps, metrics_path=path, progress=False)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == steps
    assert all({"noise_scale", "noise_grad_sq_ema", "noise_trace_ema"} <= set(r) for r in records)
    assert all(r["noise_scale"] is None for r in records[: ns.MIN_WINDOWS - 1])
    assert all(r["noise_scale"] > 0 for r in records[ns.MIN_WINDOWS - 1:])


def test_warns_once_when_the_effective_batch_is_far_beyond_the_noise_scale(capsys):
    # d = 2: B_noise = 3, and an effective batch of 128 is about 40x that.
    result = train(make_plan([32] * 4), linear_regression(2), steps=60, progress=False)
    assert result.noise_scale == pytest.approx(3, rel=0.5)
    assert len(result.warnings) == 1
    assert "effective batch 128" in result.warnings[0]
    assert f"B_noise ≈ {result.noise_scale:.3g}" in result.warnings[0]
    assert capsys.readouterr().err.count("warning: the effective batch 128") == 1


def test_no_warning_when_the_effective_batch_is_within_reach(capsys):
    # d = 30: B_noise = 31, an effective batch of 128 is about 4x.
    result = train(make_plan([32] * 4), linear_regression(30), steps=60, progress=False)
    assert result.noise_scale is not None and result.warnings == []
    assert "warning" not in capsys.readouterr().err


def test_without_accumulation_or_ranks_there_is_no_estimate(capsys):
    result = train(make_plan([16]), linear_regression(2), steps=25, progress=True)
    assert result.noise_scale is None and result.warnings == []
    assert all(m["noise_scale"] is None and m["noise_grad_sq_ema"] is None for m in result.metrics)
    assert "needs gradient accumulation" in result.noise_scale_note
    assert "needs gradient accumulation" in capsys.readouterr().err


def test_resume_continues_the_averages(tmp_path):
    plan, steps = make_plan([4, 4]), ns.MIN_WINDOWS + 5
    whole = train(plan, linear_regression(3), steps=steps, progress=False)
    train(plan, linear_regression(3), steps=10, checkpoint_dir=tmp_path, progress=False)
    resumed = train(plan, linear_regression(3), steps=steps, checkpoint_dir=tmp_path, resume=True,
                    progress=False)
    assert resumed.noise_scale == pytest.approx(whole.noise_scale, rel=1e-9)
