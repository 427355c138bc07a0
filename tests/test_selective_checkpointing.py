"""Selective activation checkpointing: K of the N repeated blocks, chosen by the planner."""

import dataclasses
import json
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import autotune
from autotune.cli.main import cli
from autotune.errors import ConfigError
from autotune.memory import backend_for
from autotune.planning.planfile import load_plan, save_plan
from autotune.planning.policy import predicted_blocks
from autotune.precision import Precision
from autotune.probing.blocks import learn_block_model
from autotune.probing.trial import TrialSession
from autotune.training import train
from autotune.workload.activation_checkpointing import (checkpointable_blocks, disable_checkpointing,
                                                         enable_checkpointing, spread_evenly)
from autotune.workload.checkpoint_count import Checkpointing, CheckpointingRequest, resolve_blocks
from autotune.workload.contract import Workload, load_workload
from train_helpers import make_plan

MiB = 1 << 20


# --- the value and the blocks ----------------------------------------------------------------------

@pytest.mark.parametrize("value, parsed", [
    ("auto", "auto"), ("off", "off"), ("ON", "on"), (True, "on"), (False, "off"), ("3", 3), (0, 0),
    ("1/3", Fraction(1, 3)), ("0.5", Fraction(1, 2)), ("0", 0), ("1", 1), ("0/4", "off"),
])
def test_checkpointing_values_parse(value, parsed):
    assert CheckpointingRequest.parse(value).value == parsed


def test_auto_is_refused_where_a_count_is_needed():
    with pytest.raises(ConfigError, match="off, on"):
        CheckpointingRequest.parse("auto", allow_auto=False)


@pytest.mark.parametrize("value, total, blocks", [
    ("off", 12, 0), ("on", 12, 12), ("1/3", 12, 4), ("1/3", 4, 2), ("0.5", 4, 2), ("4", 12, 4),
    (1, 1, 1), (Fraction(1, 12), 12, 1),
])
def test_resolve_blocks(value, total, blocks):
    assert resolve_blocks(value, total) == blocks


def test_more_blocks_than_the_model_has_is_an_error_that_names_the_count():
    with pytest.raises(ConfigError, match="has 4 repeated blocks"):
        resolve_blocks("5", 4)


@pytest.mark.parametrize("count, total, chosen", [
    (0, 4, []), (1, 4, [0]), (2, 4, [0, 2]), (3, 4, [0, 1, 2]), (4, 4, [0, 1, 2, 3]), (4, 12, [0, 3, 6, 9]),
    (5, 12, [0, 2, 4, 7, 9]),
])
def test_blocks_are_spread_evenly_from_the_first(count, total, chosen):
    assert spread_evenly(count, total) == chosen


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x))


def _stack(n=6):
    return nn.Sequential(*(_Counting() for _ in range(n)))


@pytest.mark.parametrize("count", [0, 2, 6])
def test_k_blocks_rerun_their_forward_in_backward_and_no_others(count):
    model = _stack()
    assert enable_checkpointing(model, blocks=count) == count
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    reruns = [i for i, block in enumerate(model) if block.calls == 2]
    assert reruns == spread_evenly(count, 6)
    assert all(block.calls in (1, 2) for block in model)
    disable_checkpointing(model)
    assert not any("forward" in vars(block) for block in model)


# --- the estimate and the memory model against the CPU backend --------------------------------

def _measured_peaks(workload, micro_batch, counts):
    backend = backend_for("cpu", "4GiB")
    with TrialSession(workload, backend, precision=Precision.FP32) as session:
        return {k: (session.set_checkpointing(k), session.run(micro_batch).peak_bytes)[1] for k in counts}


@pytest.mark.parametrize("example, micro_batch", [
    ("gpt_varlen.py", 24), pytest.param("tiny_lm.py", 6, marks=pytest.mark.slow)])
def test_estimates_for_every_k_match_the_cpu_backends_peak(one_thread, examples_dir, example, micro_batch):
    workload = load_workload(examples_dir / example)
    total = len(checkpointable_blocks(workload.new_model()))
    measured = _measured_peaks(workload, micro_batch, range(total + 1))
    for k, peak in measured.items():
        estimated = autotune.estimate_peak(workload, micro_batch, checkpointing=k)
        assert abs(estimated - peak) <= 0.03 * peak, (k, estimated, peak)
    assert len(set(measured.values())) == total + 1  # every count changes the peak


