"""A step's costs extended from small builds to the whole model (autotune/timing/extend.py): the
rules on hand-made costs, and counts of real layouts extended against the whole model's count."""

import dataclasses

import pytest

from autotune.distributed.layout import parse_layout
from autotune.probing.affine_blocks import small_builds, synthesized_traces
from autotune.timing.costs import CollectiveCall, OpCost, StepCosts
from autotune.timing.count import count_steps_costs
from autotune.timing import extend
from autotune.timing.extend import extend_checked_step_costs, extend_step_costs, normal_form
from autotune.workload.contract import load_workload

from conftest import ROOT
from autotune.distributed.context_parallel import cpu_ring_available

NEEDS_CPU_RING = pytest.mark.skipif(not cpu_ring_available(), reason=(
    "context parallelism on CPU tensors needs torch 2.14's sharding-rule hooks"))

LLAMA12 = str(ROOT / "tests" / "twelve_block_llama.py")
H100 = "NVIDIA H100 SXM5 80GB"


def _step(units: int, *, foreach_bytes=None, norm_bytes=None) -> StepCosts:
    """A hand-made step of ``units`` blocks: per block two matmuls and an add, a root's embedding,
    an optimizer foreach op over every parameter; FSDP2's all-gathers and reduce-scatters."""
    per_param = 1000
    foreach = foreach_bytes if foreach_bytes is not None else 400 + per_param * units
    ops = (OpCost("matmul", "forward", 2e6 * 2 * units, 3e4 * 2 * units, 2 * units, "mm", 1e4 * 2 * units),
           OpCost("elementwise", "forward", 0.0, 512.0 * units, units),
           OpCost("elementwise", "forward", 0.0, 4096.0, 1, "embedding"),
           OpCost("optimizer", "optimizer", 0.0, 2.0 * foreach, 2),
           OpCost("other", "backward", 0.0, 0.0, 3 + 5 * units))
    gather, scatter = CollectiveCall("all_gather", 800, 4, "forward"), CollectiveCall("reduce_scatter", 1600, 4, "backward")
    back_gather = CollectiveCall("all_gather", 800, 4, "backward")
    norm = CollectiveCall("all_reduce", norm_bytes if norm_bytes is not None else 4 * (2 + units), 4, "optimizer")
    calls = (CollectiveCall("all_gather", 5000, 4, "forward"), *[gather] * units,
             *[back_gather, scatter] * units, CollectiveCall("reduce_scatter", 10000, 4, "backward"), norm)
    return StepCosts(ops=ops, collectives=calls, micro_batch=2, module_calls={"forward": 2 + 3 * units},
                     optimizer_calls=(("aten::_foreach_mul_", "optimizer", 0.0, float(foreach), "", 0.0),) * 2,
                     checkpoint_blocks=0, sharded_units=1 + units, sharded_params=3 + 2 * units,
                     dtensor_ops={"optimizer": 16}, dtensor_list_tensors={"optimizer": 4 * (3 + 2 * units)})


def test_costs_of_added_blocks_extend_along_the_line_through_two_builds_checked_on_a_third():
    extended = extend_step_costs([_step(4), _step(5), _step(6)], units=4, repeats=32)
    assert extended == normal_form(_step(32))
    # Ops whose one call grows with the blocks (a foreach op over every parameter) keep their calls
    # and grow per call; ops per block grow in calls.
    by_kernel = {(op.op_class, op.kernel): op for op in extended.ops}
    assert by_kernel[("optimizer", "")].count == 2 and by_kernel[("optimizer", "")].bytes == 2 * (400 + 32000)
    assert by_kernel[("matmul", "mm")].count == 64
    # A unit's collectives inserted where the second build inserts them: in forward, and between
    # backward's first and the root's last reduce-scatter; the norm's all-reduce grows in bytes.
    assert len(extended.collectives) == len(_step(32).collectives)
    assert extended.collectives[-1].bytes == 4 * 34
    assert extended.sharded_params == 67 and extended.module_calls == {"forward": 98}


@pytest.mark.parametrize("third, why", [
    (_step(6, foreach_bytes=400 + 1000 * 6 + 8), "a size off the line"),
    (_step(5), "the third build no larger than the second"),
    (_step(6, norm_bytes=7), "a collective's bytes off the line"),
])
def test_a_third_build_off_the_line_through_the_first_two_does_not_extend(third, why):
    assert extend_step_costs([_step(4), _step(5), third], units=4, repeats=32) is None, why


def _at(step: StepCosts, micro_batch: int) -> StepCosts:
    return dataclasses.replace(step, micro_batch=micro_batch)


