"""A layout search ranked by throughput skips a layout that cannot win (autotune.timing.bound):
the bound's arithmetic, that it is never below what a layout planned whole predicts, and what
the search does with it (no planner's search for a layout the bound and one screen rule out)."""

import pathlib
import sys
from types import SimpleNamespace

import pytest

from autotune.distributed.context_parallel import cpu_ring_available
from autotune.distributed.layout import Layout
from autotune.gpus.catalog import load_profile
from autotune.timing.bound import SLACK, ReferenceStep, fastest_possible, micro_step_floor
from autotune.timing.comm import network_from_profile
from autotune.timing.costs import OpCost, StepCosts
from autotune.timing.layout import pipeline_bubble, tensor_parallel_seconds
from autotune.timing.roofline import speed_for_profile
from autotune.timing.window import StepModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SPEED = speed_for_profile("h100-80gb")
NETWORK = network_from_profile(load_profile("h100-80gb"))


def _costs(n: int, *, recompute: bool) -> StepCosts:
    """A step of ``n`` samples: a big matmul per sample each way, a fixed small op per phase."""
    ops = [OpCost("matmul", "forward", 2e12 * n, 1e6 * n, 1), OpCost("matmul", "backward", 4e12 * n, 2e6 * n, 2),
           OpCost("elementwise", "forward", 0.0, 1e3, 10), OpCost("elementwise", "backward", 0.0, 1e3, 10)]
    if recompute:
        ops.append(OpCost("matmul", "recompute", 2e12 * n, 1e6 * n, 1))
    return StepCosts(ops=tuple(ops), collectives=(), micro_batch=n, tokens=n * 64)


def _model(*, recompute: bool) -> StepModel:
    return StepModel({n: _costs(n, recompute=recompute) for n in (1, 2)}, SPEED, "bf16")


def test_the_bound_is_data_parallels_micro_steps_over_the_degree_with_the_layouts_own_costs():
    on = ReferenceStep(_model(recompute=True), every_block=True)
    step = lambda n, phases: sum(on.model.at(n).seconds.get(p, 0.0) for p in phases)  # noqa: E731
    # Counted at 1 and 2, the line gives 3 exactly (every op here is linear in the micro-batch).
    assert micro_step_floor([on], 3, recompute=False) == pytest.approx(step(3, ("forward", "backward")))
    assert micro_step_floor([on], 3, recompute=True) == pytest.approx(
        step(3, ("forward", "backward", "recompute")))
    # Tensor parallel 2: half the compute, the exposed collectives of its 4 blocks per micro-step.
    split = [3, 3]
    layout = Layout(tp=2)
    compute = SLACK * 2 * step(3, ("forward", "backward", "recompute")) / 2
    tp = sum(tensor_parallel_seconds(layout, tokens=3 * 64, hidden=256, blocks=4, activation_bytes=2,
                                     network=NETWORK) for _ in split)
    got = fastest_possible([on], layout, split, recompute=True, network=NETWORK, seq_len=64, hidden=256,
                           blocks=4, activation_bytes=2)
    assert got == pytest.approx(6 / (compute + tp) / 2)
    # A pipeline of 2: half the compute per micro-step, then the bubble of 2 micro-batches.
    piped = Layout(pp=2)
    busy = SLACK * 2 * step(3, ("forward", "backward")) / 2
    bubble = pipeline_bubble(piped, 2)
    got = fastest_possible([on], piped, split, recompute=False, network=NETWORK, seq_len=64, hidden=256,
                           blocks=4, activation_bytes=2)
    assert got == pytest.approx(6 / (busy / (1 - bubble)) / 2)
    # More micro-batches shrink a pipeline's bubble: the bound rises with them here.
    assert fastest_possible([on], piped, [1] * 6, recompute=False, network=NETWORK, seq_len=64, hidden=256,
                            blocks=4, activation_bytes=2) > got


def test_only_an_every_block_reference_gives_the_recompute_floor_and_the_least_reference_counts():
    off = ReferenceStep(_model(recompute=False), every_block=False)
    on = ReferenceStep(_model(recompute=True), every_block=True)
    plain = micro_step_floor([off], 2, recompute=False)
    # No every-block setting counted: no recompute is the floor, as without checkpointing.
    assert micro_step_floor([off], 2, recompute=True) == pytest.approx(plain)
    assert micro_step_floor([off, on], 2, recompute=True) > plain
    # Several references: the least of them (each is a floor).
    slower = ReferenceStep(StepModel({n: _costs(2 * n, recompute=False) for n in (1, 2)}, SPEED, "bf16"),
                           every_block=False)
    assert micro_step_floor([slower, off], 2, recompute=False) == pytest.approx(plain)
    with pytest.raises(ValueError, match="counted steps and a split"):
        fastest_possible([], Layout(tp=2), [1], recompute=False, network=NETWORK, seq_len=1, hidden=1,
                         blocks=1, activation_bytes=2)



