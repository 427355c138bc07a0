"""Throughput search: pruning for memory (predicted and on OOM), the winner, study resume, --budget,
and `autotune plan --optimize throughput` end to end on a tiny model."""

import dataclasses
import json
import statistics

import optuna
import pytest
import torch
from click.testing import CliRunner

import autotune
from autotune.cli.main import cli
from autotune.errors import ConfigError
from autotune.memory import CPUMemoryBackend
from autotune.planning.planfile import plan_from_json, plan_schema, plan_to_json
from autotune.cli.format import format_throughput
from autotune.units import format_bytes
from autotune.planning.policy import split_share
from autotune.tuning.search import (Candidate, build_candidates, parse_duration,
                                        search_throughput, split_choices, why_fastest)
from autotune.tuning.measure import (COMPARE_MIN_ROUNDS, Configuration, Measurement,
                                 compare_configurations, measure_configuration)
from autotune.workload.contract import Workload
from plan_helpers import MiB, linear_probe, make_plan, setting

SPEEDS = {("fp32", False, 8): 100.0, ("fp32", False, 16): 180.0, ("fp32", False, 32): 150.0,
          ("bf16", False, 8): 120.0, ("bf16", False, 16): 210.0, ("bf16", False, 32): 200.0}


class FakeMeasure:
    """Deterministic samples/s per (precision, checkpointing, micro-batch); counts measurements."""

    def __init__(self, speeds=SPEEDS, oom=()):
        self.speeds, self.oom, self.calls, self.compared, self.seconds_left = speeds, set(oom), [], [], []

    def __call__(self, config: Configuration, seconds: float | None = None) -> Measurement:
        key = (config.precision, config.checkpointing.enabled, config.micro_batch)
        self.calls.append(key)
        self.seconds_left.append(seconds)
        if key in self.oom:
            return Measurement(samples_per_s=None, peak_bytes=None, out_of_memory=True)
        speed = self.speeds[key]
        if isinstance(speed, list):  # one value per measurement, the last one repeating
            speed = speed.pop(0) if len(speed) > 1 else speed[0]
        return Measurement(samples_per_s=speed, peak_bytes=config.micro_batch * MiB)

    def compare(self, configs, seconds):
        """Side by side: each configuration measured once more, at the same moment."""
        self.compared.append(([(c.precision, c.checkpointing.enabled, c.micro_batch) for c in configs], seconds))
        return [Measurement(samples_per_s=m.samples_per_s, peak_bytes=None,
                            out_of_memory=m.out_of_memory) for m in map(self, configs)]


class Ticking(FakeMeasure):
    """``FakeMeasure`` on a fake clock (``now``): each measurement takes a second, ``setup_s`` of it
    its set-up; a comparison takes the seconds it is given."""

    def __init__(self, speeds=SPEEDS, *, setup_s=0.0):
        super().__init__(speeds)
        self.clock, self.setup_s = 0.0, setup_s

    def now(self) -> float:
        return self.clock

    def __call__(self, config, seconds=None):
        self.clock += 1.0
        return dataclasses.replace(super().__call__(config, seconds), setup_seconds=self.setup_s)

    def compare(self, configs, seconds):
        self.compared.append((configs, seconds))
        self.clock += seconds
        return [Measurement(samples_per_s=self.speeds[(c.precision, c.checkpointing.enabled, c.micro_batch)],
                            peak_bytes=None) for c in configs]