@pytest.mark.parametrize("example, sizes, micro_batch", [("gpt_varlen.py", (16, 48), 32),
                                                         ("tiny_lm.py", (4, 12), 8)])
def test_the_per_block_model_predicts_the_peak_for_any_k_within_3_percent(
        one_thread, examples_dir, example, sizes, micro_batch):
    """Learned on fake tensors at two micro-batches, applied to a real probe without checkpointing,
    at a micro-batch it was not learned at."""
    workload = load_workload(examples_dir / example)
    model = learn_block_model(workload, backend_for("cpu", "4GiB"), precision=Precision.FP32,
                              micro_batches=sizes)
    off = autotune.probe(workload, device="cpu", memory_limit="4GiB", max_micro_batch=micro_batch * 2)
    measured = _measured_peaks(workload, micro_batch, range(model.total_blocks + 1))
    for k, peak in measured.items():
        predicted = model.for_blocks(off.memory_model, k).predict(micro_batch)
        assert abs(predicted - peak) <= 0.03 * peak, (k, predicted, peak)


def test_predicted_blocks_is_the_fewest_the_model_keeps_within_the_limit(one_thread, examples_dir):
    workload = load_workload(examples_dir / "tiny_lm.py")
    model = learn_block_model(workload, backend_for("cpu", "4GiB"), precision=Precision.FP32,
                              micro_batches=(8, 16))
    off = autotune.probe(workload, device="cpu", memory_limit="4GiB", max_micro_batch=17)
    peaks = [model.for_blocks(off.memory_model, k).predict(16) for k in range(5)]
    assert peaks[1] < peaks[0] and peaks[4] < peaks[3]
    limit = int((peaks[2] + peaks[3]) / 2)
    assert predicted_blocks(off, model, 16, limit) == 3
    assert predicted_blocks(off, model, 16, int(peaks[4]) - 1) is None


# --- the planner: the fewest steps, then the fewest blocks, proved by real trials ----------------

def _real_peak(workload, micro_batch, blocks):
    return _measured_peaks(workload, micro_batch, [blocks])[blocks]


def _check_fewest(plan, workload):
    """K fits and K - 1 does not, by fresh real trials (not the planner's own)."""
    usable = plan.budget_bytes * (1 - plan.headroom)
    k = plan.blocks
    assert _real_peak(workload, plan.micro_batch, k) <= usable
    assert _real_peak(workload, plan.micro_batch, k - 1) > usable


@pytest.mark.slow  # plans and trains end to end: 20-45 s, the fast suite's heaviest
def test_auto_plans_the_fewest_blocks_that_reach_one_step_gpt_varlen(one_thread, examples_dir):
    workload = load_workload(examples_dir / "gpt_varlen.py")
    plan = autotune.plan(workload, target_batch=64, device="cpu", memory_limit="8MiB", headroom=0.0,
                         precision="fp32")
    assert plan.micro_batches == [64] and plan.checkpointing and plan.checkpointed_blocks == 1
    assert plan.total_blocks == 2
    off = next(s for s in plan.settings if not s.checkpointing)
    assert off.allowed_micro_batch < 64  # without checkpointing it takes more steps
    _check_fewest(plan, workload)
    why = plan.reasons["checkpointing"]
    assert "checkpointing 1 of 2 blocks reaches micro-batch 64 in one step" in why
    assert "all 2 were not needed" in why and "with 0" in why


@pytest.mark.slow
@pytest.mark.parametrize("limit, blocks", [("50MiB", 3), ("42MiB", 4)])
def test_auto_plans_the_fewest_blocks_that_reach_one_step_tiny_lm(one_thread, examples_dir, limit, blocks):
    workload = load_workload(examples_dir / "tiny_lm.py")
    plan = autotune.plan(workload, target_batch=16, device="cpu", memory_limit=limit, headroom=0.0,
                         precision="fp32")
    assert plan.micro_batches == [16] and plan.blocks == blocks
    _check_fewest(plan, workload)
    needed = "all 4 are needed" if blocks == 4 else "all 4 were not needed"
    assert needed in plan.reasons["checkpointing"]


