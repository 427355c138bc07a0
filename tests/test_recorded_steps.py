"""``--optimize throughput --gpu`` counts the steps its probes already ran (autotune.timing.recorded):
the record is the step counted again, op by op, and recording changes no byte the probe counts."""

import dataclasses

import pytest
import torch

import autotune
from autotune.gpus.target import profile_target
from autotune.orchestration import predicted
from autotune.probing.api import probe
from autotune.timing.count import count_steps_costs
from autotune.timing.recorded import recording_session

from conftest import ROOT
from autotune.distributed.context_parallel import cpu_ring_available
from autotune.distributed.pipeline import fake_pipeline_supported

NEEDS_CPU_RING = pytest.mark.skipif(not cpu_ring_available(), reason=(
    "context parallelism on CPU tensors needs torch 2.14's sharding-rule hooks"))

TINY_LM = str(ROOT / "examples" / "tiny_lm.py")
MLP = str(ROOT / "examples" / "mlp.py")
GPU = "h100-80gb"


def _trials(result):
    # Every number a trial states but the seconds it took.
    return [{k: v for k, v in dataclasses.asdict(t).items() if k != "seconds"} for t in result.trials]


@pytest.mark.parametrize("layout", [
    dict(sharding="ddp", checkpointing="on"),
    pytest.param(dict(sharding="fsdp", checkpointing="off", world_size=2, explain=False),
                 marks=pytest.mark.slow),  # about 11 s
])
def test_a_probe_records_its_one_step_trials_as_the_step_counted_again(layout):
    kwargs = dict(precision="bf16", max_micro_batch=4, share=4, **layout)
    store = {}
    recorded = probe(TINY_LM, backend=profile_target(GPU, world_size=layout.get("world_size", 1)).backend,
                     session_type=recording_session(store), **kwargs)
    plain = probe(TINY_LM, backend=profile_target(GPU, world_size=layout.get("world_size", 1)).backend,
                  **kwargs)
    assert _trials(recorded) == _trials(plain)  # to the byte: tensors and modelled reserved memory
    assert 4 in store  # the one-step trial at the share (the trials below it are windows)
    assert set(store) == {t.micro_batch for t in recorded.trials if t.fits and not t.micro_steps}
    again = count_steps_costs(TINY_LM, sorted(store), precision="bf16", checkpointing=layout["checkpointing"],
                              sharding=layout["sharding"], world_size=layout.get("world_size", 1),
                              for_gpu=profile_target(GPU).profile.name)
    assert store == again  # every op (class, phase, FLOPs, bytes, kernel), collective and call
    if layout["checkpointing"] == "on":
        assert again[4].count_by("phase")["recompute"] > 0
    else:
        assert {c.kind for c in again[4].collectives} >= {"all_gather", "reduce_scatter"}


def test_a_trial_whose_optimizer_step_ran_on_part_of_the_parameters_is_not_kept(tmp_path):
    # An optimizer that loops per parameter (foreach=False): the estimate steps only the distinct
    # neighbour pairs of parameters, so its ops are not the whole step's.
    model = tmp_path / "per_param.py"
    model.write_text((ROOT / "examples" / "mlp.py").read_text().replace(
        "torch.optim.AdamW(params, lr", "torch.optim.AdamW(params, foreach=False, lr"))
    assert "foreach=False" in model.read_text()
    store = {}
    result = probe(str(model), backend=profile_target(GPU).backend, precision="bf16", max_micro_batch=4,
                   share=4, session_type=recording_session(store))
    assert result.max_micro_batch == 4 and store == {}


def test_a_ranked_plan_runs_no_second_fake_step_where_its_probe_ran_the_step(monkeypatch):
    def counted_again(*args, **kwargs):
        raise AssertionError("the probe's step was counted again")

    memory = autotune.plan(TINY_LM, target_batch=32, world_size=8, gpu=GPU)
    monkeypatch.setattr(predicted, "count_steps_costs", counted_again)
    ranked = autotune.plan(TINY_LM, target_batch=32, world_size=8, gpu=GPU, optimize="throughput")
    assert ranked.micro_batches == [4] and ranked.step_time.step_s > 0
    # The same settings probed, every trial's bytes the same: ranking changes no memory number.
    assert [_trials(s.probe) for s in ranked.settings] == [_trials(s.probe) for s in memory.settings]
    assert ranked.predicted_peak_bytes == memory.predicted_peak_bytes