def _candidates(fits_up_to=32, precisions=("fp32", "bf16")):
    found = []
    for precision in precisions:
        for m in (8, 16, 32, 64):
            config = Configuration(precision=precision, checkpointing=False, micro_batches=(m,) * (64 // m))
            found.append(Candidate(config=config, predicted_peak_bytes=m * MiB,
                                   predicted_fits=m <= fits_up_to, why_not="predicted too big"))
    return found


def _search(measure, storage=None, candidates=None, name="test-study", budget_s=30, **options):
    return search_throughput(candidates or _candidates(), measure, measure.compare, budget_s=budget_s,
                             usable_bytes=1000 * MiB, study_name=name, storage=storage, **options)


def _states(storage, name="test-study"):
    study = optuna.load_study(study_name=name, storage=storage)
    return {(t.params["precision"], max(t.user_attrs["micro_batches"])): t.state for t in study.trials
            if "status" in t.user_attrs}


def test_predicted_misfits_are_pruned_without_a_step(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    measure = FakeMeasure()
    result = _search(measure, storage)
    assert all(key[2] <= 32 for key in measure.calls)  # micro-batch 64 never ran
    pruned = [r for r in result.records if r.micro_batch == 64]
    assert len(pruned) == 2 and all(r.status == "pruned" and not r.fits for r in pruned)
    assert all(r.samples_per_s is None and r.peak_bytes is None for r in pruned)
    assert _states(storage)[("fp32", 64)] == optuna.trial.TrialState.PRUNED


def test_out_of_memory_is_a_pruned_trial_not_a_failed_one(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    result = _search(FakeMeasure(oom={("bf16", False, 16)}), storage)
    record = next(r for r in result.records if (r.precision, r.micro_batch) == ("bf16", 16))
    assert record.status == "pruned" and not record.fits and "out of memory" in record.note
    states = _states(storage)
    assert states[("bf16", 16)] == optuna.trial.TrialState.PRUNED
    assert optuna.trial.TrialState.FAIL not in states.values()
    # The fastest that fits wins, not the OOM one.
    assert (result.winner.precision, result.winner.micro_batch) == ("bf16", 32)


def test_the_winner_is_the_best_measured():
    measure = FakeMeasure()
    result = _search(measure)
    assert sorted(measure.calls[:6]) == sorted(SPEEDS)  # a small space is measured exhaustively
    # Then the four fastest side by side, once, in what is left of the budget.
    top = [("bf16", False, 16), ("bf16", False, 32), ("fp32", False, 16), ("fp32", False, 32)]
    assert [configs for configs, _ in measure.compared] == [top] and len(measure.calls) == 10
    assert 0 < measure.compared[0][1] <= 30
    assert (result.winner.precision, result.winner.micro_batch) == ("bf16", 16) and result.winner.compared
    assert result.winner.samples_per_s == max(SPEEDS.values())
    assert [r.samples_per_s for r in result.records[:6]] == sorted(SPEEDS.values(), reverse=True)
    assert [r.compared for r in result.records[:6]] == [True] * 4 + [False] * 2
    assert "timed side by side with 3 other(s)" in why_fastest(result)


def test_the_side_by_side_comparison_decides_between_the_fastest():
    # bf16/16 is the fastest, but its single measurement fell into a fast moment of the machine
    # and fp32/16's into a slow one; side by side, fp32/16 is faster.
    speeds = {**SPEEDS, ("bf16", False, 16): [260.0, 190.0], ("fp32", False, 16): [180.0, 230.0]}
    result = _search(FakeMeasure(speeds))
    assert (result.winner.precision, result.winner.micro_batch, result.winner.samples_per_s) == \
        ("fp32", 16, 230.0)
    # The table leads with the comparison (same moments), then the single measurements.
    assert [r.samples_per_s for r in result.records[:4]] == [230.0, 200.0, 190.0, 150.0]
    alone = _search(FakeMeasure({**speeds, ("bf16", False, 16): [260.0, 190.0],
                                 ("fp32", False, 16): [180.0, 230.0]}), name="once", confirm_top=0)
    assert (alone.winner.precision, alone.winner.micro_batch) == ("bf16", 16)


def test_the_memory_plan_of_a_contending_setting_is_compared_too():
    # bf16/32 (bf16's memory plan) was measured in a slow moment: not among the two fastest.
    speeds = {**SPEEDS, ("bf16", False, 32): [140.0, 230.0]}
    measure = FakeMeasure(speeds)
    result = _search(measure, confirm_top=2)
    assert measure.compared[0][0] == [("bf16", False, 16), ("fp32", False, 16),
                                      ("bf16", False, 32), ("fp32", False, 32)]
    assert (result.winner.precision, result.winner.micro_batch, result.winner.samples_per_s) == \
        ("bf16", 32, 230.0)


def test_a_contender_out_of_memory_beside_the_others_is_no_winner():
    class Flaky(FakeMeasure):
        def compare(self, configs, seconds):
            found = super().compare(configs, seconds)
            found[0] = Measurement(samples_per_s=None, peak_bytes=None, out_of_memory=True)
            return found

    result = _search(Flaky())
    lost = next(r for r in result.records if (r.precision, r.micro_batch) == ("bf16", 16))
    assert not lost.fits and lost.status == "pruned" and "out of memory" in lost.note
    assert (result.winner.precision, result.winner.micro_batch) == ("bf16", 32)


def test_the_comparison_stays_within_the_budget():
    measure = Ticking(setup_s=0.5)
    result = _search(measure, budget_s=10, clock=measure.now)
    # 6 to explore (a seventh would end past 70% of the budget), then the comparison in the rest.
    assert len(measure.calls) == 6 and len(measure.compared) == 1
    # Each measurement is told what the exploration (70% of the budget) has left.
    assert measure.seconds_left == pytest.approx([7.0, 6.0, 5.0, 4.0, 3.0, 2.0])
    assert measure.compared[0][1] == pytest.approx(10 - 6) and result.seconds <= 10
    # Its warm-up and fixed rounds run a window of each contender 4 times (64 samples at 210, 200,
    # 180 and 150/s: 1.22, 2.50, 3.92, 5.62 s for the fastest 1 to 4): the two fastest fit the 3.5 s
    # its set-up leaves.
    assert [(c.precision, c.micro_batch) for c in measure.compared[0][0]] == [("bf16", 16), ("bf16", 32)]
    assert [r.compared for r in result.records[:3]] == [True, True, False]
    short = Ticking(setup_s=0.5)
    _search(short, budget_s=4.5, name="short", clock=short.now)  # 3 explored, 1 s left after a set-up
    assert short.compared == []


def test_no_comparison_where_the_time_left_holds_the_fixed_rounds_of_fewer_than_two():
    measure = Ticking({key: speed / 10 for key, speed in SPEEDS.items()})  # windows of 3-5 s
    result = _search(measure, budget_s=20, clock=measure.now)
    # 14 s left after 6 measurements: 4 windows of the fastest take 12.2 s, of the two fastest 25.
    assert len(measure.calls) == 6 and measure.compared == []
    assert not any(r.compared for r in result.records) and result.winner.samples_per_s == 21.0


def test_a_memory_plan_past_the_budget_gives_way_to_the_next_split_at_once():
    # A space too large to queue whole: only the memory plans are queued, TPE picks the rest.
    found, speeds = [], {}
    for precision in ("fp32", "bf16"):
        for m in split_choices(64):
            config = Configuration(precision=precision, checkpointing=False,
                                   micro_batches=tuple(split_share(64, m)))
            found.append(Candidate(config=config, predicted_peak_bytes=m * MiB,
                                   predicted_fits=m <= 32, why_not="predicted too big"))
            speeds[(precision, False, m)] = 100.0 + m
    measure = FakeMeasure(speeds, oom={("fp32", False, 32)})
    _search(measure, candidates=found, budget_s=30)
    assert measure.calls[:3] == [("fp32", False, 32), ("bf16", False, 32), ("fp32", False, 22)]


def test_memory_plans_are_measured_first():
    measure = FakeMeasure()
    _search(measure)
    assert set(measure.calls[:2]) == {("fp32", False, 32), ("bf16", False, 32)}


def test_a_stored_study_resumes_without_measuring_again(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = FakeMeasure()
    _search(first, storage, candidates=_candidates(precisions=("fp32",)), confirm_top=0)
    assert len(first.calls) == 3
    second = FakeMeasure()
    result = _search(second, storage, confirm_top=0)  # bf16 added: only its configurations are new
    assert sorted(second.calls) == [("bf16", False, 8), ("bf16", False, 16), ("bf16", False, 32)]
    assert result.reused == 3 and result.measured == 3
    third = FakeMeasure()
    again = _search(third, storage)  # every result reused: nothing is measured again either
    assert third.calls == [] and again.winner.samples_per_s == 210.0


def test_a_stored_measurement_too_big_for_this_budget_is_redone(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    _search(FakeMeasure(), storage)
    measure = FakeMeasure()
    search_throughput(_candidates(), measure, measure.compare, budget_s=30, usable_bytes=20 * MiB,
                      study_name="test-study", storage=storage)
    assert sorted(measure.calls) == [("bf16", False, 32), ("fp32", False, 32)]


@pytest.mark.parametrize("text,seconds", [("60s", 60), ("2m", 120), ("90", 90), ("1.5m", 90), (45, 45)])
def test_budget_parsing(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-5s", "0", "10x"])
def test_bad_budget_names_the_option(text):
    from autotune.errors import cli_words

    with pytest.raises(ConfigError, match=f"budget={text!r}"):  # plan(budget=...) from Python
        parse_duration(text)
    with cli_words(), pytest.raises(ConfigError, match=f"--budget {text!r}"):
        parse_duration(text)


def test_bad_budget_exits_2_naming_the_option(examples_dir):
    result = CliRunner().invoke(cli, ["plan", str(examples_dir / "gpt_varlen.py"), "--target-batch", "8",
                                      "--optimize", "throughput", "--budget", "soon"])
    assert result.exit_code == 2
    assert "--budget 'soon'" in result.output


def test_candidates_are_exact_splits_with_predictions():
    probe = linear_probe(20, base=100 * MiB, per_sample=10 * MiB)
    tried = setting(probe, headroom=0.0)
    candidates = build_candidates([tried], share=64, usable=1000 * MiB)
    assert all(c.config.share == 64 for c in candidates)
    fitting = [c.config.micro_batch for c in candidates if c.predicted_fits]
    assert fitting == [m for m in split_choices(64) if m <= 20]
    beyond = [c for c in candidates if not c.predicted_fits]
    assert [c.config.micro_batch for c in beyond] == [22] and "not run" in beyond[0].why_not
    # A warm-up window of 64 samples at the fastest rate of the probe's fitting trials (0.01 s at
    # micro-batch 1 and at 20): 64 x 0.01 / 20 s.
    assert [c.warm_up_s for c in candidates if c.predicted_fits] == pytest.approx([64 * 0.01 / 20] * len(fitting))


def test_a_configuration_whose_warm_up_would_end_past_the_budget_is_not_started(tmp_path):
    # bf16's windows are 20 s at the probe's rate (a CPU without bf16 units), the budget 10 s:
    # fp32 is measured, bf16 is not started and says why; the first measurement always runs.
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    slow_bf16 = [dataclasses.replace(c, warm_up_s=20.0 if c.config.precision == "bf16" else 0.5)
                 for c in _candidates()]
    measure = Ticking()
    result = _search(measure, storage, candidates=slow_bf16, budget_s=10, clock=measure.now, confirm_top=0)
    assert {precision for precision, _, _ in measure.calls} == {"fp32"} and len(measure.calls) == 3
    skipped = [r for r in result.records if r.status == "skipped"]
    assert sorted(r.micro_batch for r in skipped) == [8, 16, 32]
    assert all(r.precision == "bf16" and r.samples_per_s is None and "warm-up window would take 20.0s"
               in r.note for r in skipped)
    assert result.winner.precision == "fp32"
    assert "3 not measured: their warm-up window alone would end past the budget" in why_fastest(result)
    # In the table and the plan file as such.
    plan = make_plan(target=64)
    plan.throughput = result.records
    assert "skipped: its warm-up window would take 20.0s or more (its probe's trials)" in format_throughput(plan)
    text = plan_to_json(plan)
    assert [r.status for r in plan_from_json(text).throughput] == [r.status for r in result.records]
    pytest.importorskip("jsonschema").validate(json.loads(text), plan_schema())
    # A rerun with the time for them measures them (a skip is not a result).
    again = FakeMeasure()
    _search(again, storage, candidates=slow_bf16, budget_s=100, confirm_top=0)
    assert sorted(again.calls) == [("bf16", False, 8), ("bf16", False, 16), ("bf16", False, 32)]
    # Nothing measured yet: the first configuration runs whatever its warm-up.
    first = Ticking()
    _search(first, candidates=[dataclasses.replace(c, warm_up_s=20.0) for c in _candidates()],
            budget_s=10, name="first", clock=first.now, confirm_top=0)
    assert len(first.calls) == 1


def test_the_memory_plan_with_the_shortest_predicted_warm_up_is_measured_first():
    # fp32's warm-up (20 s predicted) passes the 10 s budget, bf16's (0.5 s) does not: bf16's
    # memory plan runs first, then fp32's is not started. Before, fp32's came first and, nothing
    # being measured yet, ran whatever its warm-up: 20 s of a 10 s budget.
    slow_fp32 = [dataclasses.replace(c, warm_up_s=20.0 if c.config.precision == "fp32" else 0.5)
                 for c in _candidates()]
    measure = Ticking()
    result = _search(measure, candidates=slow_fp32, budget_s=10, name="shortest", clock=measure.now,
                     confirm_top=0)
    assert measure.calls[0] == ("bf16", False, 32)
    assert {precision for precision, _, _ in measure.calls} == {"bf16"}
    assert {r.precision for r in result.records if r.status == "skipped"} == {"fp32"}
    # With the budget for both, both memory plans are measured, the shorter first.
    both = Ticking()
    _search(both, candidates=slow_fp32, budget_s=100, name="both", clock=both.now, confirm_top=0)
    assert both.calls[:2] == [("bf16", False, 32), ("fp32", False, 32)]


def test_a_skipped_configuration_sampled_again_is_not_evaluated_again(tmp_path):
    # In a space too large to queue whole, TPE repeats itself: one stored result per skipped
    # configuration (before, each repeat was evaluated and stored again, and reset the count of
    # trials that proposed nothing new). bf16's warm-up (20 s) passes the 15 s budget throughout.
    found, speeds = [], {}
    for precision in ("fp32", "bf16"):
        for m in split_choices(64):
            config = Configuration(precision=precision, checkpointing=False, micro_batches=tuple(split_share(64, m)))
            found.append(Candidate(config=config, predicted_peak_bytes=m * MiB, predicted_fits=True,
                                   warm_up_s=20.0 if precision == "bf16" else 0.1))
            speeds[(precision, False, m)] = 100.0 + m
    large = f"sqlite:///{tmp_path / 'large.db'}"
    _search(FakeMeasure(speeds), large, candidates=found, budget_s=15, name="large", clock=lambda: 0.0,
            confirm_top=0)
    stored = [t for t in optuna.load_study(study_name="large", storage=large).trials
              if t.user_attrs.get("status") == "skipped"]
    assert stored and len(stored) == len({max(t.user_attrs["micro_batches"]) for t in stored})


def _tiny_workload():
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 1))

    return Workload(model=build, make_batch=lambda n: torch.randn(n, 64),
                    loss_fn=lambda m, b: m(b).pow(2).mean(), source="tiny")


def test_real_measurement_and_a_real_out_of_memory():
    backend = CPUMemoryBackend(memory_limit="2MiB")
    fits = measure_configuration(_tiny_workload(), backend,
                                 Configuration(precision="fp32", checkpointing=False, micro_batches=(8, 8)),
                                 windows=2, min_seconds=0)
    assert fits.samples_per_s > 0 and not fits.out_of_memory and len(fits.window_seconds) == 2
    assert fits.samples_per_s == 16 / min(fits.window_seconds)
    longer = measure_configuration(_tiny_workload(), backend,
                                   Configuration(precision="fp32", checkpointing=False, micro_batches=(8, 8)),
                                   windows=2, min_seconds=0.05)
    # Windows are timed until they add up to the minimum (or the window cap), and no further.
    from autotune.tuning.measure import MAX_TIMED_WINDOWS
    times = longer.window_seconds
    assert 2 <= len(times) <= MAX_TIMED_WINDOWS
    assert sum(times) >= 0.05 or len(times) == MAX_TIMED_WINDOWS
    assert len(times) == 2 or sum(times[:-1]) < 0.05
    assert 0 < fits.peak_bytes < 2 * MiB
    big = measure_configuration(_tiny_workload(), backend,
                                Configuration(precision="fp32", checkpointing=False, micro_batches=(2048,)),
                                windows=1)
    assert big.out_of_memory and big.samples_per_s is None


def test_no_timed_window_starts_that_would_end_past_the_seconds_left():
    # Each window sleeps 0.2 s: of 30 windows asked for (6 s and more), those that end within
    # the 3 s left (after the set-up and the warm-up) run; with nothing left, the warm-up's time
    # stands. Bounds are loose: on CI's loaded cores a 0.2 s window took 0.28 s, and the set-up
    # and teardown around the windows vary as much.
    import time

    slow = dataclasses.replace(_tiny_workload(), loss_fn=lambda m, b: (time.sleep(0.2), m(b).pow(2).mean())[1])
    config = Configuration(precision="fp32", checkpointing=False, micro_batches=(8,))
    backend = CPUMemoryBackend(memory_limit="2MiB")
    unbounded = measure_configuration(slow, backend, config, windows=3, min_seconds=0)
    assert len(unbounded.window_seconds) == 3 and not unbounded.warm_up_only
    bounded = measure_configuration(slow, backend, config, windows=30, min_seconds=0, seconds=3.0)
    assert 1 <= len(bounded.window_seconds) < 15 and not bounded.warm_up_only
    # The timed windows, after the set-up and the warm-up, end within the 3 s but for the last one
    # running longer than the one before. (Not the whole measurement's time: its teardown took
    # 1 s on CI's loaded cores, 4.07 s in all.)
    assert sum(bounded.window_seconds) < 3.0 + max(bounded.window_seconds)
    none_left = measure_configuration(slow, backend, config, windows=30, min_seconds=0, seconds=0.0)
    assert none_left.warm_up_only and none_left.window_seconds == ()
    assert 0 < none_left.samples_per_s <= 8 / 0.2 and none_left.peak_bytes == bounded.peak_bytes


def test_a_configuration_timed_by_its_warm_up_alone_says_so_and_is_measured_again_by_a_rerun(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"

    class WarmUpOnly(FakeMeasure):
        def __call__(self, config, seconds=None):
            measured = super().__call__(config, seconds)
            measured.warm_up_only = config.precision == "bf16"
            return measured

    first = _search(WarmUpOnly(), storage, confirm_top=0)
    assert all(r.warm_up_only == (r.precision == "bf16") for r in first.records if r.status == "measured")
    assert "3 by their warm-up window alone: the budget left no timed window" in why_fastest(first)
    again = FakeMeasure()
    _search(again, storage, confirm_top=0)
    assert sorted(again.calls) == [("bf16", False, 8), ("bf16", False, 16), ("bf16", False, 32)]


def test_a_measured_window_counts_the_micro_batch_a_step_holds_not_the_whole_windows_samples():
    # Wide inputs (64 KiB a sample) into a small model: the warm-up counted the whole window's
    # samples (each micro-batch a view of them), so 8 micro-batches of 8 measured 3 MiB more
    # than 2 of 8, and more than the plan's window trial, which makes one micro-batch at a time.
    from autotune.probing.api import window_trial

    def wide():
        return Workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(16384, 8), torch.nn.ReLU(),
                                                          torch.nn.Linear(8, 1)),
                        make_batch=lambda n: torch.randn(n, 16384),
                        loss_fn=lambda m, b: m(b).pow(2).mean(), source="wide")

    peaks = {}
    for steps in (2, 8):
        measured = measure_configuration(wide(), CPUMemoryBackend(memory_limit="64MiB"), Configuration(
            precision="fp32", checkpointing=False, micro_batches=(8,) * steps), windows=1, min_seconds=0)
        planned = window_trial(wide(), CPUMemoryBackend(memory_limit="64MiB"), micro_batch=8, window=steps,
                               precision="fp32", checkpointing="off")
        peaks[steps] = measured.peak_bytes
        # The trial holds its last micro-batch through the optimizer phase (the plan's peak is
        # at most that much over); the measured micro-steps are the trial's.
        assert planned.activation_peak_bytes - 1024 <= measured.peak_bytes <= planned.peak_bytes, (
            steps, measured.peak_bytes, planned)
    assert abs(peaks[8] - peaks[2]) <= 1024


def test_real_side_by_side_comparison():
    backend = CPUMemoryBackend(memory_limit="64MiB")
    configs = [Configuration(precision="fp32", checkpointing=False, micro_batches=(8, 8)),
               Configuration(precision="bf16", checkpointing=True, micro_batches=(16,)),
               Configuration(precision="fp32", checkpointing=True, micro_batches=(4, 4, 4, 4))]
    found = compare_configurations(_tiny_workload(), backend, configs, seconds=0.05)
    # Round by round: every configuration got the same number of timed windows, at least three.
    counts = {len(m.window_seconds) for m in found}
    assert len(counts) == 1 and counts.pop() >= COMPARE_MIN_ROUNDS
    assert all(m.samples_per_s == 16 / statistics.median(m.window_seconds) and not m.out_of_memory
               for m in found)
    assert backend.current_bytes() == 0  # nothing left behind, checkpointing undone with the model
    # Past the fixed rounds, no round starts that would end past the seconds given: two windows
    # that sleep 0.3 s each, 2.9 s given. The warm-up round and the three timed ones end after
    # 2.4 s and more; a fifth would end past 3.0 (it ran before: the round started in time).
    import time

    slow = dataclasses.replace(_tiny_workload(), loss_fn=lambda m, b: (time.sleep(0.3), m(b).pow(2).mean())[1])
    single = [Configuration(precision="fp32", checkpointing=on, micro_batches=(16,)) for on in (False, True)]
    bounded = compare_configurations(slow, backend, single, seconds=2.9)
    assert [len(m.window_seconds) for m in bounded] == [COMPARE_MIN_ROUNDS] * 2
    with pytest.raises(ValueError, match="same share"):
        compare_configurations(_tiny_workload(), backend, [configs[0], Configuration(
            precision="fp32", checkpointing=False, micro_batches=(8,))], seconds=0.01)


@pytest.mark.slow  # 15-30 s: the fast suite is at its 10 minutes
def test_plan_api_picks_the_fastest_and_records_the_table(monkeypatch, tmp_path):
    def fake_probe(workload, *, precision, checkpointing, max_micro_batch, backend, **_):
        return linear_probe(min(32, max_micro_batch), precision=precision, upper=max_micro_batch)

    speeds = {(p, False, m): (300.0 if (p, m) == ("fp32", 22) else 100.0 + m)
              for p in ("fp32", "bf16") for m in split_choices(64)}
    monkeypatch.setattr("autotune.orchestration.planner.probe", fake_probe)
    fake = FakeMeasure(speeds)
    monkeypatch.setattr("autotune.orchestration.planner.measure_configuration",
                        lambda workload, backend, config, seconds=None: fake(config, seconds))
    monkeypatch.setattr("autotune.orchestration.planner.compare_configurations",
                        lambda workload, backend, configs, seconds: fake.compare(configs, seconds))
    plan = autotune.plan(_tiny_workload(), target_batch=64, device="cpu", headroom=0.0,
                         optimize="throughput", budget="10s", checkpointing="off")
    assert plan.optimize == "throughput"
    assert (plan.precision, plan.micro_batches) == ("fp32", [22, 21, 21])
    assert "fastest measured" in plan.reasons["throughput"]
    assert max(c.samples_per_s or 0 for c in plan.throughput if c.fits) == 300.0
    winner = next(c for c in plan.throughput if c.samples_per_s == 300.0)
    assert winner.compared and "300.0 (side by side)" in format_throughput(plan)
    text = plan_to_json(plan)
    assert plan_from_json(text).throughput == plan.throughput
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(text), plan_schema())


def test_a_winner_below_the_probes_trial_states_the_peak_it_trains_at(monkeypatch):
    """Where the whole share fits, the probe's one trial draws a line from the baseline, which
    cannot tell what a step holds whatever its micro-batch (bf16 autocast's copy of each weight)
    from what grows with it: the measured winner's smaller micro-batch was predicted off both
    ways (gpt2 at 16 x 2: 21.64 MB planned, 21.75 trained; this model at 4 x 8: 10.03 planned,
    8.42 trained). The plan's own micro-batch is measured, as the memory rule's is."""
    import autotune.training.metrics as metrics
    from autotune.training import train

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                   torch.nn.ReLU(), torch.nn.Linear(512, 1))

    workload = Workload(model=build, make_batch=lambda n: torch.randn(n, 256),
                        loss_fn=lambda m, b: m(b).float().pow(2).mean(), source="weights")
    speeds = {("bf16", False, m): (500.0 if m == 4 else 100.0) for m in split_choices(32)}
    fake = FakeMeasure(speeds)
    monkeypatch.setattr("autotune.orchestration.planner.measure_configuration",
                        lambda workload, backend, config, seconds=None: fake(config, seconds))
    monkeypatch.setattr("autotune.orchestration.planner.compare_configurations",
                        lambda workload, backend, configs, seconds: fake.compare(configs, seconds))
    plan = autotune.plan(workload, target_batch=32, device="cpu", memory_limit="64MiB", precision="bf16",
                         checkpointing="off", optimize="throughput", budget="10s", eval_batch=False)
    assert plan.micro_batches == [4] * 8
    assert [t.micro_batch for t in plan.chosen_setting.probe.trials] == [32, 4]  # the share, then its own
    # The search's table states that peak on the plan's row, not the line's (which it was pruned by).
    row, = [c for c in plan.throughput if c.micro_batches == plan.micro_batches and c.fits]
    assert row.predicted_peak_bytes == plan.predicted_peak_bytes
    assert format_bytes(plan.predicted_peak_bytes) in next(
        line for line in format_throughput(plan).splitlines() if line.endswith("<- plan"))
    monkeypatch.setattr(metrics, "COUNT_EVERY", 1)
    done = train(plan, workload, steps=3, progress=False)
    trained = max(m["peak_memory_bytes"] for m in done.metrics if m.get("peak_memory_bytes"))
    assert trained <= plan.predicted_peak_bytes <= trained * 1.01


@pytest.mark.slow
def test_cli_optimize_throughput_end_to_end(examples_dir, tmp_path):
    out = tmp_path / "plan.json"
    runner = CliRunner()
    result = runner.invoke(cli, ["plan", str(examples_dir / "gpt_varlen.py"), "--target-batch", "16",
                                 "--optimize", "throughput", "--budget", "8s", "--memory-limit", "8MiB",
                                 "--storage", f"sqlite:///{tmp_path / 'a.db'}", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "throughput search" in result.output and "<- plan" in result.output
    plan = autotune.load_plan(out)
    measured = [c for c in plan.throughput if c.fits and c.samples_per_s is not None]
    assert measured and plan.effective_batch == 16
    # The winner is the fastest of those timed again side by side (when any were): they rank
    # above single measurements taken at other moments.
    best = max(measured, key=lambda c: (c.compared, c.samples_per_s))
    assert (best.precision, best.checkpointing, best.micro_batches) == \
        (plan.precision, plan.checkpointing, plan.micro_batches)
    shown = runner.invoke(cli, ["show", str(out)])
    assert shown.exit_code == 0 and "throughput search" in shown.output
