"""Optimizers whose state is not Adam's fp32 pair (bitsandbytes 8-bit and paged AdamW, torchao's
low-bit AdamW, Adafactor's factored moments) and several parameter groups: the fake-tensor
estimate counts their real state and step, and the probe is exact (docs/fine-tuning.md)."""

import importlib

import pytest
import torch

from autotune import probe
from autotune.errors import WorkloadError
from autotune.memory.cpu import CPUMemoryBackend
from autotune.planning.lr import rule_for_optimizer
from autotune.precision import Precision
from autotune.probing.estimate import estimate_peak
from autotune.probing.trial import TrialSession

import optimizer_models
from optimizer_models import OPTIMIZERS, workload

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["bnb-AdamW8bit", "torchao-AdamW8bit"]
SLOW = [name for name in OPTIMIZERS if name not in FAST and name != "reads-values"]
LIMIT = "8MiB"


def _needs(name):
    package = OPTIMIZERS[name][0]
    if package is None:
        return
    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - any import failure (torch floor, no CUDA build): skip
        pytest.skip(f"{package} does not import here: {type(exc).__name__}: {exc}")


def _measured_peak(name, n):
    """One real steady-state step on the CPU backend; the dtypes and bytes of the optimizer state
    it ran with, and the parameters' bytes."""
    with TrialSession(workload(name), CPUMemoryBackend("1GiB"), precision=Precision.FP32) as session:
        trial = session.run(n)
        state = [t for s in session.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) for t in _inner(v)]
        param_bytes = sum(p.numel() * p.element_size() for p in session.params)
    return trial.peak_bytes, state, param_bytes


def _inner(t):
    if hasattr(t, "__tensor_flatten__"):  # torchao's quantized state: codes, scale, qmap
        return [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [t]


def _check_estimate(name):
    _needs(name)
    measured, state, param_bytes = _measured_peak(name, 8)
    estimated = estimate_peak(workload(name), 8)
    assert abs(estimated - measured) <= 0.03 * measured, (estimated, measured)
    assert abs(estimated - measured) <= 256  # in fact within bytes (bitsandbytes' quantile maps)
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    if "8bit" in name or "4bit" in name:
        # The quantized state was the one measured: well under Adam's two fp32 values per weight.
        assert torch.uint8 in {t.dtype for t in state}
        assert state_bytes < 0.7 * param_bytes
    elif "Adafactor" in name:
        assert state_bytes < 0.25 * param_bytes  # factored rows and columns, not a full moment
    else:
        assert state_bytes >= 2 * param_bytes


def _bisection(name, limit, fails):
    """The largest micro-batch below ``fails`` whose real step fits ``limit``: bisection, every
    size a real step on the CPU backend (no estimate, no memory model)."""
    with TrialSession(workload(name), CPUMemoryBackend(limit), precision=Precision.FP32) as session:
        assert not session.run(fails).fits
        fit, fail = 0, fails
        while fail - fit > 1:
            mid = (fit + fail) // 2
            fit, fail = (mid, fail) if session.run(mid).fits else (fit, mid)
    return fit


def _check_probe(name):
    _needs(name)
    found = probe(workload(name), device="cpu", memory_limit=LIMIT)
    n = found.max_micro_batch
    assert found.estimated_max_micro_batch == n  # the estimate seeded it, and was right
    assert [(t.micro_batch, t.fits) for t in found.trials] == [(n, True), (n + 1, False)]
    assert n == _bisection(name, LIMIT, fails=2 * n + 2)


@pytest.mark.parametrize("name", FAST)
def test_estimate_counts_the_optimizers_state_and_step(name):
    _check_estimate(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_estimate_counts_the_other_optimizers(name):
    _check_estimate(name)


def test_probe_is_exact_with_bitsandbytes_8bit_adamw():
    _check_probe("bnb-AdamW8bit")


@pytest.mark.slow  # torchao's eager update of its quantized state takes 0.5-1 s a step here
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in ("bnb-AdamW8bit", "reads-values")])
def test_probe_is_exact_with_the_other_optimizers(name):
    _check_probe(name)


@pytest.mark.parametrize("optimizer,rule", [
    ("AdamW8bit", "sqrt"), ("PagedAdamW", "sqrt"), ("PagedAdamW8bit", "sqrt"), ("PagedAdamW32bit", "sqrt"),
    ("AdamW4bit", "sqrt"), ("AdamWFp8", "sqrt"), ("Adam8bit", "sqrt"), ("Adafactor", "sqrt"),
    ("AdEMAMix8bit", "sqrt"), ("SGD8bit", "linear"), ("PagedLion", "none"), ("Paged", "none")])
def test_lr_rule_reads_the_algorithm_under_low_bit_names(optimizer, rule):
    assert rule_for_optimizer(optimizer)[0] == rule


def test_two_optimizers_are_refused_naming_parameter_groups():
    two = workload("adamw-groups")
    two.build_optimizer = lambda params: (torch.optim.SGD(params[:2], lr=0.1),
                                          torch.optim.AdamW(params[2:]))
    with pytest.raises(WorkloadError, match=r"returned 2 optimizers \(SGD, AdamW\).*parameter group"):
        probe(two, device="cpu", memory_limit=LIMIT)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bnb-AdamW8bit", "torchao-AdamW8bit", "torch-Adafactor"])
def test_the_loop_trains_the_plan_at_its_lr_and_peak(name):
    _needs(name)
    from autotune import plan, train

    train_workload = workload(name)
    train_workload.base_lr, train_workload.base_batch = 1e-3, 4
    planned = plan(train_workload, target_batch=48, device="cpu", memory_limit=LIMIT, precision="fp32",
                   checkpointing="off", eval_batch=False)
    result = train(planned, train_workload, steps=2, progress=False, measure_noise_scale=False)
    lr = result.optimizer.param_groups[0]["lr"]  # torchao keeps it as a tensor: set in place
    assert float(lr) == pytest.approx(planned.lr.lr) and planned.lr.rule == "sqrt"
    peak = result.metrics[-1]["peak_memory_bytes"]
    assert abs(peak - planned.predicted_peak_bytes) <= 0.01 * planned.predicted_peak_bytes


def test_an_optimizer_that_reads_values_is_planned_with_real_trials_and_says_so():
    # No traceback: the probe searches with real trials, and the plan's memory reason says why,
    # naming the line of the model file's optimizer.
    from autotune import plan

    planned = plan(workload("reads-values"), target_batch=8, device="cpu", memory_limit=LIMIT,
                   checkpointing="off", eval_batch=False)
    (setting,) = planned.settings
    assert setting.probe.estimate_steps == 0 and setting.probe.trials[-1].fits
    assert setting.probe.unestimated in planned.reasons["memory"]
    assert "no estimate, so real trials only" in planned.reasons["memory"]
    assert "p.grad.norm().item()" in planned.reasons["memory"]