LLAMA12 = str(ROOT / "tests" / "twelve_block_llama.py")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sharding, world, layout", [
    ("fsdp", 2, {}),
    # 9-15 s each: the README's test run stays under 10 minutes; CI's slow pass runs them.
    pytest.param("fsdp", 4, dict(tp=2), marks=pytest.mark.slow),
    pytest.param("fsdp-offload", 2, {}, marks=pytest.mark.slow),
    pytest.param("fsdp", 4, dict(cp=2), marks=[pytest.mark.slow, NEEDS_CPU_RING]),
])
def test_a_step_counted_without_a_warm_up_step_counts_what_one_after_it_counts(
        monkeypatch, sharding, world, layout):
    # The first step's one-time work (FSDP2's lazy set-up and first all-gather outputs, DTensor's
    # first sharding propagation) is passed uncounted: no warm-up step is needed before counting.
    from autotune.distributed.layout import parse_layout
    from autotune.timing import count

    def counted(warm: bool):
        monkeypatch.setattr(count._RecordsSteps, "warm_up_step", warm)
        return count_steps_costs(LLAMA12, [2], precision="bf16", checkpointing="on", sharding=sharding,
                                 world_size=world, for_gpu=profile_target(GPU).profile.name,
                                 parallel=parse_layout(**layout))

    cold, warm = counted(False), counted(True)
    assert cold == warm
    assert cold[2].sharded_units > 0 and {c.kind for c in cold[2].collectives} >= {"all_gather"}
    if layout:
        assert cold[2].dtensor_ops.get("forward", 0) > 0  # tensor/context parallel DTensor ops


def test_without_shadowing_the_first_steps_one_time_work_the_cold_count_differs(monkeypatch, one_thread):
    # What the test above holds equal is not equal by chance: FSDP2's first all-gather makes its
    # unsharded parameters once, as views the steady state does not make again.
    import contextlib

    from autotune.timing import count

    monkeypatch.setattr(count._RecordsSteps, "warm_up_step", False)
    shadowed = count_steps_costs(LLAMA12, [2], precision="bf16", sharding="fsdp", world_size=2)
    monkeypatch.setattr(count, "_shadow_one_time_ops", lambda recorder: contextlib.nullcontext())
    unshadowed = count_steps_costs(LLAMA12, [2], precision="bf16", sharding="fsdp", world_size=2)
    assert unshadowed[2].op_count > shadowed[2].op_count


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sharding, world, layout, checkpointing", [
    ("fsdp", 2, {}, "on"),
    pytest.param("fsdp", 2, {}, "off", marks=pytest.mark.slow),  # 16 s
    # Context parallel (and on this tiny model, neither ddp nor tensor parallel synthesizes its
    # allocator trace: those run the full build; tests/test_extend_costs.py extends their counts).
    pytest.param("fsdp", 4, dict(cp=2), "on", marks=[pytest.mark.slow, NEEDS_CPU_RING]),
])
def test_a_synthesized_probe_records_the_whole_models_step_from_its_small_builds(
        monkeypatch, sharding, world, layout, checkpointing):
    # A CUDA estimate of a model of identical blocks runs each trial on three small builds
    # (affine_blocks.SynthesizedTrialsSession); recording, each build's step is recorded and the
    # three extended to the whole model's (timing.extend): the full build's step counted, op by op.
    from autotune.distributed.layout import parse_layout
    from autotune.probing.affine_blocks import synthesized_traces
    from autotune.timing import recorded
    from autotune.timing.extend import normal_form

    extended = []
    original = recorded.extend_step_costs

    def spy(steps, **kwargs):
        extended.append([sum(op.count for op in s.ops) for s in steps])
        return original(steps, **kwargs)

    monkeypatch.setattr(recorded, "extend_step_costs", spy)
    kwargs = dict(precision="bf16", max_micro_batch=4, share=4, sharding=sharding, world_size=world,
                  checkpointing=checkpointing, parallel=parse_layout(**layout), explain=False)
    store = {}
    with synthesized_traces(True, max_share=None):  # twelve blocks: small builds of 4, 5 and 6
        ranked = probe(LLAMA12, backend=profile_target(GPU, world_size=world).backend,
                       session_type=recording_session(store), **kwargs)
        plain = probe(LLAMA12, backend=profile_target(GPU, world_size=world).backend, **kwargs)
    assert _trials(ranked) == _trials(plain)
    assert set(store) == {4} and len(extended) == 1, extended
    low, high, third = extended[0]
    assert low < high < third  # three builds of growing size, each counted
    again = count_steps_costs(LLAMA12, [4], precision="bf16", checkpointing=checkpointing,
                              sharding=sharding, world_size=world, for_gpu=profile_target(GPU).profile.name,
                              parallel=parse_layout(**layout))
    assert normal_form(store[4]) == normal_form(again[4])
    assert store[4].op_count > third