def test_data_parallelisms_settings_counted_at_one_size_draw_one_reference_not_each(monkeypatch):
    """Each ranked setting alone bounds a layout: where none was counted at two sizes, one more
    size is counted for the setting with every block checkpointed and FSDP2 over the whole world
    only (the wide decoder's four settings, each at one size: one count instead of four)."""
    from autotune.distributed.sharding.settings import Sharding
    from autotune.orchestration import predicted
    from autotune.planning.types import SettingTried
    from autotune.workload.checkpoint_count import Checkpointing

    def setting(sharding, blocks):
        return SettingTried(precision="bf16", checkpointing=Checkpointing(blocks, 4), sharding=sharding,
                            shard_group=None, parallel=Layout())

    settings = [setting(Sharding.DDP, 0), setting(Sharding.DDP, 4), setting(Sharding.FSDP, 0),
                setting(Sharding.FSDP, 4)]
    counted = []

    def count(planner, setting_, sizes, tokens, gpu):
        counted.append((setting_, tuple(sizes)))
        return {n: _costs(n, recompute=bool(setting_.checkpointing.blocks)) for n in sizes}

    monkeypatch.setattr(predicted, "_count", count)
    monkeypatch.setattr(predicted, "tokens_per_sample", lambda workload: 64)

    def planner(settings_):
        return SimpleNamespace(
            world_size=4, workload=None, target=SimpleNamespace(profile=SimpleNamespace(name="h100-80gb")),
            step_models=[(s, {2: _costs(2, recompute=bool(s.checkpointing.blocks))},
                          StepModel({2: _costs(2, recompute=bool(s.checkpointing.blocks))}, SPEED, "bf16"))
                         for s in settings_])

    (only,) = predicted.reference_steps(planner(settings))
    assert counted == [(settings[3], (3,))]
    assert only.every_block and set(only.model.counted) == {2, 3}
    # Where the settings drawn through two sizes lack every block, that one is drawn too.
    counted.clear()
    mixed = planner(settings[2:])
    off_model = StepModel({n: _costs(n, recompute=False) for n in (2, 3)}, SPEED, "bf16")
    mixed.step_models[0] = (settings[2], dict(off_model.counted), off_model)
    found = predicted.reference_steps(mixed)
    assert counted == [(settings[3], (3,))]
    assert [r.every_block for r in found] == [False, True]

def test_a_layouts_floor_steps_are_exact_where_counted_and_below_its_count_elsewhere():
    from autotune.timing.bound import FloorSteps

    def small(n: int) -> StepCosts:
        # A micro-batch of one skips a copy (a dimension of one): 1 and 2 draw more ops and bytes
        # per sample than the sizes beyond take, and a line through them is above 8's count.
        ops = [OpCost("matmul", "forward", 2e9 * n, 4e5 * n + 1e6, 6), OpCost("matmul", "backward", 4e9 * n, 8e5 * n + 2e6, 12),
               OpCost("elementwise", "forward", 0.0, 2e4 * n, 20), OpCost("attention", "recompute", 1e7 * n, 1e4 * n, 2)]
        if n > 1:
            ops.append(OpCost("elementwise", "backward", 0.0, 4e5 * n, 12))
        return StepCosts(ops=tuple(ops), collectives=(), micro_batch=n, tokens=16 * n, module_calls={"forward": 10})

    counted = {n: small(n) for n in (1, 2)}
    floor = FloorSteps(counted, SPEED, "bf16")
    line = StepModel(counted, SPEED, "bf16")
    assert floor.at(2).seconds == line.at(2).seconds
    exact = StepModel({8: small(8)}, SPEED, "bf16").at(8).seconds
    assert sum(line.at(8).seconds.values()) > sum(exact.values())  # the line is no floor here
    for phase, seconds in floor.at(8).seconds.items():
        assert seconds <= exact[phase]
    assert sum(floor.at(8).seconds.values()) > 0.75 * sum(exact.values())  # not a trivial floor


def test_every_blocks_floor_from_the_step_without_adds_data_parallelisms_least_recompute_over_the_degree():
    from autotune.timing.bound import FloorSteps, RecomputedFloorSteps, recompute_floor

    without = {n: _costs(n, recompute=False) for n in (1, 2)}
    every, plain = ReferenceStep(_model(recompute=True), every_block=True), ReferenceStep(_model(recompute=False), every_block=False)
    floor = RecomputedFloorSteps(without, SPEED, "bf16", [every, plain], degree=4)
    for n in (1, 2, 5):
        base, got = FloorSteps(without, SPEED, "bf16").at(n).seconds, floor.at(n).seconds
        redone = every.model.at(n).seconds["recompute"]
        assert recompute_floor([every, plain], n) == redone > 0
        assert got["recompute"] == pytest.approx(base.get("recompute", 0.0) + SLACK * redone / 4)
        assert {p: s for p, s in got.items() if p != "recompute"} == {p: s for p, s in base.items() if p != "recompute"}
        # Below what the layout's own step with every block would cost: its forward again, on a
        # quarter of each sample's work.
        own = StepModel({m: _costs(m, recompute=True) for m in (1, 2)}, SPEED, "bf16").at(n).seconds
        assert sum(got.values()) <= sum(own.values())
    # No reference with every block: no recompute added (the step without is the floor).
    assert recompute_floor([plain], 3) == 0.0
    assert RecomputedFloorSteps(without, SPEED, "bf16", [plain], degree=2).at(3).seconds.get("recompute", 0.0) == 0.0


