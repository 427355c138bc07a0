"""The probe starts where the estimate puts the answer: exact, and at most 2 real trials there."""

import pytest
import torch

from autotune import Workload, probe
from autotune.probing.search import search_largest_fitting
from autotune.probing.result import Trial

from conftest import EXAMPLES


pytestmark = pytest.mark.usefixtures("one_thread")


CASES = [
    ("mlp.py", "64MiB", {}),
    ("tiny_lm.py", "256MiB", {}),  # bf16 with checkpointing too, but slower: see the report
    ("cnn_bn.py", "64MiB", {}),
]


@pytest.mark.parametrize("name,limit,setting", CASES, ids=[c[0] for c in CASES])
def test_estimate_seeded_probe_is_exact_with_two_or_three_real_trials(name, limit, setting):
    seeded = probe(EXAMPLES / name, device="cpu", memory_limit=limit, **setting)
    n = seeded.max_micro_batch
    assert seeded.estimated_max_micro_batch == n and seeded.estimate_steps > 0
    # Only real steps in trials: a fit at the answer and a failure one above prove it exact.
    # Where a hair of the budget (search.HAIR) spans two or more micro-batches (the MLP's 21 KB
    # per sample against 67 KB), a step a hair below the estimate's answer comes first, so that
    # an estimate a hair short never costs a second failure.
    steps = [(t.micro_batch, t.fits) for t in seeded.trials]
    assert steps[-2:] == [(n, True), (n + 1, False)] and len(steps) <= 3
    assert all(fits for _, fits in steps[:-1])
    assert any(f"{len(steps)} real trial(s) confirmed it" in note for note in seeded.notes)


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_same_answer_as_the_search_without_the_estimate():
    plain = probe(EXAMPLES / "cnn_bn.py", device="cpu", memory_limit="64MiB", use_estimate=False)
    seeded = probe(EXAMPLES / "cnn_bn.py", device="cpu", memory_limit="64MiB")
    assert seeded.max_micro_batch == plain.max_micro_batch
    assert len(seeded.trials) < len(plain.trials)
    assert plain.estimate_steps == 0 and plain.estimated_max_micro_batch is None


def test_capped_by_the_upper_bound_takes_one_real_trial():
    result = probe(EXAMPLES / "mlp.py", device="cpu", memory_limit="64MiB", max_micro_batch=100)
    assert result.max_micro_batch == 100 and result.capped
    assert [t.micro_batch for t in result.trials] == [100]


class _Masked(torch.nn.Module):
    """Keeps the rows whose first feature is positive: an output shape fake tensors cannot know."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.linear(x[x[:, 0] > -10]).pow(2).mean()


def test_data_dependent_model_falls_back_to_real_trials_with_a_note():
    workload = Workload(model=_Masked, make_batch=lambda n: torch.randn(n, 64, generator=torch.Generator().manual_seed(n)),
                        loss_fn=lambda model, x: model(x), source="masked")
    seeded = probe(workload, device="cpu", memory_limit="4MiB")
    plain = probe(workload, device="cpu", memory_limit="4MiB", use_estimate=False)
    assert seeded.max_micro_batch == plain.max_micro_batch
    assert seeded.estimate_steps == 0 and seeded.estimated_max_micro_batch is None
    assert any("no estimate, so real trials only" in n and "cannot be estimated" in n
               for n in seeded.notes)


# --- the search's hint, on a simulated device ----------------------------------------------------

def _device(answer: int, base: int = 1000, per_sample: int = 10):
    calls = []

    def run(n):
        calls.append(n)
        peak = base + per_sample * n
        return Trial(micro_batch=n, fits=n <= answer, peak_bytes=peak, seconds=0.0,
                     activation_peak_bytes=peak, step_peak_bytes=base, baseline_bytes=base,
                     gradient_bytes=1)

    return run, calls


@pytest.mark.parametrize("hint", [0, 1, 40, 57, 58, 59, 90, 500])
def test_search_from_any_hint_is_exact(hint):
    run, calls = _device(answer=58)
    best, trials, _ = search_largest_fitting(run, budget=1000 + 10 * 58, upper=None, hint=hint)
    assert best == 58
    assert len(set(calls)) == len(calls)  # no micro-batch tried twice
    if hint == 58:
        assert calls == [58, 59]


def test_search_hint_of_zero_proves_nothing_fits_in_one_trial():
    run, calls = _device(answer=0)
    assert search_largest_fitting(run, budget=900, upper=None, hint=0)[0] == 0
    assert calls == [1]


def test_a_flat_estimated_curve_sends_no_real_step_past_twice_the_hint():
    # The H200 run of 2026-12-04: a seed curve flat at the budget put micro-batch 1 alone within
    # it; micro-batch 1 fitted with room for thousands, and the rescaled curve sent the next real
    # step to 16777216 samples (mlp's batch of that size exhausts the host's memory).
    run, calls = _device(answer=58)
    budget = 1000 + 10 * 58
    best, _, _ = search_largest_fitting(run, budget=budget, upper=None, hint=60,
                                        estimate=lambda n: budget - 1)
    assert best == 58 and max(calls) <= 120 and calls[0] == 1


def test_a_cuda_seed_gives_its_answer_but_no_curve_to_rescale():
    # A CUDA estimate's peaks are the modelled allocator's reserved bytes, flat near the budget
    # (the allocator frees its cache and retries); a real CUDA trial's peak is max_memory_allocated.
    # The real search starts from the answer (hint, hint + 1) and does not rescale that curve.
    import types

    from autotune import load_workload
    from autotune.precision import Precision
    from autotune.probing.api import CheckpointingRequest
    from autotune.probing.seed import estimate_seed

    budget = 1 << 30
    off = CheckpointingRequest.parse("off", option="checkpointing", allow_auto=False)
    workload = load_workload(str(EXAMPLES / "mlp.py"))
    seeds = {}
    for kind in ("cuda", "cpu"):
        backend = types.SimpleNamespace(info=lambda: types.SimpleNamespace(budget_bytes=budget),
                                        device=torch.device(kind))
        seeds[kind] = estimate_seed(workload, backend, precision=Precision.parse("fp32"),
                                    checkpointing=off, upper=None)
    assert seeds["cuda"].answer > 1000 and seeds["cuda"].estimate is None
    assert seeds["cpu"].estimate is not None and seeds["cpu"].estimate(1) < budget / 4
    fitted = Trial(micro_batch=10, fits=True, peak_bytes=1 << 20, seconds=0.0)
    # Below the answer the planner keeps the real trials' own model, not the reserved curve.
    assert seeds["cuda"].memory_model([fitted], "the real trials' model") == "the real trials' model"