def test_auto_keeps_checkpointing_off_when_the_share_fits(one_thread, examples_dir):
    plan = autotune.plan(examples_dir / "gpt_varlen.py", target_batch=16, device="cpu",
                         memory_limit="64MiB", precision="fp32")
    assert not plan.checkpointing.enabled and plan.blocks == 0 and len(plan.settings) == 1


@pytest.mark.slow  # plans and trains end to end: 20-45 s, the fast suite's heaviest
def test_a_count_or_fraction_is_planned_as_asked(one_thread, examples_dir):
    path = examples_dir / "tiny_lm.py"
    plan = autotune.plan(path, target_batch=8, device="cpu", memory_limit="1GiB", checkpointing="1/3",
                         precision="fp32")
    assert plan.checkpointed_blocks == 2 and plan.checkpointing_label == "2 of 4 blocks"
    assert plan.settings[0].probe.checkpointed_blocks == 2
    assert plan.reasons["checkpointing"] == "2 of 4 blocks as requested"
    with pytest.raises(ConfigError, match="has 4 repeated blocks"):
        autotune.plan(path, target_batch=8, device="cpu", checkpointing=5)


@pytest.mark.slow
def test_plan_files_carry_k_and_files_with_only_the_bool_still_load(one_thread, examples_dir, tmp_path):
    plan = autotune.plan(examples_dir / "gpt_varlen.py", target_batch=64, device="cpu",
                         memory_limit="8MiB", headroom=0.0, precision="fp32")
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    again = load_plan(path)
    assert (again.checkpointed_blocks, again.total_blocks, again.blocks) == (1, 2, 1)
    assert again.chosen_setting.fewer_blocks_trial is not None
    assert again.chosen_setting.probe.block_model == plan.chosen_setting.probe.block_model
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3 and data["checkpointing"] == {"blocks": 1, "total": 2}
    assert "checkpointed_blocks" not in data and "checkpointed_blocks" not in data["settings"][0]
    # Schema 2 wrote a bool and checkpointed_blocks; files from before counts only the bool.
    data["schema_version"] = 2
    data["checkpointing"] = True
    data["checkpointed_blocks"] = 1
    for setting in data["settings"]:
        setting["checkpointing"] = setting["checkpointing"]["blocks"] != 0
        setting["probe"]["checkpointing"] = setting["checkpointing"]
    path.write_text(json.dumps(data))
    two = load_plan(path)
    assert two.checkpointing == again.checkpointing and two.checkpointing_label == "1 of 2 blocks"
    data.pop("checkpointed_blocks")
    data["workload"].pop("repeated_blocks")
    for setting in data["settings"]:
        setting.pop("fewer_blocks_trial")
        for key in ("total_blocks", "block_model"):
            setting["probe"].pop(key)
    path.write_text(json.dumps(data))
    old = load_plan(path)
    assert old.checkpointing and old.blocks is None and old.checkpointing.setting == "on"


# --- the loop, the CLI --------------------------------------------------------------------------