def test_fsdp_gathers_bound_each_phase_over_the_layouts_group_and_scatter_on_the_last_micro_step():
    from autotune.timing.bound import sharded_seconds
    from autotune.timing.comm import Link, Network, collective_time
    from autotune.timing.costs import CollectiveCall

    slow = Network(intra=Link(100e9, 1e-5), inter=Link(1e9, 1e-4), gpus_per_node=2)
    gb = 2**30
    calls = (CollectiveCall("all_gather", 3 * gb, 8, "forward"), CollectiveCall("all_gather", gb, 8, "forward"),
             CollectiveCall("all_gather", 4 * gb, 8, "recompute"), CollectiveCall("reduce_scatter", 8 * gb, 8, "backward"))
    plain = ReferenceStep(_model(recompute=True), every_block=True)
    sharded = ReferenceStep(_model(recompute=True), every_block=True, sharded_calls=calls)
    # Over tp 2 and a group of 4 between hosts: each kind of each phase as one collective of half
    # the bytes; none where no reference sharded over its whole world.
    layout = Layout(tp=2)
    got = sharded_seconds([plain, sharded], layout, group=4, network=slow)
    link = slow.link(4)
    assert got == pytest.approx((collective_time("all_gather", 2 * gb, 4, link),
                                 collective_time("all_gather", 2 * gb, 4, link),
                                 collective_time("reduce_scatter", 4 * gb, 4, link)))
    assert sharded_seconds([plain], layout, group=4, network=slow) is None
    gather_f, gather_b, scatter = got
    kw = dict(recompute=True, network=slow, seq_len=64, hidden=256, blocks=4, activation_bytes=2)
    split = [2, 2]
    forward = SLACK * plain.model.at(2).seconds["forward"] / 2
    backward = SLACK * (plain.model.at(2).seconds["backward"] + plain.model.at(2).seconds["recompute"]) / 2
    assert gather_f > forward  # the gathers are what bound this layout
    window = 2 * (max(forward, gather_f)) + max(backward, gather_b) + max(backward, gather_b + scatter)
    tp = sum(tensor_parallel_seconds(layout, tokens=2 * 64, hidden=256, blocks=4, activation_bytes=2,
                                     network=slow) for _ in split)
    assert fastest_possible([sharded], layout, split, sharded_group=4, **kw) == pytest.approx(4 / (window + tp) / 2)
    # Without a group (a shard group asked for, or DDP), and for a pipeline, compute alone bounds it.
    alone = fastest_possible([plain], layout, split, **kw)
    assert fastest_possible([sharded], layout, split, **kw) == pytest.approx(alone)
    assert fastest_possible([sharded], layout, split, sharded_group=4, **kw) < alone
    piped = Layout(pp=2)
    assert fastest_possible([sharded], piped, split, sharded_group=4, **kw) == pytest.approx(
        fastest_possible([plain], piped, split, **kw))


def test_the_checkpointing_settings_a_layouts_plan_may_take():
    from autotune.orchestration.layout_search import _checkpointing_choices
    from autotune.workload.checkpoint_count import Checkpointing, CheckpointingRequest

    def planner(request, first):
        return SimpleNamespace(checkpointing=CheckpointingRequest.parse(request), distributed=False,
                               first=first)

    auto = planner("auto", Checkpointing.off(4))
    assert _checkpointing_choices(auto, checkpointable=True, sharded=True) == [("off", False), ("on", True)]
    # A replica's planner also ranks fewer blocks than every one: no recompute floor for "on".
    assert _checkpointing_choices(auto, checkpointable=True, sharded=False) == [("off", False), ("on", False)]
    assert _checkpointing_choices(auto, checkpointable=False, sharded=True) == [("off", False)]
    assert _checkpointing_choices(planner("on", Checkpointing.every_block(4)), checkpointable=True,
                                  sharded=True) == [("on", True)]
    assert _checkpointing_choices(planner("off", Checkpointing.off(4)), checkpointable=True,
                                  sharded=True) == [("off", False)]
    # K of N blocks asked for: no bound (the layout is planned whole).
    assert _checkpointing_choices(planner("2", Checkpointing.of(2, 4)), checkpointable=True, sharded=True) is None


def _search(monkeypatch, *, bound=None, screen=None, own=None, **kwargs):
    """tests/sp_decoder_model.py on 2 GPUs, tp and cp auto, ranked by throughput; ``bound`` (data
    parallelism's), ``own`` (the layout's own step's) and ``screen`` replace the search's where
    given. Returns the plan, the layouts whose planners ran (in the order they first ran), and
    the screens asked (layout, micro-batch, checkpointing)."""
    from autotune import plan
    from autotune.orchestration import layout_search, planner

    ran, screens = [], []
    original_run = planner._Planner.run

    def run(self):
        if self.options.parallel not in ran:  # the winner runs again for its deferred details
            ran.append(self.options.parallel)
        return original_run(self)

    monkeypatch.setattr(planner._Planner, "run", run)
    if bound is not None:
        monkeypatch.setattr(layout_search, "fastest_possible", lambda *args, **kw: bound)
    if own is not None:
        monkeypatch.setattr(layout_search, "own_bounds",
                            lambda planner_, steps, splits, **kw: {tuple(split): own for split in splits})
    real_screen = layout_search._screen

    def screening(workload, planner_, layout, checkpointable, micro_batch=1, checkpointing=None):
        screens.append((layout, micro_batch, checkpointing))
        if callable(screen):
            return screen(layout, micro_batch, checkpointing)
        if screen is not None:
            return screen
        return real_screen(workload, planner_, layout, checkpointable, micro_batch=micro_batch,
                           checkpointing=checkpointing)

    monkeypatch.setattr(layout_search, "_screen", screening)
    monkeypatch.syspath_prepend(str(TESTS))
    planned = plan(TESTS / "sp_decoder_model.py", gpu="h100-80gb", world_size=2, target_batch=8, seq_len=16,
                   optimize="throughput", tp="auto", cp="auto", eval_batch=False, **kwargs)
    return planned, ran, screens


def test_a_layout_the_bound_puts_below_the_fastest_is_neither_screened_nor_planned(monkeypatch, one_thread):
    planned, ran, screens = _search(monkeypatch, bound=0.0)
    assert planned.parallel == Layout()
    # Data parallel's planner ran; tp 2's and cp 2's were made, never run, and nothing screened.
    assert ran == [Layout()] and screens == []
    reason = planned.reasons["layout"]
    leader = planned.step_time.samples_per_s
    assert reason.count(f"cannot beat DDP 2's {leader:.4g} samples/s per GPU") == 2
    assert "checkpointing off at most 0" in reason and "every block checkpointed at most 0" in reason


