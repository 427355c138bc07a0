"""The pure planner: split policy, memory margin, precision and checkpointing decisions, warnings."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.errors import ConfigError, PlanError, cli_words
from autotune.planning.policy import (PlanRequest, allowed_micro_batch, build_plan,
                              checkpointing_worth_probing, choose_precision, cpu_precision,
                              per_device_share, predicted_peak, split_evenly, split_pinned, split_share)
from plan_helpers import MiB, device, fingerprint, linear_probe, make_plan, setting


# --- split -----------------------------------------------------------------------------------------

def test_divisible_target_fits_in_one_step():
    assert split_share(128, 128) == [128]
    assert split_share(128, 200) == [128]


def test_divisible_target_splits_evenly():
    assert split_share(128, 64) == [64, 64]
    assert split_share(128, 40) == [32, 32, 32, 32]


def test_prime_target_splits_unevenly_but_exactly():
    assert split_share(127, 50) == [43, 42, 42]
    assert split_share(127, 127) == [127]
    assert split_share(13, 1) == [1] * 13


def test_fewest_steps_even_when_uneven():
    # 128 with at most 50: three steps (43 + 43 + 42) beat four even steps of 32.
    assert split_share(128, 50) == [43, 43, 42]


def test_world_size_share():
    assert per_device_share(128, 4) == 32
    assert per_device_share(7, 7) == 1


def test_indivisible_world_size_suggests_nearest_targets():
    with pytest.raises(PlanError) as info:
        per_device_share(130, 4)
    message = str(info.value)
    assert "target_batch=130 is not divisible by world_size=4" in message  # plan() from Python
    assert "use 128 or 132" in message
    with cli_words(), pytest.raises(PlanError, match="--target-batch 130 is not divisible by --world-size 4"):
        per_device_share(130, 4)


def test_indivisible_small_target_suggests_only_positive():
    with pytest.raises(PlanError) as info:
        per_device_share(3, 4)
    assert "use 4" in str(info.value)
    assert "use 0" not in str(info.value)


def test_pinned_split_keeps_the_micro_batch():
    assert split_pinned(128, 32) == [32, 32, 32, 32]
    assert split_pinned(127, 50) == [50, 50, 27]


def test_pinned_micro_batch_larger_than_share_is_an_error():
    with pytest.raises(PlanError) as info:
        PlanRequest(target_batch=64, world_size=2, micro_batch=40)
    assert "micro_batch=40 is larger than the per-device share 32" in str(info.value)


@pytest.mark.parametrize("field,value,option", [("target_batch", 0, "--target-batch"),
                                                ("world_size", -1, "--world-size"),
                                                ("headroom", 1.5, "--headroom")])
def test_request_rejects_bad_values_naming_the_option(field, value, option):
    values = {"target_batch": 8, field: value}
    with pytest.raises(ConfigError) as info:
        PlanRequest(**values)
    assert field in str(info.value) and option not in str(info.value)  # the keyword, from Python
    with cli_words(), pytest.raises(ConfigError) as info:
        PlanRequest(**values)
    assert option in str(info.value)  # the flag, from the CLI


@settings(max_examples=300, deadline=None)
@given(target=st.integers(1, 5000), world=st.integers(1, 16), maximum=st.integers(1, 600))
def test_split_property(target, world, maximum):
    target = target * world  # a target the world size divides
    sizes = split_share(per_device_share(target, world), maximum)
    assert sum(sizes) * world == target
    assert max(sizes) <= maximum
    assert max(sizes) - min(sizes) <= 1
    # the fewest steps: one step fewer could not hold the share
    assert (len(sizes) - 1) * maximum < target // world


@settings(max_examples=100, deadline=None)
@given(target=st.integers(1, 600), world=st.integers(1, 8), maximum=st.integers(1, 90))
def test_plan_property(target, world, maximum):
    target = target * world
    plan = make_plan(target, maximum, world_size=world, workload=fingerprint(param_bytes=0))
    assert plan.effective_batch == target
    assert sum(plan.micro_batches) * world == target
    assert plan.micro_batch <= maximum


# --- memory margin ---------------------------------------------------------------------------------

def test_headroom_lowers_the_planned_micro_batch():
    probe = linear_probe(90)  # peak = 100 MiB + 10 MiB·n, budget 1000 MiB: 90 fits exactly
    assert allowed_micro_batch(probe, 1000 * MiB) == 90
    assert allowed_micro_batch(probe, 900 * MiB) == 80
    assert setting(probe, headroom=0.1).allowed_micro_batch == 80


def test_measured_peak_overrides_the_model():
    probe = linear_probe(90)
    probe.trials[1].peak_bytes = 950 * MiB  # the real step at 90 used more than predicted
    assert predicted_peak(probe, 90) == 950 * MiB
    assert predicted_peak(probe, 91) >= 950 * MiB  # never below a measured smaller step
    assert allowed_micro_batch(probe, 940 * MiB) < 90


def test_ddp_buckets_count_against_the_budget():
    probe = linear_probe(90)
    assert allowed_micro_batch(probe, 900 * MiB, extra_bytes=50 * MiB) == 75


def test_plan_records_budget_headroom_and_raw_max():
    req = PlanRequest(target_batch=256, checkpointing="off", headroom=0.1)
    plan = build_plan(req, workload=fingerprint(), settings=[setting(linear_probe(90), headroom=0.1)],
                      device=device())
    assert plan.raw_max_micro_batch == 90
    assert plan.micro_batches == [64] * 4  # at most 80 within the margin: 256 = 4 × 64
    assert plan.headroom_bytes == 100 * MiB
    assert "80" in plan.reasons["memory"] and "90" in plan.reasons["memory"]
    assert plan.predicted_peak_bytes == 100 * MiB + 64 * 10 * MiB


def test_world_size_from_one_process_adds_buckets_and_warns():
    plan = make_plan(128, 50, world_size=2, workload=fingerprint(param_bytes=5 * MiB))
    assert plan.micro_batches == [32, 32]
    assert plan.ddp_bucket_bytes == 5 * MiB
    assert any("planned from one process" in w for w in plan.warnings)


def test_pinned_micro_batch_that_does_not_fit_is_an_error():
    req = PlanRequest(target_batch=128, checkpointing="off", micro_batch=64, headroom=0.1)
    tried = setting(linear_probe(64, upper=64), headroom=0.1)
    tried.allowed_micro_batch = 60  # 64 fits the budget, but only 60 fit within the headroom
    with pytest.raises(PlanError) as info:
        build_plan(req, workload=fingerprint(), settings=[tried], device=device())
    assert "--micro-batch 64" in str(info.value)
    assert "at most 60 fits" in str(info.value)


def test_pinned_micro_batch_that_fits_is_kept():
    plan = make_plan(100, 30, micro_batch=30)
    assert plan.micro_batches == [30, 30, 30, 10]
    assert "pinned" in plan.reasons["split"]


def test_nothing_within_headroom_is_an_error_naming_headroom():
    req = PlanRequest(target_batch=8, checkpointing="off", headroom=0.5)
    tried = setting(linear_probe(80), headroom=0.5)
    tried.allowed_micro_batch = 0
    with pytest.raises(PlanError) as info:
        build_plan(req, workload=fingerprint(), settings=[tried], device=device())
    assert "--headroom 0.5" in str(info.value)


# --- even splits ---------------------------------------------------------------------------------

def test_split_evenly_is_the_fewest_equal_micro_batches():
    assert split_evenly(64, 13) == [8] * 8
    assert split_evenly(60, 13) == [12] * 5
    assert split_evenly(7, 3) == [1] * 7


def test_even_plan_is_the_best_even_split_and_says_what_it_costs():
    uneven = make_plan(64, 13)
    assert uneven.micro_batches == [13, 13, 13, 13, 12]
    plan = make_plan(64, 13, even=True)
    assert plan.micro_batches == [8] * 8 and plan.is_even
    assert "--even" in plan.reasons["split"] and "uneven ones would be 5" in plan.reasons["split"]


def test_even_plan_takes_checkpointing_where_it_buys_an_even_split():
    off = setting(linear_probe(13), headroom=0.0)
    on = setting(linear_probe(16, checkpointing=True), checkpointing=True, headroom=0.0)
    request = PlanRequest(target_batch=64, checkpointing="auto", headroom=0.0, even=True)
    assert checkpointing_worth_probing(off, request, fingerprint())
    plan = build_plan(request, workload=fingerprint(), settings=[off, on], device=device())
    assert plan.micro_batches == [16] * 4 and plan.checkpointing
    assert "from 8 to 4" in plan.reasons["checkpointing"]


# --- precision -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,bf16,expected", [("cuda", True, "bf16"), ("cuda", False, "fp16"),
                                                 ("cpu", True, "fp32"), ("cpu", False, "fp32")])
def test_auto_precision(kind, bf16, expected):
    chosen, reason = choose_precision("auto", device_kind=kind, bf16_supported=bf16)
    assert chosen == expected
    assert reason.startswith("auto")


@pytest.mark.parametrize("fp32,bf16,expected", [(1, None, "fp32"), (4, 4, "fp32"), (4, None, "fp32"),
                                                 (4, 2, "bf16"), (None, 3, "bf16")])
def test_cpu_auto_precision_is_fp32_unless_bf16_buys_accumulation_steps(fp32, bf16, expected):
    chosen, reason = cpu_precision(fp32, bf16)
    assert chosen == expected
    assert reason.startswith("auto") and "slower" in reason


def test_explicit_precision_is_kept():
    assert choose_precision("fp32", device_kind="cuda", bf16_supported=True)[0] == "fp32"


# --- checkpointing ---------------------------------------------------------------------------------

def _auto(target, off, on, *, workload=None, micro_batch=None):
    req = PlanRequest(target_batch=target, checkpointing="auto", headroom=0.0, micro_batch=micro_batch)
    tried = [off] + ([on] if on is not None else [])
    return build_plan(req, workload=workload or fingerprint(), settings=tried, device=device())


def test_checkpointing_not_probed_when_the_share_fits():
    off = setting(linear_probe(64, upper=64), headroom=0.0)
    req = PlanRequest(target_batch=64, checkpointing="auto")
    assert not checkpointing_worth_probing(off, req, fingerprint())
    plan = _auto(64, off, None)
    assert not plan.checkpointing.enabled
    assert "buy nothing" in plan.reasons["checkpointing"]


def test_checkpointing_not_probed_without_repeated_blocks():
    off = setting(linear_probe(10), headroom=0.0)
    req = PlanRequest(target_batch=64, checkpointing="auto")
    assert not checkpointing_worth_probing(off, req, fingerprint(checkpointable=False))
    assert checkpointing_worth_probing(off, req, fingerprint())


def test_checkpointing_on_when_nothing_fits_without_it():
    off = setting(None, error="does not fit at micro-batch 1")
    on = setting(linear_probe(8, checkpointing=True), checkpointing=True, headroom=0.0)
    plan = _auto(16, off, on)
    assert plan.checkpointing.enabled
    assert plan.micro_batches == [8, 8]
    assert "does not fit" in plan.reasons["checkpointing"]


def test_checkpointing_on_when_it_removes_steps():
    off = setting(linear_probe(32), headroom=0.0)
    on = setting(linear_probe(64, checkpointing=True, upper=64), checkpointing=True, headroom=0.0)
    plan = _auto(64, off, on)
    assert plan.checkpointing.enabled
    assert plan.micro_batches == [64]
    assert "from 2 to 1" in plan.reasons["checkpointing"]


def test_checkpointing_off_when_it_saves_no_step():
    off = setting(linear_probe(40), headroom=0.0)
    on = setting(linear_probe(50, checkpointing=True), checkpointing=True, headroom=0.0)
    plan = _auto(120, off, on)  # 3 steps either way
    assert not plan.checkpointing.enabled
    assert plan.micro_batches == [40, 40, 40]
    assert "either way" in plan.reasons["checkpointing"]


def test_checkpointing_lifts_batchnorm_micro_batch():
    off = setting(linear_probe(10), headroom=0.0)
    on = setting(linear_probe(32, checkpointing=True, upper=32), checkpointing=True, headroom=0.0)
    plan = _auto(32, off, on, workload=fingerprint(batchnorm=True))
    assert plan.checkpointing.enabled
    assert "BatchNorm micro-batch from 8 to 32" in plan.reasons["checkpointing"]
    assert not any("BatchNorm" in w for w in plan.warnings)


def test_checkpointing_on_for_a_pinned_micro_batch_only_it_fits():
    off = setting(linear_probe(20), headroom=0.0)
    on = setting(linear_probe(32, checkpointing=True, upper=32), checkpointing=True, headroom=0.0)
    plan = _auto(64, off, on, micro_batch=32)
    assert plan.checkpointing.enabled
    assert plan.micro_batches == [32, 32]


# --- warnings --------------------------------------------------------------------------------------

def test_batchnorm_small_micro_batch_warns():
    plan = make_plan(64, 8, workload=fingerprint(batchnorm=True))
    assert any("SyncBatchNorm" in w and "GroupNorm" in w for w in plan.warnings)


def test_batchnorm_large_micro_batch_does_not_warn():
    plan = make_plan(64, 32, workload=fingerprint(batchnorm=True))
    assert not any("BatchNorm" in w for w in plan.warnings)


def test_many_accumulation_steps_warn():
    plan = make_plan(330, 10)
    assert plan.accumulation_steps == 33
    assert any("33 accumulation steps" in w for w in plan.warnings)
    assert not any("accumulation steps (>" in w for w in make_plan(320, 10).warnings)


def test_linear_rule_beyond_8k_warns():
    sgd = fingerprint(optimizer="SGD")
    big = make_plan(16384, 90, workload=sgd, base_lr=0.1, base_batch=256)
    assert big.lr.rule == "linear"
    assert any("LARS" in w and "LAMB" in w for w in big.warnings)
    small = make_plan(4096, 90, workload=sgd, base_lr=0.1, base_batch=256)
    assert not any("LARS" in w for w in small.warnings)


def test_single_process_plan_has_no_world_warning():
    assert not any("one process" in w for w in make_plan(128, 50).warnings)