@pytest.mark.parametrize("blocks, reruns", [(2, 2), (None, 6)])
def test_the_training_loop_checkpoints_the_plans_blocks(blocks, reruns):
    built = []

    def model():
        built.append(_stack())
        return built[-1]

    workload = Workload(model=model, make_batch=lambda n: torch.randn(n, 4),
                        loss_fn=lambda m, x: m(x).pow(2).mean(),
                        build_optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
    plan = dataclasses.replace(make_plan([4, 4]), checkpointing=Checkpointing.of(blocks, 6 if blocks else None))
    train(plan, workload, steps=1, progress=False, measure_noise_scale=False)
    # Two micro-steps: every block runs forward twice, a checkpointed one twice more.
    assert sorted(block.calls for block in built[-1]) == [2] * (6 - reruns) + [4] * reruns


def test_cli_probe_and_estimate_take_a_count(one_thread, examples_dir):
    path = str(examples_dir / "gpt_varlen.py")
    runner = CliRunner()
    probed = runner.invoke(cli, ["probe", path, "--device", "cpu", "--memory-limit", "64MiB",
                                 "--checkpointing", "1", "--max-micro-batch", "4", "--json"])
    assert probed.exit_code == 0, probed.output
    result = json.loads(probed.stdout)  # stderr logs the trials
    assert (result["checkpointing"], result["total_blocks"]) == ({"blocks": 1, "total": 2}, 2)
    estimated = runner.invoke(cli, ["estimate", path, "--micro-batch", "24", "--checkpointing", "1/2",
                                    "--json"])
    assert estimated.exit_code == 0, estimated.output
    assert json.loads(estimated.output)["24"] == autotune.estimate_peak(path, 24, checkpointing=1)
    bad = runner.invoke(cli, ["plan", path, "--target-batch", "8", "--checkpointing", "most"])
    assert bad.exit_code == 2 and "--checkpointing" in bad.output and "1/3" in bad.output


# --- the throughput search searches K ---------------------------------------------------------

def _setting_with_blocks(max_micro_batch, blocks, total=2):
    from plan_helpers import linear_probe, setting
    probe = linear_probe(max_micro_batch, checkpointing=Checkpointing.of(blocks, total), upper=16)
    probe.total_blocks = total
    return setting(probe, checkpointing=probe.checkpointing, headroom=0.0)


class _Speeds:
    """samples/s by checkpointing and micro-batch: the fewest blocks at 16 are the fastest."""

    rates = {"off": (100.0, 1.0), "on": (80.0, 0.5), 1: (90.0, 1.0)}

    def __init__(self):
        self.calls = []

    def __call__(self, config, seconds=None):
        key = (config.checkpointing.setting, config.micro_batch)
        self.calls.append(key)
        from autotune.tuning.measure import Measurement
        base, slope = self.rates[key[0]]
        return Measurement(samples_per_s=base + slope * key[1], peak_bytes=config.micro_batch * MiB)

    def compare(self, configs, seconds):
        return [self(c) for c in configs]


def _block_candidates():
    from autotune.tuning.search import build_candidates
    settings = [_setting_with_blocks(2, 0), _setting_with_blocks(16, 2), _setting_with_blocks(16, 1)]
    return build_candidates(settings, share=16, usable=1000 * MiB)


def test_the_throughput_search_measures_the_fewest_blocks_beside_all_and_none():
    from autotune.tuning.search import search_throughput
    candidates = _block_candidates()
    assert {(c.config.checkpointing.setting, c.config.micro_batch) for c in candidates} >= {
        ("off", 2), ("on", 16), (1, 16)}
    measure = _Speeds()
    result = search_throughput(candidates, measure, measure.compare, budget_s=30,
                               usable_bytes=1000 * MiB, study_name="blocks")
    winner = result.winner
    assert (winner.checkpointing, winner.micro_batch) == (Checkpointing.of(1, 2), 16)
    measured = {(r.checkpointing.setting, r.micro_batch) for r in result.records if r.status == "measured"}
    assert {("on", 16), (1, 16)} <= measured  # every block and the fewest: two configurations


def _four_block_settings():
    """off allows 9; every extra checkpointed block saves 25 MiB a sample; 3 of 4 is the fewest
    that reaches 24 (the share) in one step."""
    from autotune.planning.policy import settings_below_fewest
    from autotune.probing.result import BlockModel
    off = _setting_with_blocks(9, 0, total=4)
    off.probe = _plain_probe(9, 100 * MiB)
    off.allowed_micro_batch = 9
    fewest = _setting_with_blocks(24, 3, total=4)
    fewest.probe = _plain_probe(24, 25 * MiB, blocks=3)
    fewest.probe.block_model = BlockModel(total_blocks=4, saving=(0.0, 25.0 * MiB), last_block=(0.0, 0.0))
    fewest.allowed_micro_batch = 24
    return off, fewest, settings_below_fewest(fewest, [off], usable=1000 * MiB)


def _plain_probe(max_micro_batch, per_sample, blocks=0):
    from plan_helpers import linear_probe
    probe = linear_probe(max_micro_batch, per_sample=per_sample, checkpointing=Checkpointing.of(blocks, 4),
                         upper=24)
    probe.total_blocks = 4
    return probe


def test_the_search_gets_every_k_below_the_fewest_that_reaches_a_larger_micro_batch():
    _, _, below = _four_block_settings()
    # 100 MiB + 75 MiB·n (1 block) and + 50 MiB·n (2 blocks) within 1000 MiB: 12 and 18.
    assert [(s.blocks, s.allowed_micro_batch) for s in below] == [(1, 12), (2, 18)]
    assert all(s.probe.trials == [] and s.probe.checkpointing == s.checkpointing
               for s in below)


def test_the_throughput_search_can_choose_a_k_between_none_and_the_fewest():
    from autotune.tuning.search import build_candidates, search_throughput
    off, fewest, below = _four_block_settings()
    candidates = build_candidates([off, fewest, *below], share=24, usable=1000 * MiB)
    fitting = {(c.config.checkpointing.count, c.config.micro_batch) for c in candidates
               if c.predicted_fits and c.config.checkpointing}
    # 1 block reaches 12 x 2, which off (9: 8 x 3) does not; 2 blocks reach no other split, and
    # the fewest's smaller splits are left to the settings with fewer blocks that fit them.
    assert fitting == {(1, 12), (3, 24)}

    class Speeds(_Speeds):
        rates = {"off": (100.0, 1.0), 1: (130.0, 0.0), 3: (90.0, 0.0)}

    measure = Speeds()
    result = search_throughput(candidates, measure, measure.compare, budget_s=30,
                               usable_bytes=1000 * MiB, study_name="k-between")
    assert (result.winner.checkpointing.count, result.winner.micro_batch) == (1, 12)
    assert {(1, 12), (3, 24), ("off", 8)} <= set(measure.calls)


def test_results_stored_before_the_checkpointing_value_keep_their_keys():
    # Studies stored by older versions hold a bool and checkpointed_blocks (None: every block).
    from types import SimpleNamespace

    from autotune.tuning.search import _trial_key

    def trial(checkpointing, **blocks):
        return SimpleNamespace(params={"precision": "fp32", "checkpointing": bool(checkpointing)},
                               user_attrs={"checkpointing": checkpointing, "micro_batches": [16, 8], **blocks})

    assert _trial_key(trial(True, checkpointed_blocks=1), 2) == ("fp32", Checkpointing.of(1, 2), 16)
    assert _trial_key(trial(True, checkpointed_blocks=None), 2) == ("fp32", Checkpointing.every_block(), 16)
    assert _trial_key(trial(False), 0) == ("fp32", Checkpointing.off(), 16)
    assert _trial_key(trial({"blocks": 1, "total": 2}), 2) == ("fp32", Checkpointing.of(1, 2), 16)


@pytest.mark.slow
def test_a_stored_study_reuses_results_with_their_blocks(tmp_path):
    from autotune.tuning.search import search_throughput
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first, again = _Speeds(), _Speeds()
    search_throughput(_block_candidates(), first, first.compare, budget_s=30, usable_bytes=1000 * MiB,
                      study_name="blocks", storage=storage)
    rerun = search_throughput(_block_candidates(), again, again.compare, budget_s=30,
                              usable_bytes=1000 * MiB, study_name="blocks", storage=storage)
    assert first.calls and not set(again.calls) & set(first.calls)
    assert rerun.winner.checkpointing.count == 1 and rerun.winner.reused


@pytest.mark.slow
def test_plan_optimize_throughput_carries_k(one_thread, examples_dir):
    plan = autotune.plan(examples_dir / "gpt_varlen.py", target_batch=64, device="cpu",
                         memory_limit="8MiB", headroom=0.0, precision="fp32", optimize="throughput",
                         budget="20s")
    assert any(s.blocks == 1 for s in plan.settings)
    assert any(r.checkpointing.count == 1 and r.status == "measured" for r in plan.throughput)
    chosen = plan.chosen_setting
    assert chosen is not None and plan.blocks == chosen.blocks


@pytest.mark.slow
def test_plan_optimize_throughput_measures_a_k_below_the_fewest(one_thread, examples_dir):
    # tiny_lm at 50 MiB for 16: off fits 6 x 3, 3 of 4 blocks 16 x 1; 1 of 4 reaches 8 x 2.
    plan = autotune.plan(examples_dir / "tiny_lm.py", target_batch=16, device="cpu",
                         memory_limit="50MiB", headroom=0.0, precision="fp32", optimize="throughput",
                         budget="60s")
    off = next(s for s in plan.settings if not s.checkpointing)
    below = [s for s in plan.settings if s.blocks == 1]
    assert below and below[0].allowed_micro_batch >= 8 > off.allowed_micro_batch
    record = next(r for r in plan.throughput if r.checkpointing.count == 1 and r.micro_batch == 8)
    assert record.status == "measured" and record.peak_bytes <= plan.budget_bytes


@pytest.mark.slow
def test_auto_chooses_k_for_a_gpu_profile_on_fake_tensors(one_thread, examples_dir, tmp_path):
    # A --gpu plan's peaks are what torch's caching allocator would reserve (modelled): at
    # micro-batch 64, gpt_varlen reserves 32 MiB without checkpointing and 28 MiB with 1 of its 2
    # blocks checkpointed, so a 30 MiB budget (31 MiB less a 1 MiB context) needs exactly one.
    workload = load_workload(examples_dir / "gpt_varlen.py")
    (_, off), = autotune.estimate_cuda_peaks(workload, [64], checkpointing="off").values()
    (_, one), = autotune.estimate_cuda_peaks(workload, [64], checkpointing=1).values()
    budget = (off + one) // 2
    assert one < budget < off
    profile = tmp_path / "tiny.toml"
    profile.write_text(f'name = "tiny"\nmemory_bytes = {budget + 2**20}\nbf16 = false\nfp16 = true\n'
                       'peak_tflops_fp32 = 1\npeak_tflops_fp16 = 1\npeak_tflops_bf16 = 0\n'
                       'memory_bandwidth_gb_per_s = 100\ncuda_context_bytes = 1_048_576\n'
                       'allocator_reserve_bytes = 1_048_576\nsource = "test"\n')
    plan = autotune.plan(examples_dir / "gpt_varlen.py", target_batch=64, gpu=str(profile),
                         precision="fp32", headroom=0.0, eval_batch=False)
    assert plan.estimated and plan.budget_bytes == budget
    assert plan.micro_batches == [64] and plan.checkpointed_blocks == 1


# --- the pure choice: the fewest steps first, then the fewest blocks -----------------------------

def _pure_plan(*settings):
    from autotune.planning.policy import PlanRequest, build_plan
    from plan_helpers import device, fingerprint
    request = PlanRequest(target_batch=64, checkpointing="auto", headroom=0.0)
    return build_plan(request, workload=fingerprint(repeated_blocks=4), settings=list(settings),
                      device=device())


def _blocks_setting(allowed, blocks):
    tried = _setting_with_blocks(allowed, blocks, total=4)
    tried.probe.upper_bound = 64
    return tried


def test_the_fewest_steps_come_before_the_fewest_blocks():
    plan = _pure_plan(_blocks_setting(10, 0), _blocks_setting(16, 4), _blocks_setting(16, 3),
                      _blocks_setting(16, 2))
    assert (plan.blocks, plan.micro_batches) == (2, [16] * 4)
    fewer_steps = _pure_plan(_blocks_setting(10, 0), _blocks_setting(16, 4), _blocks_setting(8, 1))
    assert (fewer_steps.blocks, fewer_steps.accumulation_steps) == (4, 4)
    assert fewer_steps.checkpointing_label == "on"


def test_under_torchrun_auto_says_fewer_blocks_were_not_searched_and_how_to_get_them():
    from autotune.planning.policy import PlanRequest, build_plan
    from plan_helpers import device, fingerprint
    settings = [_blocks_setting(10, 0), _blocks_setting(16, 4)]
    for distributed, said in ((True, True), (False, False)):
        request = PlanRequest(target_batch=64, checkpointing="auto", headroom=0.0, distributed=distributed)
        plan = build_plan(request, workload=fingerprint(repeated_blocks=4), settings=settings,
                          device=device())
        reason = plan.reasons["checkpointing"]
        assert plan.checkpointing_label == "on" and reason.startswith("auto: on")
        assert ("not searched under torchrun" in reason and "--checkpointing K (K of 4)" in reason) == said