def test_a_third_build_counted_at_the_smallest_micro_batch_checks_every_micro_batchs_extension():
    builds = [{n: _at(_step(units), n) for n in (1, 2)} for units in (4, 5)]
    extended = extend_checked_step_costs([*builds, {1: _at(_step(6), 1)}], units=4, repeats=32)
    assert extended == {n: _at(normal_form(_step(32)), n) for n in (1, 2)}
    # Off the line at the micro-batch it was counted at: no micro-batch extends.
    off = _at(_step(6, norm_bytes=7), 1)
    assert extend_checked_step_costs([*builds, {1: off}], units=4, repeats=32) is None
    # Two builds alone extend without a check (the third checked another micro-batch).
    assert extend_step_costs([_step(4), _step(5)], units=4, repeats=32) == normal_form(_step(32))
    with pytest.raises(ValueError, match="two or three"):
        extend_step_costs([_step(4), _step(5), _step(6), _step(7)], units=4, repeats=32)


def test_steps_that_lose_calls_as_blocks_are_added_do_not_extend():
    fewer = _step(5)
    fewer = StepCosts(ops=fewer.ops, collectives=fewer.collectives[:-2], micro_batch=2,
                      module_calls=fewer.module_calls)
    assert extend_step_costs([_step(4), fewer, _step(6)], units=4, repeats=32) is None
    with pytest.raises(ValueError, match="micro-batch"):
        extend_step_costs([_step(4), StepCosts(ops=(), collectives=(), micro_batch=3), _step(6)],
                          units=4, repeats=32)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sharding, world, layout, checkpointing", [
    ("fsdp", 4, {}, "on"), ("ddp", 2, {}, "off"),
    pytest.param("fsdp-offload", 2, {}, "off", marks=pytest.mark.slow),
    pytest.param("fsdp", 4, {}, 6, marks=pytest.mark.slow),  # half the blocks: units of two
    pytest.param("fsdp", 4, dict(tp=2), "on", marks=pytest.mark.slow),  # about 10 s each
    pytest.param("fsdp", 4, dict(cp=2), "on", marks=[pytest.mark.slow, NEEDS_CPU_RING]),
    pytest.param("fsdp", 8, dict(tp=2, cp=2), "on", marks=[pytest.mark.slow, NEEDS_CPU_RING]),
])
def test_a_count_on_three_small_builds_extends_to_the_whole_models_count(
        monkeypatch, sharding, world, layout, checkpointing):
    extended = []
    original = extend.extend_step_costs

    def spy(steps, **kwargs):
        found = original(steps, **kwargs)
        extended.append((steps[0].micro_batch, len(steps), found is not None))
        return found

    monkeypatch.setattr(extend, "extend_step_costs", spy)
    settings = dict(precision="bf16", checkpointing=checkpointing, sharding=sharding, world_size=world,
                    for_gpu=H100, parallel=parse_layout(**layout))
    with synthesized_traces(True, max_share=None):  # twelve blocks: builds of 2, 3 and 4
        small = count_steps_costs(LLAMA12, [2, 1], **settings)
    # The third build checked micro-batch 1 only; 2 extended from the first two builds.
    assert extended == [(1, 3, True), (2, 2, True)]
    whole = count_steps_costs(LLAMA12, [2, 1], few_blocks=False, **settings)
    for n in (1, 2):
        assert normal_form(small[n]) == normal_form(whole[n]), n


def test_only_models_whose_small_builds_cost_well_below_the_whole_are_counted_on_them():
    workload = load_workload(LLAMA12)
    # Twelve blocks: builds of 2, 3 and 4 hold more than half the blocks (SYNTHESIS_MAX_SHARE).
    assert small_builds(workload, "on") is None
    with synthesized_traces(True, max_share=None):
        pattern, builds = small_builds(workload, "on")
        assert [b.blocks for b in builds] == [2, 3, 4] and builds[0].checkpointed == (0, 1)
        assert [b.units for b in builds] == [2, 3, 4] and pattern.repeats == 12
        # Half the blocks checkpointed: units of two blocks, builds of 4, 6 and 8.
        pattern, builds = small_builds(workload, 6)
        assert [b.blocks for b in builds] == [4, 6, 8] and builds[1].checkpointed == (0, 2, 4)
        # Four blocks checkpointed in twelve: units of three, and a build of 12 is the model.
        assert small_builds(workload, 4) is None
        pattern, builds = small_builds(workload, "off")
        assert builds[2].checkpointed == ()
        assert small_builds(workload, "on", parallel=parse_layout(tp=2, pp=2)) is None  # pipelines


def test_a_micro_step_op_that_grows_per_call_with_the_blocks_does_not_extend():
    # Only the optimizer's calls are told apart by their order; an op of the forward whose one call
    # grows is of one build only.
    def grown(units):
        step = _step(units)
        return StepCosts(**{**step.__dict__, "ops": step.ops + (
            OpCost("elementwise", "forward", 0.0, 100.0 * units, 1),)})

    assert extend_step_costs([grown(4), grown(5), grown(6)], units=4, repeats=32) is None
    # The optimizer's ops without their order (counted otherwise) do not extend either.
    unordered = [StepCosts(**{**_step(m).__dict__, "optimizer_calls": ()}) for m in (4, 5, 6)]
    assert extend_step_costs(unordered, units=4, repeats=32) is None