def test_a_layout_whose_least_memory_could_win_at_micro_batch_1_is_counted_not_screened_there(
        monkeypatch, one_thread):
    planned, ran, screens = _search(monkeypatch, bound=float("inf"), own=float("inf"),
                                    screen="runs out (stub)")
    # Every split could win: without checkpointing screened at micro-batch 1 (out of memory, stub);
    # every block checkpointed, the least memory, counted first and, still winning at 1, planned
    # whole without a screen (its planner's probe says what fits; a screen only that it fits).
    # (Data parallelism's trials say each likely fits without checkpointing: counted, then
    # screened. Before torch 2.14 context parallel's CPU ring is refused at that count.)
    ring = [Layout(cp=2)] if cpu_ring_available() else []
    assert screens == [(layout, 1, "off") for layout in [Layout(tp=2), *ring]]
    assert ran == [Layout(), Layout(tp=2), *ring]
    assert "runs out (stub)" not in planned.reasons["layout"]


def test_a_pipeline_whose_least_memory_could_win_at_micro_batch_1_is_screened_there_first(monkeypatch, one_thread):
    planned, ran, screens = _search(monkeypatch, bound=float("inf"), screen="runs out (stub)", pp="auto")
    piped = [(micro_batch, checkpointing) for layout, micro_batch, checkpointing in screens if layout.pp > 1]
    # Every block checkpointed, its least memory, is screened first: it runs out (stub), so the
    # pipeline fits nowhere, without a screen of the setting holding more (before: off, then on).
    assert piped == [(1, "on")]
    assert planned.parallel == Layout() and "pp 2 (1f1b) (nothing fits: runs out (stub))" in planned.reasons["layout"]


def test_a_layout_planned_unscreened_that_fits_nowhere_is_answered_by_its_planners_probe(monkeypatch, one_thread):
    from autotune.errors import PlanError
    from autotune.orchestration import planner

    original_run = planner._Planner.run

    def fits_nowhere(self):
        if not self.options.parallel.trivial:
            raise PlanError("stub: fits nowhere")
        return original_run(self)

    monkeypatch.setattr(planner._Planner, "run", fits_nowhere)
    planned, ran, screens = _search(monkeypatch, bound=float("inf"), own=float("inf"),
                                    screen="runs out (stub)")
    # Its planner's probe (stubbed) fits nowhere: the layout fits nowhere, as a screen at its
    # least memory would have said.
    assert planned.parallel == Layout()
    assert "tp 2 (stub: fits nowhere)" in planned.reasons["layout"]


def test_a_layout_whose_screen_fits_and_own_step_could_win_is_planned_whole(monkeypatch, one_thread):
    from autotune.orchestration import predicted

    counted = []
    real_count = predicted.count_steps_costs

    def count(workload, sizes, **kwargs):
        counted.extend((kwargs["parallel"], kwargs["checkpointing"].blocks, n) for n in sizes)
        return real_count(workload, sizes, **kwargs)

    monkeypatch.setattr(predicted, "count_steps_costs", count)
    planned, ran, screens = _search(monkeypatch, own=float("inf"))
    # This model is mostly kernel launches, which a split does not divide: data parallelism's
    # bound leaves each layout a chance at its larger micro-batches only, the screen there
    # without checkpointing fits, its own step (stubbed) could win, and each layout is planned
    # whole (ranked in the reason with its predicted samples/s).
    # Context parallel's CPU ring needs torch 2.14's hooks: before, its own count (which comes
    # first: data parallelism's trials say it likely fits) is refused.
    ring = [Layout(cp=2)] if cpu_ring_available() else []
    assert ran == [Layout(), Layout(tp=2), *ring]
    assert [(layout, checkpointing) for layout, _, checkpointing in screens] == [
        (layout, "off") for layout in [Layout(tp=2), *ring]]
    assert all(1 < micro_batch <= 8 for _, micro_batch, _ in screens)
    reason = planned.reasons["layout"]
    assert "cannot beat" not in reason and "FSDP 1 × TP 2 (1 accumulation step" in reason
    assert ("FSDP 1 × CP 2 (1 accumulation step" in reason) == bool(ring)
    # The own step counted for the bound (micro-batches 1 and 2) is what its planner ranks with:
    # nothing is counted twice.
    assert (Layout(tp=2), 0, 1) in counted and (Layout(tp=2), 0, 2) in counted
    assert len(counted) == len(set(counted))


@pytest.mark.parametrize("likely", [True, False], ids=["likely-fits-its-share", "guess-unknown"])
def test_a_model_parallel_layout_ranked_by_throughput_is_probed_every_block_first(monkeypatch, one_thread, likely):
    from autotune.orchestration import layout_search, planner

    probes = []
    real_probe = planner._probe_setting

    def probing(workload, backend, precision, checkpoint, upper, **kwargs):
        tried = real_probe(workload, backend, precision, checkpoint, upper, **kwargs)
        found = tried.probe.max_micro_batch if tried.probe is not None else 0
        probes.append((kwargs["parallel"], tried.checkpointing.blocks, upper, found))
        return tried

    monkeypatch.setattr(planner, "_probe_setting", probing)
    if not likely:  # data parallelism's trials say nothing of where TP 2 fits
        monkeypatch.setattr(layout_search, "_split_trials", lambda *args: iter(()))
    planned, ran, _ = _search(monkeypatch, own=float("inf"))
    assert Layout(tp=2) in ran
    tp = [(blocks, upper, found) for layout, blocks, upper, found in probes if layout == Layout(tp=2)]
    if likely:
        # Data parallelism's trials say TP 2 fits its whole share (8) without checkpointing:
        # that probe alone answers (it reaches 8; every block is not worth a probe).
        assert tp == [(0, 8, 8)]
    else:
        # Every block checkpointed first (the least it holds), then none, searched only up to
        # the micro-batch every block reached: without checkpointing it holds more, so fits no
        # higher.
        (on_blocks, _, on_found), (off_blocks, off_upper, off_found) = tp
        assert on_blocks > 0 and off_blocks == 0
        assert 1 <= off_upper <= on_found and off_found <= on_found
    assert "FSDP 1 × TP 2 (" in planned.reasons["layout"]