@pytest.mark.slow  # 12-17 s: the README's test run stays under 10 minutes
def test_a_ranked_plan_counts_the_full_build_where_its_small_builds_do_not_extend(monkeypatch, one_thread):
    from autotune.probing.affine_blocks import synthesized_traces
    from autotune.timing import recorded

    counted = []
    original = predicted.count_steps_costs

    def count(*args, **kwargs):
        counted.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(predicted, "count_steps_costs", count)
    with synthesized_traces(True, max_share=None):
        extended = autotune.plan(LLAMA12, target_batch=16, world_size=4, gpu=GPU, micro_batch=4,
                                 sharding="fsdp", optimize="throughput")
        assert counted == []
        monkeypatch.setattr(recorded, "extend_step_costs", lambda steps, **kwargs: None)
        full = autotune.plan(LLAMA12, target_batch=16, world_size=4, gpu=GPU, micro_batch=4,
                             sharding="fsdp", optimize="throughput")
    assert counted == [[4]]
    assert full.step_time.step_s == pytest.approx(extended.step_time.step_s, rel=1e-12)
    assert full.predicted_peak_bytes == extended.predicted_peak_bytes


NEEDS_FAKE_PIPELINE = pytest.mark.skipif(not fake_pipeline_supported(), reason=(
    f"torch {torch.__version__}'s pipeline schedules do not run on fake tensors"))


# Slow (7-10 s each, and pipeline estimates run best in a process of their own: .ci/run's note).
@pytest.mark.slow
@NEEDS_FAKE_PIPELINE
@pytest.mark.usefixtures("one_thread")
def test_a_pipeline_probe_records_each_ranks_steady_window_as_the_window_counted_again():
    # A pipeline's trial is a window of share / n micro-batches on every pipeline rank, its
    # schedule's first window (which builds the schedule's buffers) unrecorded: the step the
    # ranking reads is the slowest rank's per micro-step, as counting that window again gives it.
    from autotune.distributed.layout import parse_layout
    from autotune.timing.count import pipeline_rank_costs, slowest_stage

    layout = parse_layout(pp=2)
    kwargs = dict(precision="bf16", checkpointing="off", sharding="fsdp", world_size=4, parallel=layout)
    store = {}
    recorded = probe(TINY_LM, backend=profile_target(GPU, world_size=4).backend, max_micro_batch=2,
                     share=4, session_type=recording_session(store), explain=False, **kwargs)
    plain = probe(TINY_LM, backend=profile_target(GPU, world_size=4).backend, max_micro_batch=2,
                  share=4, explain=False, **kwargs)
    assert _trials(recorded) == _trials(plain)  # to the byte: recording changes no memory number
    assert set(store) == {t.micro_batch for t in recorded.trials if t.fits} == {2}
    ranks = pipeline_rank_costs(TINY_LM, [2], window=2, for_gpu=profile_target(GPU).profile.name, **kwargs)
    assert store[2] == slowest_stage([r[2] for r in ranks])
    assert ranks[0][2] != ranks[1][2]  # the stages differ: the slowest is chosen, not either


@pytest.mark.slow
@NEEDS_FAKE_PIPELINE
def test_a_ranked_pipeline_plan_runs_no_second_fake_step_where_its_probe_ran_the_window(monkeypatch):
    def counted_again(*args, **kwargs):
        raise AssertionError("the probe's window was counted again")

    monkeypatch.setattr(predicted, "count_steps_costs", counted_again)
    ranked = autotune.plan(TINY_LM, target_batch=16, world_size=4, gpu=GPU, optimize="throughput",
                           sharding="fsdp", pp=2)
    assert ranked.parallel.pp == 2 and ranked.step_time.step_s > 0 and ranked.step_time.bubble_s > 0


@pytest.mark.parametrize("window, share", [(2, 8), (1, 4)])
def test_a_plain_trials_answer_serves_a_recording_probe_only_where_it_records_nothing(window, share):
    # A layout screen runs the estimate's own trial; the ranked planner's probe (a recording
    # session) asks the same trial next. A window is never recorded: the screen's answer serves
    # (8B's cp 2 ran its window at micro-batch 1 twice, 2.9 CPU s each). A one-step trial is
    # recorded: it runs again, into the probe's store.
    from autotune.probing.api import window_trial

    backend = profile_target(GPU, world_size=2).backend
    backend.trials_memo = {}
    layout = dict(precision="bf16", checkpointing="off", sharding="fsdp", world_size=2,
                  reduce_every_micro_step=True)
    screened = window_trial(TINY_LM, backend, micro_batch=4, window=window, **layout)
    assert screened.fits
    remembered = len(backend.trials_memo)
    store = {}
    result = probe(TINY_LM, backend=backend, session_type=recording_session(store), max_micro_batch=4,
                   share=share, **layout)
    assert result.max_micro_batch == 4 and [t.micro_batch for t in result.trials] == [4]
    assert _trials(result)[0] == {k: v for k, v in dataclasses.asdict(screened).items() if k != "seconds"}
    if window > 1:
        assert len(backend.trials_memo) == remembered and store == {}
    else:
        assert len(backend.trials_memo) > remembered and set(store) == {4}
