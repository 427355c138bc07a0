"""The plan's peak is the training run's peak: accumulation windows, not single steps (issue 19).

A micro-step after a window's first starts with every gradient alive; the probe, the estimate,
``verify`` and the planner measure that steady state, and the training loop holds its steps to
the plan (on the CPU to its budget).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import autotune
from autotune.memory import backend_for
from autotune.distributed.layout import Layout
from autotune.orchestration.verify import plan_window, verify_plan
from autotune.planning.policy import PlanRequest, split_for
from autotune.precision import Precision
from autotune.probing.estimate import estimate_peak
from autotune.probing.result import Trial
from autotune.probing.share import search_with_share, window_steps
from autotune.probing.trial import TrialSession
from autotune.training.api import train
from autotune.training.metrics import PlanCheck, PlanExceeded
from autotune.workload.contract import load_workload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_LM = str(EXAMPLES / "tiny_lm.py")
MLP = str(EXAMPLES / "mlp.py")


@pytest.fixture(scope="module")
def tiny_lm_16x2():
    """The issue's reproduction: 16 x 2 planned with no headroom, and 3 trained steps' peaks."""
    plan = autotune.plan(TINY_LM, target_batch=32, micro_batch=16, memory_limit="256MiB",
                         device="cpu", precision="fp32", checkpointing="off", headroom=0.0)
    result = train(plan, TINY_LM, steps=3, progress=False)
    return plan, [m["peak_memory_bytes"] for m in result.metrics]


def test_planned_peak_of_an_accumulating_plan_is_the_trained_peak(tiny_lm_16x2):
    plan, peaks = tiny_lm_16x2
    assert plan.micro_batches == [16, 16]
    trained = max(peaks)
    # Before: planned 89.30 MiB (one step), trained 92.90 MiB (the second micro-step holds the
    # gradients). Now the plan is the window's.
    assert abs(trained - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes, (
        trained, plan.predicted_peak_bytes)
    assert "3.59 MiB of the replica's gradients stay allocated between its 2 micro-steps" in \
        plan.reasons["memory"]


def test_window_trial_exceeds_one_step_by_about_the_gradients():
    workload = load_workload(TINY_LM)
    with TrialSession(workload, backend_for("cpu", "256MiB"), precision=Precision.FP32) as session:
        single = session.run(8)
        window = session.run(8, window=2)
        real_first = session.run(8, micro_batches=[8, 8])
    assert single.micro_steps is None and window.micro_steps == [1, 8]
    assert window.held_gradient_bytes == session.gradient_bytes
    grown = window.peak_bytes - single.peak_bytes
    assert 0.9 * session.gradient_bytes <= grown <= 1.05 * session.gradient_bytes
    # The claim the cheap window rests on: a first micro-step at n (no gradients yet) never peaks
    # above the measured one (gradients alive), so running the first at 1 loses nothing.
    assert real_first.peak_bytes == window.peak_bytes
    # The window's baseline is what its measured micro-step starts from: the gradients included,
    # and the window's loss totals, which the training loop holds through its window as well.
    from autotune.accumulation import WindowTotals

    totals = WindowTotals(torch.device("cpu"))
    held = sum(t.nbytes for t in (totals.loss_sum, totals.items, totals.small_sq_norm))
    assert window.baseline_bytes == single.baseline_bytes + session.gradient_bytes + held


def test_an_uneven_split_is_planned_from_its_largest_micro_batch():
    # [9, 8]: the largest runs only first, without gradients; the window trial at 9 (the second
    # micro-step at 9 with the gradients alive) bounds the real window from above by at most one
    # sample's activations.
    workload = load_workload(TINY_LM)
    with TrialSession(workload, backend_for("cpu", "256MiB"), precision=Precision.FP32) as session:
        planned = session.run(9, window=2)
        real = session.run(9, micro_batches=[9, 8])
        one_more = session.run(8, window=2)
    assert real.peak_bytes <= planned.peak_bytes
    assert planned.peak_bytes - real.peak_bytes <= planned.peak_bytes - one_more.peak_bytes


@pytest.mark.parametrize("checkpointing", [False, True])
def test_first_micro_step_never_exceeds_the_second_on_fake_tensors(checkpointing):
    # The same claim, with checkpointing (the recomputation runs in backward), on the estimate.
    from autotune.memory.fake import EstimateMemoryBackend, on_fake_tensors
    from autotune.probing.estimate import EstimateSession

    backend = EstimateMemoryBackend(None)
    session = EstimateSession(on_fake_tensors(load_workload(TINY_LM)), backend,
                              precision=Precision.FP32, checkpointing=checkpointing)
    with session:
        cheap, full = session.run(12, window=2), session.run(12, micro_batches=[12, 12])
    assert cheap.peak_bytes == full.peak_bytes


def test_estimate_peak_of_a_window():
    single = estimate_peak(TINY_LM, 8)
    window = estimate_peak(TINY_LM, 8, accumulation_steps=2)
    grads = 940_800 * 4
    assert single + 0.9 * grads <= window <= single + 1.05 * grads


def _trial(n, fits, window=False):
    return Trial(micro_batch=n, fits=fits, peak_bytes=n, seconds=0.0, baseline_bytes=0,
                 activation_peak_bytes=n, step_peak_bytes=0,
                 micro_steps=[1, n] if window else None)


def test_share_is_tried_as_one_step_first_and_windows_below_it():
    assert [window_steps(n, 32) for n in (32, 16, 11, 31)] == [1, 2, 3, 2]
    assert window_steps(8, None) == 1
    # One step at the share fits where a window at share - 1 would not (the gradients it holds):
    # the answer is the share, proved by its own trial.
    runs = []

    def run(n):
        runs.append(n)
        return _trial(n, fits=n == 32 or n <= 20, window=n < 32)

    best, trials, _ = search_with_share(run, budget=100, upper=32, share=32)
    assert best == 32 and runs == [32]
    runs.clear()

    def run_tight(n):
        runs.append(n)
        return _trial(n, fits=n <= 20, window=n < 32)

    best, trials, model = search_with_share(run_tight, budget=100, upper=32, share=32)
    assert best == 20 and runs[0] == 32 and all(t.window for t in trials[1:])
    # A pinned micro-batch below the share searches windows only.
    runs.clear()
    best, _, _ = search_with_share(run_tight, budget=100, upper=16, share=32)
    assert best == 16 and 32 not in runs


@pytest.mark.parametrize("share", [2, 3, 4, 7, 32, 100, 513])
def test_steps_only_tries_the_micro_batches_that_change_the_steps_and_plans_the_same_split(share):
    # A micro-batch between ceil(share / k) and ceil(share / (k - 1)) takes k steps, as the one
    # below it does: the steps-only search (CUDA estimates) tries none of them, and its answer
    # gives the split the exact largest micro-batch gives.
    useful = {-(-share // k) for k in range(1, share + 1)}
    for largest in range(0, share + 1):
        runs = {True: [], False: []}

        def run(n, steps_only):
            runs[steps_only].append(n)
            return _trial(n, fits=n <= largest, window=n < share)

        exact, _, _ = search_with_share(lambda n: run(n, False), budget=largest, upper=share, share=share)
        best, _, _ = search_with_share(lambda n: run(n, True), budget=largest, upper=share, share=share,
                                       steps_only=True)
        assert exact == largest
        assert set(runs[True]) <= useful
        if largest:
            assert best <= largest and best in useful and -(-share // best) == -(-share // largest)
        else:
            assert best == 0


@pytest.mark.parametrize("share, pp", [(2, 2), (8, 2), (12, 2), (16, 2), (16, 4), (30, 2), (128, 8), (7, 2)])
def test_a_pipelines_steps_only_search_tries_the_divisors_of_its_share_and_plans_the_same_split(share, pp):
    # A pipeline plans equal micro-batches (policy.split_for: the largest divisor of the share
    # within what fits, at most share / pp): 8B under FSDP 4 x PP 2 (share 16) tried 16 (pp
    # micro-batches of 16, twice the share), then 3 (planned as 2 x 8, counted again at 2).
    upper = max(1, share // pp)
    divisors = [n for n in range(1, upper + 1) if share % n == 0]
    for largest in range(0, upper + 2):
        runs = {True: [], False: []}

        def run(n, even):
            runs[even].append(n)
            return _trial(n, fits=n <= largest, window=n < share)

        plain, _, _ = search_with_share(lambda n: run(n, False), budget=largest, upper=upper, share=share,
                                        steps_only=True)
        best, _, _ = search_with_share(lambda n: run(n, True), budget=largest, upper=upper, share=share,
                                       steps_only=True, even=True)
        assert set(runs[True]) <= set(divisors), (largest, runs[True])
        reachable = [n for n in divisors if n <= largest]
        assert best == (reachable[-1] if reachable else 0), (largest, runs[True])
        assert split_for(best, _pipeline_request(share, pp)) == split_for(plain, _pipeline_request(share, pp))
        assert len(runs[True]) <= len(runs[False])
        assert len(set(runs[True])) == len(runs[True])  # nothing measured twice


def _pipeline_request(share: int, pp: int):
    return PlanRequest(target_batch=share * 2, world_size=2 * pp, parallel=Layout(pp=pp) if pp > 1 else Layout())


def test_a_pipelines_probe_goes_no_higher_than_its_share_over_pp():
    # torch's schedules run at least pp micro-batches: above share / pp a trial would run more
    # samples than the plan takes.
    assert _pipeline_request(16, 2).wanted_micro_batch == 8
    assert _pipeline_request(128, 8).wanted_micro_batch == 16
    assert _pipeline_request(16, 1).wanted_micro_batch == 16
    assert dataclasses.replace(_pipeline_request(16, 2), micro_batch=4).wanted_micro_batch == 4


def test_steps_only_proves_a_share_of_4_in_two_trials():
    # 70B on 256 H100s, FSDP 128 x TP 2: 4 samples per rank; 4 in one step does not fit, 2 in a
    # window of two does. The exact search tried 4, 1, 2 and 3 (a full build each, 20 CPU s).
    runs = []

    def run(n):
        runs.append(n)
        return _trial(n, fits=n <= 3, window=n < 4)

    best, _, _ = search_with_share(run, budget=3, upper=4, share=4, steps_only=True)
    assert best == 2 and runs == [4, 2]


def test_steps_only_tries_a_known_trial_first_and_answers_the_same():
    # 8B at sequence 131072 under CP 8 (share 8): the layout screen ran micro-batch 1, which fits;
    # the probe tried 8, then halved to 3 and 2, where 8, the free 1 and 2 prove it.
    paid_in_all = plain_in_all = 0
    for share in (2, 4, 7, 8, 16, 32, 64):
        useful = sorted({-(-share // k) for k in range(1, share + 1)})
        for largest in range(0, share + 1):
            for free in useful[:-1]:
                runs, plain = [], []

                def run(n, into, largest=largest, share=share):
                    into.append(n)
                    return _trial(n, fits=n <= largest, window=n < share)

                expected, _, _ = search_with_share(lambda n: run(n, plain), budget=largest, upper=share,
                                                   share=share, steps_only=True)
                best, _, _ = search_with_share(lambda n: run(n, runs), budget=largest, upper=share,
                                               share=share, steps_only=True, known=lambda n: n == free)
                assert best == expected, (share, largest, free, runs)
                if largest < share:  # the share failed, and the known trial came next
                    assert runs[:2] == [share, free], runs
                paid = [n for n in runs if n != free]
                # A fit far below the answer guides the search less than halving: one trial more
                # at worst, fewer over all.
                assert len(paid) <= len(plain) + 1, (share, largest, free, runs, plain)
                paid_in_all, plain_in_all = paid_in_all + len(paid), plain_in_all + len(plain)
    assert paid_in_all < 0.8 * plain_in_all
    runs = []
    best, _, _ = search_with_share(lambda n: run(n, runs, largest=1, share=8), budget=1, upper=8, share=8,
                                   steps_only=True, known=lambda n: n == 1)
    assert best == 1 and runs == [8, 1, 2]


@pytest.mark.parametrize("share", [2, 5, 32, 100])
@pytest.mark.parametrize("steps_only", [False, True])
def test_a_limit_below_the_budget_takes_the_largest_measured_micro_batch_within_it(share, steps_only):
    # A step at the share costs 3 bytes a sample, a window 1 a sample: everything fits the budget,
    # and the plan may hold only ``limit``. The search goes on below the largest that fits the
    # budget until the largest micro-batch that changes the steps within the limit is measured,
    # proven by a measured one above it.
    useful = sorted({-(-share // k) for k in range(1, share + 1)})
    for limit in range(0, 3 * share + 1):
        runs = []

        def run(n):
            runs.append(n)
            return _trial(n, fits=True, window=n < share) if n < share else dataclasses.replace(
                _trial(n, fits=True), peak_bytes=3 * n)

        best, trials, _ = search_with_share(run, budget=10**9, upper=share, share=share,
                                            steps_only=steps_only, limit=limit)
        assert best == share  # the probe's raw maximum is still the budget's
        within = [n for n in useful if (3 * n if n == share else n) <= limit]
        measured = {t.micro_batch: t.peak_bytes for t in trials}
        if within:
            # The largest useful micro-batch within the limit was measured, and so was the next
            # useful one above it (past the limit), or it is the share.
            answer = within[-1]
            assert answer in measured and measured[answer] <= limit
            above = [n for n in useful if n > answer]
            assert not above or measured.get(above[0], limit + 1) > limit
        else:
            assert all(peak > limit for peak in measured.values())
        assert len(set(runs)) == len(runs)  # nothing measured twice
        if share == 100:
            assert len(runs) <= 6  # 1 + log2 of the 19 useful micro-batches


def test_a_limit_the_largest_fitting_micro_batch_keeps_adds_no_trial():
    runs = []

    def run(n):
        runs.append(n)
        return _trial(n, fits=n <= 20, window=n < 32)

    search_with_share(run, budget=100, upper=32, share=32, limit=20)
    unlimited = list(runs)
    runs.clear()
    search_with_share(run, budget=100, upper=32, share=32)
    assert runs == unlimited


@pytest.mark.parametrize("fits_up_to", [0, 2, 3, 8])
def test_where_only_the_upper_micro_batch_is_worth_a_trial_the_search_runs_one(fits_up_to):
    # A smaller shard group is planned only where it reaches the whole world's micro-batch (3 of
    # a share of 8): one window there says it, whatever the limit.
    runs = []

    def run(n):
        runs.append(n)
        return _trial(n, fits=n <= fits_up_to, window=n < 8)

    best, trials, _ = search_with_share(run, budget=100, upper=3, share=8, least=3, limit=0,
                                        steps_only=True)
    assert runs == [3] and len(trials) == 1 and trials[0].window
    assert best == (3 if fits_up_to >= 3 else 0)


def test_a_plan_past_its_headroom_at_the_largest_fitting_micro_batch_measures_below_it():
    # tiny_lm, 64 samples in 128 MiB less a 30% headroom: 23 fits the budget and not the
    # headroom. The plan's micro-batch (13, 5 steps) is a measured window within it, and so is
    # the one above it that takes fewer steps (16, 4 steps), past it.
    plan = autotune.plan(TINY_LM, target_batch=64, memory_limit="128MiB", device="cpu",
                         precision="fp32", checkpointing="off", headroom=0.3, eval_batch=False)
    probe = plan.chosen_setting.probe
    usable = int(probe.budget_bytes * 0.7)
    assert probe.max_micro_batch == 23 and (plan.micro_batch, plan.accumulation_steps) == (13, 5)
    assert probe.peak_at(23) > usable
    assert probe.trial_at(13) is not None and probe.peak_at(13) <= usable
    assert probe.trial_at(16) is not None and probe.peak_at(16) > usable


@pytest.mark.slow  # about 10 s (a real model's probes and 16 micro-steps): the fast suite is at its 10 minutes
def test_a_hugging_face_plan_measured_below_its_largest_fitting_micro_batch_trains_at_its_peak():
    # A tiny Hugging Face Llama, 256 samples in 40 MiB less a 30% headroom: 49 fits the budget
    # and not the headroom, so the probe measures below it (32 within, 37 past). The built-in
    # loop trains the plan's window at the peak the plan states.
    model = str(EXAMPLES / "real" / "llama.py")
    plan = autotune.plan(model, target_batch=256, memory_limit="40MiB", device="cpu",
                         precision="fp32", checkpointing="off", headroom=0.3, eval_batch=False)
    probe = plan.chosen_setting.probe
    usable = int(probe.budget_bytes * 0.7)
    assert plan.accumulation_steps >= 2 and probe.peak_at(probe.max_micro_batch) > usable
    assert probe.peak_at(plan.micro_batch) is not None and probe.peak_at(plan.micro_batch) <= usable
    result = train(plan, model, steps=2, progress=False)
    trained = max(m["peak_memory_bytes"] for m in result.metrics)
    assert abs(trained - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes, (
        trained, plan.predicted_peak_bytes)


def test_the_limit_the_probe_searches_below_is_agreed_across_ranks(monkeypatch):
    # Under torchrun each rank has its own budget; the sharded trials the search runs below the
    # budget are collectives, so every rank must compare with the same limit (the least).
    from autotune.orchestration import planner as planner_module
    from autotune.orchestration.request import PlanOptions

    seen = {}

    def probe_setting(*args, limit=None, **kwargs):
        seen["limit"] = limit
        raise RuntimeError("stop here")

    monkeypatch.setattr(planner_module, "_probe_setting", probe_setting)
    planner = planner_module._Planner(load_workload(MLP), PlanOptions(
        target_batch=64, device="cpu", memory_limit="64MiB", precision="fp32", checkpointing="off",
        eval_batch=False))
    planner.agree = lambda value: value - 1000  # another rank has less
    with pytest.raises(RuntimeError, match="stop here"):
        planner.try_setting(planner.first)
    assert seen["limit"] == planner.usable - 1000


def test_verify_runs_the_plans_window(tiny_lm_16x2):
    plan, _ = tiny_lm_16x2
    assert plan_window(plan) == [16, 16]
    assert plan_window(dataclasses.replace(plan, micro_batches=[13, 13, 13, 12])) == [13, 13]
    sharded = dataclasses.replace(plan, micro_batches=[13, 13, 12], sharding="fsdp")
    assert plan_window(sharded) == [13, 13, 12]
    assert plan_window(dataclasses.replace(sharded, reduce_every_micro_step=True)) == [13, 13]
    result = verify_plan(plan, workload=TINY_LM, device="cpu", memory_limit="256MiB", steps=1,
                         replan=False)
    assert result.confirmed and abs(result.error_fraction) < 0.01


def test_cpu_loop_holds_steps_to_the_plans_budget(tiny_lm_16x2):
    plan, peaks = tiny_lm_16x2
    # A plan that under-predicts (as the single-step probe did) with its budget just below the
    # window's real peak: the CPU loop stops with both numbers instead of training on.
    wrong = dataclasses.replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes - 4_000_000,
                                device=dataclasses.replace(plan.device,
                                                           budget_bytes=max(peaks) - 1_000_000))
    with pytest.raises(PlanExceeded, match=r"step 2 needed .* past the plan's budget of .*, where "
                                           r"the plan predicted .*: the plan under-estimated"):
        train(wrong, TINY_LM, steps=3, progress=False)


def test_a_peak_past_the_prediction_by_more_than_the_headroom_warns():
    check = PlanCheck(predicted_bytes=100 << 20, budget_bytes=None, headroom_bytes=10 << 20)
    assert check.over(3, 105 << 20, "allocated") is None
    warning = check.over(3, 120 << 20, "allocated")
    assert warning.startswith("step 3 peaked at 120.00 MiB (allocated), above the plan's predicted "
                              "100.00 MiB by 20.00 MiB, more than the 10.00 MiB of headroom")
    # DDP's buckets, which the CPU meter does not see, count against the prediction.
    buckets = dataclasses.replace(check, untracked_bytes=20 << 20)
    assert buckets.over(3, 95 << 20, "tensors") is not None


@pytest.mark.slow
def test_sharded_plan_decides_when_gradients_are_reduced():
    kwargs = dict(target_batch=32, world_size=2, sharding="fsdp", micro_batch=8, device="cpu",
                  precision="fp32", checkpointing="off", headroom=0.0)
    roomy = autotune.plan(TINY_LM, memory_limit="256MiB", **kwargs)
    assert roomy.reduce_every_micro_step is False
    why = roomy.reasons["gradient_sync"]
    assert why.startswith("last micro-step only: holding this rank's unsharded gradients through "
                          "the window (3.59 MiB of unsharded gradients) peaks at")
    assert "reduce-scattering every micro-step (2 reduce-scatters per optimizer step) peaks at" in why
    assert "3.59 MiB of this rank's unsharded gradients (synced on the last micro-step)" in \
        roomy.reasons["memory"]
    # A budget between the two windows: reduce-scatter every micro-step.
    tight = autotune.plan(TINY_LM, memory_limit=roomy.predicted_peak_bytes - 1024, **kwargs)
    assert tight.micro_batches == [8, 8] and tight.reduce_every_micro_step is True
    assert tight.reasons["gradient_sync"].startswith(
        "every micro-step: holding this rank's unsharded gradients until the last micro-step "
        "(3.59 MiB of unsharded gradients) runs out of memory; reduce-scattering every micro-step")
    assert "sharded gradients (reduce-scattered every micro-step)" in tight.reasons["memory"]
    assert tight.predicted_peak_bytes < roomy.predicted_peak_bytes
    # The CLI's summary says it.
    from autotune.cli.format import format_plan

    assert f"grad sync:    {tight.reasons['gradient_sync']}" in format_plan(tight).splitlines()


def test_a_probe_without_a_share_says_its_trials_are_single_steps():
    from autotune.memory.fake import EstimateMemoryBackend

    result = autotune.probe(TINY_LM, backend=EstimateMemoryBackend(64 << 20), max_micro_batch=4)
    assert not any(t.window for t in result.trials)
    assert ("each trial is one step: with gradient accumulation every micro-step after a window's "
            "first also holds the gradients (3.59 MiB), which autotune plan measures") in result.notes