def _recording_own_steps(monkeypatch) -> list:
    """(layout, every_block) of each own step the layout search counts from now on, once counted
    (before torch 2.14 context parallel's count is refused)."""
    from autotune.orchestration import layout_search

    counted = []
    real_own_steps = layout_search.own_steps

    def own_steps(planner_, *, every_block):
        steps = real_own_steps(planner_, every_block=every_block)
        counted.append((planner_.options.parallel, every_block))
        return steps

    monkeypatch.setattr(layout_search, "own_steps", own_steps)
    return counted


@pytest.mark.parametrize("likely", [True, False], ids=["likely-fits", "guess-unknown"])
def test_a_layout_whose_own_step_cannot_win_is_not_planned(monkeypatch, one_thread, likely):
    from autotune.orchestration import layout_search

    if not likely:
        monkeypatch.setattr(layout_search, "_likely_without_checkpointing", lambda *args: 0)
    counted = _recording_own_steps(monkeypatch)
    planned, ran, screens = _search(monkeypatch)
    # Data parallelism's bound leaves it a chance, but its own step, counted at micro-batches 1
    # and 2, says it cannot pass DDP 2 (TP 2 and CP 2 predict a third slower planned whole): no
    # planner's search. Where data parallelism's trials say it likely fits without checkpointing
    # there, its step is counted first and nothing is screened; where they say nothing, a screen
    # (which fits) comes first, as before. Every block checkpointed runs every op of that step and
    # more: that count rules it out too, without a count of its own.
    ring = [Layout(cp=2)] if cpu_ring_available() else []
    assert ran == [Layout()] and planned.parallel == Layout()
    assert [layout for layout, _, _ in screens] == ([] if likely else [Layout(tp=2), Layout(cp=2)])
    reason = planned.reasons["layout"]
    assert reason.count("checkpointing off at most") == 1 + len(ring)
    assert reason.count("(its own step counted)") == 1 + len(ring)
    assert reason.count("(its own step without checkpointing counted)") == 1 + len(ring)
    assert counted == [(layout, False) for layout in [Layout(tp=2), *ring]]


def test_data_parallelisms_trials_guess_where_a_layout_fits_without_checkpointing():
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import _likely_without_checkpointing
    from autotune.probing.result import Trial

    GiB = 1 << 30

    def key(parallel="None", checkpointing="off", n=1):
        return ("session", (("parallel", parallel), ("sharding", "fsdp")), (), checkpointing, n, 1, None)

    def trial(n, peak, *, fits=False, past_limit=None):
        return Trial(micro_batch=n, fits=fits, peak_bytes=int(peak * GiB), seconds=0.0,
                     baseline_bytes=int(15 * GiB), past_limit=past_limit)

    memo = {key(n=1): trial(1, 82.0),  # a floor past the 78 GiB budget: the whole step's tensors
            ("tensor floor", key(n=2)): trial(2, 147.0),
            key(n=4): trial(4, 70.0),  # out of memory below the budget: stopped early, not counted
            key(checkpointing="on", n=3): trial(3, 60.0, fits=True),
            key(parallel="Layout(tp=2)", n=8): trial(8, 20.0, fits=True)}
    backend = SimpleNamespace(trials_memo=memo, info=lambda: SimpleNamespace(budget_bytes=int(78 * GiB)))
    reference = SimpleNamespace(backend=backend)
    usable = int(70 * GiB)
    # CP 2 (or TP 2): 15 + 67 / 2 = 48.5 GiB at micro-batch 1, 15 + 132 / 2 = 81 at 2.
    assert _likely_without_checkpointing(reference, Layout(cp=2), usable) == 1
    assert _likely_without_checkpointing(reference, Layout(tp=2, cp=2), usable) == 2  # 48 at 2
    assert _likely_without_checkpointing(reference, Layout(tp=1), usable) == 0
    assert _likely_without_checkpointing(reference, Layout(pp=2), usable) == 0  # a pipeline: no guess
    assert _likely_without_checkpointing(SimpleNamespace(backend=SimpleNamespace(trials_memo=None)),
                                         Layout(cp=2), usable) == 0


@pytest.mark.parametrize("fits_at_4", [False, True], ids=["every-block-runs-out-at-4", "every-block-fits-at-4"])
def test_every_block_is_bounded_by_the_step_without_and_screened_where_that_lets_it_win(
        monkeypatch, one_thread, fits_at_4):
    """Without checkpointing the layout fits at micro-batch 1, where its own step cannot win, and
    runs out at 2, where it could. Every block checkpointed is bounded by that count with data
    parallelism's recompute (``recompute_from``): it could win from 4 only, and no trial says it
    fits there, so a screen at 4 comes before its own count. Where that runs out, the count is
    spared (8B's CP 2 with every block: 2.3 CPU s); where it fits, its own step is counted and
    moves the smallest micro-batch that could win to 8, where a screen decides. (Data
    parallelism's trials say nothing of where it fits here, or its step without checkpointing
    would be counted before any screen: ``test_a_layout_whose_own_step_cannot_win_is_not_planned``.)"""
    from autotune.orchestration import layout_search

    monkeypatch.setattr(layout_search, "_likely_without_checkpointing", lambda *args: 0)
    monkeypatch.setattr(layout_search, "fastest_possible", lambda *args, **kw: float("inf"))
    owns = []

    def own_bounds(planner_, steps, splits, recompute_from=None, **kw):
        owns.append((planner_.options.parallel, recompute_from is not None))
        # Without checkpointing; every block from that count; every block's own count.
        least = {1: 2, 2: 4, 3: 8}[sum(1 for layout, _ in owns if layout == planner_.options.parallel)]
        return {tuple(split): 0.0 if max(split) < least else float("inf") for split in splits}

    counted = _recording_own_steps(monkeypatch)
    monkeypatch.setattr(layout_search, "own_bounds", own_bounds)
    planned, ran, screens = _search(monkeypatch, screen=lambda layout, micro_batch, checkpointing: (
        None if (checkpointing, micro_batch) in {("off", 1), ("on", 4 if fits_at_4 else 0)} else "runs out (stub)"))
    ring = [Layout(cp=2)] if cpu_ring_available() else []
    assert ran == [Layout()] and planned.parallel == Layout()
    last = [(4, "on"), (8, "on")] if fits_at_4 else [(4, "on")]
    # Before torch 2.14 context parallel's CPU ring is refused once its screen fits: its own step
    # is not counted.
    assert screens == [(layout, *s) for layout in [Layout(tp=2), *ring] for s in [(1, "off"), (2, "off"), *last]] + (
        [] if ring else [(Layout(cp=2), 1, "off")])
    assert counted == [c for layout in [Layout(tp=2), *ring] for c in [(layout, False), *([(layout, True)] * fits_at_4)]]
    # Data parallelism's recompute is added where every block is bounded from the step without.
    assert owns == [o for layout in [Layout(tp=2), *ring] for o in [(layout, False), (layout, True), *([(layout, False)] * fits_at_4)]]
    reason = planned.reasons["layout"]
    said = ("every block checkpointed up to inf (its own step counted), from micro-batch 8" if fits_at_4 else
            "every block checkpointed up to inf (its own step without checkpointing counted), from micro-batch 4")
    assert reason.count(said + ": runs out (stub)") == 1 + len(ring)


@pytest.mark.parametrize("on_from", [2, 4], ids=["every-block-could-win-as-early", "every-block-could-win-later"])
def test_where_every_block_would_be_screened_no_later_it_is_screened_first_and_answers_both(
        monkeypatch, one_thread, on_from):
    """Without checkpointing could win from micro-batch 2, and data parallelism's trials guess it
    does not fit anywhere (stub: a trial holding more than the budget); every block checkpointed,
    by data parallelism's bound, from ``on_from``. Where that is no later, every block's screen
    (its turn's first step) runs first: it runs out (stub), so none checkpointed (holding at least
    as much) runs out at 2 too, unscreened (70B's CP 2: 3.0 CPU s). Where every block could only
    win later, none checkpointed is screened at 2 first, as before. (Where the trials say nothing,
    none checkpointed is screened first: ``test_a_layout_whose_own_step_cannot_win_is_not_planned``.)"""
    from autotune.orchestration import layout_search

    monkeypatch.setattr(layout_search, "_split_trials", lambda *args: iter([(1, 0, float("inf"))]))
    monkeypatch.setattr(layout_search, "fastest_possible", lambda references, layout, split, recompute, **kw: (
        float("inf") if max(split) >= (on_from if recompute else 2) else 0.0))
    counted = _recording_own_steps(monkeypatch)
    planned, ran, screens = _search(monkeypatch, screen="runs out (stub)")
    assert ran == [Layout()] and planned.parallel == Layout() and counted == []
    layouts = [Layout(tp=2), Layout(cp=2)]
    asked = [(2, "on")] if on_from == 2 else [(2, "off"), (4, "on")]
    assert screens == [(layout, *s) for layout in layouts for s in asked]
    reason = planned.reasons["layout"]
    off = ("checkpointing off up to inf, from micro-batch 2: every block checkpointed already does not fit at 2"
           if on_from == 2 else "checkpointing off up to inf, from micro-batch 2: runs out (stub)")
    on = f"every block checkpointed up to inf, from micro-batch {on_from}: runs out (stub)"
    assert reason.count(off) == 2 and reason.count(on) == 2


def test_where_data_parallelism_fits_nowhere_its_step_is_counted_for_the_bound(monkeypatch, one_thread):
    from autotune.errors import PlanError
    from autotune.orchestration import layout_search, planner

    original_run = planner._Planner.run

    def fits_nowhere(self):
        if self.options.parallel.trivial:
            raise PlanError("stub: data parallelism fits nowhere")
        return original_run(self)

    seen = []

    def bound(references, layout, split, **kwargs):
        seen.append((layout, references))
        return 0.0

    monkeypatch.setattr(planner._Planner, "run", fits_nowhere)
    monkeypatch.setattr(layout_search, "fastest_possible", bound)
    monkeypatch.syspath_prepend(str(TESTS))
    from autotune import plan

    planned = plan(TESTS / "sp_decoder_model.py", gpu="h100-80gb", world_size=2, target_batch=8, seq_len=16,
                   optimize="throughput", tp="auto", cp="auto", eval_batch=False)
    # tp 2 leads (the first that fits: nothing to bound it by); cp 2 is bounded by data
    # parallelism's step counted at micro-batches 1 and 2, every block checkpointed, FSDP2's gathers.
    assert planned.parallel == Layout(tp=2)
    assert {layout for layout, _ in seen} == {Layout(cp=2)}
    references = seen[0][1]
    assert len(references) == 1 and references[0].every_block
    assert sorted(references[0].model.counted) == [1, 2]
    assert {c.kind for c in references[0].sharded_calls} == {"all_gather", "reduce_scatter"}
    assert "cp 2 (cannot beat FSDP 1 × TP 2's" in planned.reasons["layout"]


def test_a_layouts_own_step_bounds_every_configuration_its_plan_ranks(monkeypatch, one_thread):
    """Planned whole (no bound), each model-parallel layout's ranked configurations, and its plan,
    predict no more than the bound from its own step counted at micro-batches 1 and 2 (every
    block checkpointed for the configurations with every block, else none). A line through
    those two is not a floor: on this launch-bound model it drew TP 2's micro-batch 8 at 946
    samples/s against 1026 counted (an op's rate grows with its size); nor are every-block steps
    less their recompute a floor for none (879: the recompute's DTensor work is in backward)."""
    from autotune.orchestration.predicted import own_bounds, own_steps
    from autotune.orchestration import layout_search

    monkeypatch.setattr(layout_search, "_cannot_win", lambda *args, **kwargs: None)
    planners = _recording_planners(monkeypatch)
    _search(monkeypatch)
    checked = set()
    for planner_, made in planners:
        layout = planner_.options.parallel
        if layout.trivial:
            continue
        network = network_from_profile(planner_.target.profile)
        ranked = [(c.checkpointing, c.micro_batches, c.step_time.samples_per_s) for c in made.predicted]
        for blocks, split, predicted in [*ranked, (made.checkpointing, made.micro_batches,
                                                   made.step_time.samples_per_s)]:
            every = bool(blocks.blocks) and blocks.blocks == blocks.total
            bound = own_bounds(planner_, own_steps(planner_, every_block=every), [split], network=network)[tuple(split)]
            assert predicted <= bound * (1 + 1e-9), (layout, blocks, split)
            checked.add((layout, every))
    assert (Layout(tp=2), False) in checked
    assert ((Layout(cp=2), False) in checked) == cpu_ring_available()


WIDE = dict(world_size=4, target_batch=16, seq_len=4096, headroom=0.6, tp="auto", cp="auto", pp="auto")
"""tests/wide_decoder_model.py on 4 H100s with 40% of each usable: data parallel leads (DDP 4),
pp 2 cannot beat it, tp 2 is planned."""
WIDE_FSDP_BETWEEN_HOSTS = dict(WIDE, sharding="fsdp", gpus_per_node=2, network_gbps=25, pp=1)
"""The same on hosts of 2 GPUs with 25 Gb/s between them, FSDP2: data parallelism's gathers cross
hosts (its FSDP2 bounds the layouts'), as do cp 2's; tp 2's stay inside a host."""


def _recording_planners(monkeypatch) -> list:
    """Each planner ranked by predicted throughput from now on, with its plan, as it plans."""
    from autotune.orchestration import planner

    planned = []
    original = planner.fastest_predicted

    def recording(planner_):
        made = original(planner_)
        planned.append((planner_, made))
        return made

    monkeypatch.setattr(planner, "fastest_predicted", recording)
    return planned


def _ranked_search(monkeypatch, *, prune: bool, options: dict):
    """tests/wide_decoder_model.py ranked by throughput: the plan, and each planned layout's
    planner and plan."""
    from autotune import plan
    from autotune.orchestration import layout_search

    planned_layouts = _recording_planners(monkeypatch)
    if not prune:
        monkeypatch.setattr(layout_search, "_cannot_win", lambda *args, **kwargs: None)
    monkeypatch.syspath_prepend(str(TESTS))
    chosen = plan(TESTS / "wide_decoder_model.py", gpu="h100-80gb", optimize="throughput", eval_batch=False,
                  **options)
    return chosen, planned_layouts


@pytest.mark.slow
@pytest.mark.parametrize("options", [WIDE, WIDE_FSDP_BETWEEN_HOSTS], ids=["ddp", "fsdp-between-hosts"])
def test_the_bound_is_never_below_a_layout_planned_whole_and_skipping_changes_no_choice(
        monkeypatch, one_thread, options):
    """Planned whole, every configuration each model-parallel layout ranked predicts no more than
    the bound from data parallelism's counted steps at its own split and checkpointing (with
    FSDP2's gathers where data parallelism's plan sharded), from its ranked settings and from its
    step counted as where it fits nowhere, nor than the bound from its own step (with every block
    checkpointed, nor than the one from its own step without); with the bounds, the search chooses the same plan, planning no more layouts."""
    from autotune.orchestration.predicted import _counted_reference, reference_steps

    whole, planned = _ranked_search(monkeypatch, prune=False, options=options)
    reference = next(p for p, _ in planned if p.options.parallel.trivial)
    # Its ranked settings, and its step counted as where it fits nowhere: each bounds alike.
    for references in (reference_steps(reference), _counted_reference(reference)):
        _check_bounds(planned, references, options)
    # And each ranked setting alone (reference_steps draws one where none was counted at two sizes).
    singles = _every_ranked_setting(reference)
    assert len(singles) == len(reference.step_models) >= 2
    for single in singles:
        _check_bounds(planned, [single], options, alone=True)
    monkeypatch.undo()
    bounded, planned_bounded = _ranked_search(monkeypatch, prune=True, options=options)
    assert len(planned_bounded) <= len(planned)
    assert (bounded.parallel, bounded.micro_batches, bounded.checkpointing) == (
        whole.parallel, whole.micro_batches, whole.checkpointing)
    if options is WIDE:
        assert len(planned_bounded) < len(planned) and "cannot beat" in bounded.reasons["layout"]


def _every_ranked_setting(reference) -> list:
    """Each of data parallelism's ranked settings as a reference of its own, drawn through two
    counted sizes."""
    from autotune.orchestration.predicted import _count, _sharded_calls, _every_block, _sharded_over_world
    from autotune.timing.bound import ReferenceStep
    from autotune.timing.window import StepModel, tokens_per_sample

    found = []
    for setting, counted, model in reference.step_models:
        if len(counted) < 2:
            counted = {**counted, **_count(reference, setting, [max(counted) + 1],
                                           tokens_per_sample(reference.workload), reference.target.profile.name)}
            model = StepModel(counted, model.speed, setting.precision)
        calls = (_sharded_calls(model.at(min(counted)).collectives)
                 if _sharded_over_world(setting, reference.world_size) else ())
        found.append(ReferenceStep(model, every_block=_every_block(setting), sharded_calls=calls))
    return found


def _check_bounds(planned, references, options, alone=False):
    """``alone``: one reference by itself, which need not shard (nor bind through its gathers)."""
    from autotune.orchestration.predicted import own_bounds, own_steps
    from autotune.precision import Precision

    network = network_from_profile(load_profile("h100-80gb"), gpus_per_node=options.get("gpus_per_node"),
                                   network_gbps=options.get("network_gbps"))
    if options.get("sharding") == "fsdp" and not alone:  # its gathers bound the layouts' (auto may rank FSDP2 too)
        assert any(r.sharded_calls for r in references)
    checked, own_checked, gathers_bind, recomputed = set(), set(), False, False
    for planner_, made in planned:
        layout = planner_.options.parallel
        if layout.trivial:
            continue
        for configuration in made.predicted:
            blocks = configuration.checkpointing
            kwargs = dict(recompute=bool(blocks.blocks) and blocks.blocks == blocks.total, network=network,
                          seq_len=4096, hidden=2048, blocks=2,
                          activation_bytes=2 if Precision.parse(configuration.precision) is not Precision.FP32 else 4)
            bound = fastest_possible(references, layout, configuration.micro_batches,
                                     sharded_group=layout.data_parallel(4) * layout.cp, **kwargs)
            assert configuration.step_time.samples_per_s <= bound, (layout, configuration.label())
            every = kwargs["recompute"]
            if layout.pp > 1:  # no own-step bound for a pipeline (its stage's count is the probe's)
                continue
            own = own_bounds(planner_, own_steps(planner_, every_block=every), [configuration.micro_batches],
                             network=network)[tuple(configuration.micro_batches)]
            assert configuration.step_time.samples_per_s <= own * (1 + 1e-9), (layout, configuration.label())
            if every:
                # A step with every block checkpointed runs every op of the step without, and a
                # recompute no faster than data parallelism's over tp × cp: the bound from the
                # layout's own step without checkpointing and those references' recompute holds for
                # it too (_cannot_win bounds every block with it before that step is counted).
                unchecked = own_bounds(planner_, own_steps(planner_, every_block=False),
                                       [configuration.micro_batches], network=network, recompute_from=references)
                assert configuration.step_time.samples_per_s <= unchecked[tuple(configuration.micro_batches)] * (
                    1 + 1e-9), (layout, configuration.label())
                recomputed |= any(r.every_block for r in references)
            checked.add(layout.describe_degrees())
            own_checked.add(every)
            gathers_bind |= bound < fastest_possible(references, layout, configuration.micro_batches, **kwargs)
    assert "tp 2" in checked
    assert own_checked == {False, True}  # the layouts' own steps bound with and without checkpointing
    # ... and every block's from the step without, with data parallelism's recompute where it has one.
    assert recomputed or alone
    # Between hosts of 2 at 25 Gb/s, FSDP2's gathers bound at least one layout tighter than compute:
    # cp 2's, over all 4 ranks (tp 2's group of 2 stays inside a host; torch 2.13 has no CPU ring).
    assert gathers_bind or options is WIDE or not cpu_ring_available() or alone


@pytest.mark.slow
def test_a_smaller_shard_groups_bound_is_never_below_its_ranked_prediction(monkeypatch, one_thread):
    """Data parallelism planned in detail (tests/wide_decoder_model.py on 8 H100s of hosts of 4,
    FSDP2 over all 8 crosses hosts, half of each usable): shard group 2 reaches the world's one step
    and is ranked; its prediction is no more than its bound from the whole world's ranked
    settings (``shard_group_bounds``: what a layout search's deferred details are weighed by)."""
    from autotune import plan
    from autotune.orchestration.predicted import shard_group_bounds

    planners = _recording_planners(monkeypatch)
    monkeypatch.syspath_prepend(str(TESTS))
    plan(TESTS / "wide_decoder_model.py", gpu="h100-80gb", optimize="throughput", eval_batch=False,
         world_size=8, target_batch=32, seq_len=4096, headroom=0.5, gpus_per_node=4)
    (planner_, made), = planners
    bounds = shard_group_bounds(planner_)
    smaller = [c for c in made.predicted if c.shard_group is not None and c.shard_group < 8]
    assert smaller, "no smaller shard group ranked: the check would check nothing"
    for c in smaller:
        assert c.step_time.samples_per_s <= bounds[c.shard_group], (c.shard_group, c.checkpointing)


@pytest.mark.slow
def test_shard_groups_whose_state_shards_pass_the_budget_get_no_bound_and_fit_nowhere(monkeypatch, one_thread):
    """Llama-3.1 70B on 256 H100s (bench/llama_like.py, sequence 8192, target 512): FSDP 256 takes
    its share of 2 in two micro-batches of 1. On shard groups of 4, 8 and 16 a rank also holds its
    parameter and AdamW-state shards 256/g times larger, which with FSDP 256's tensors at
    micro-batch 1 pass the budget: no bound for them, and the planner's own probes find that none
    of them fits there. Groups 32 and 64 fit, are ranked, and predict no more than their bounds."""
    from autotune import plan
    from autotune.orchestration.predicted import shard_group_bounds

    planners = _recording_planners(monkeypatch)
    monkeypatch.setenv("AUTOTUNE_LLAMA", "70b")
    monkeypatch.setenv("AUTOTUNE_LLAMA_SEQ", "8192")
    planned = plan(ROOT / "bench" / "llama_like.py", gpu="h100-80gb", optimize="throughput", eval_batch=False,
                   world_size=256, target_batch=512, seq_len=8192, gpus_per_node=8)
    (planner_, made), = planners
    assert planned.micro_batches == [1, 1]
    bounds = shard_group_bounds(planner_)
    assert not {4, 8, 16} & set(bounds)
    for group in (4, 8, 16):
        tried = [s for s in planned.settings if s.shard_group == group]
        assert tried and all(s.allowed_micro_batch < 1 for s in tried), group
    ranked = [c for c in made.predicted if c.shard_group in (32, 64)]
    assert ranked
    for c in ranked:
        assert c.step_time.samples_per_s <= bounds[c.shard_group], (c.shard_group, c.checkpointing)
