"""The layout search (--tp/--cp/--pp auto): candidates, order and stops, the choice and its reason,
the communication volume and the pipeline bubble. Pure: outcomes are hand-made (the planner of a
screened layout is a bundled example's, its probes stood in for)."""

import pathlib

import pytest
import torch

from autotune import ConfigError, Layout, plan
from autotune.distributed.layout import parse_layout
from autotune.planning.layouts import (LayoutOutcome, choose_layout, communication_bytes, dominates,
                                       layout_candidates, search_layouts)
from autotune.timing.layout import pipeline_bubble
from autotune.workload.model_shape import ModelShape, model_shape
from autotune.distributed.pipeline import fake_pipeline_supported

LLAMA_8B = ModelShape(heads=32, kv_heads=8, hidden=4096, blocks=32)


def degrees(layouts):
    return {(lay.tp, lay.cp, lay.pp) for lay in layouts}


def test_candidates_divide_the_world_stay_in_a_host_and_respect_heads_blocks_and_sequence():
    found, notes = layout_candidates(16, tp="auto", cp="auto", pp="auto", gpus_per_node=8,
                                     shape=ModelShape(heads=32, kv_heads=8, hidden=64, blocks=4),
                                     seq_len=8192)
    assert notes == []
    got = degrees(found)
    assert (1, 1, 1) in got and (8, 1, 2) in got and (2, 4, 2) in got and (1, 1, 4) in got
    assert all(t * c <= 8 and 8 % (t * c) == 0 for t, c, _ in got)  # inside a host of 8
    assert all(p <= 4 for _, _, p in got)  # at most one block per stage
    assert all(16 % (t * c * p) == 0 for t, c, p in got)
    # tp divides 12 heads and 4 key/value heads: 1, 2, 4 (not 3 or 6: 4 kv heads; not 8)
    found, _ = layout_candidates(24, tp="auto", shape=ModelShape(heads=12, kv_heads=4, blocks=2))
    assert degrees(found) == {(1, 1, 1), (2, 1, 1), (4, 1, 1)}
    # cp: the sequence splits into 2 × cp chunks (96 = 2 × 48: cp 1, 2, 4, 8 of world 8 but not 3)
    found, _ = layout_candidates(24, cp="auto", shape=LLAMA_8B, seq_len=96)
    assert degrees(found) == {(1, c, 1) for c in (1, 2, 3, 4, 6, 8, 12, 24) if 96 % (2 * c) == 0}
    # interleaved pipelines need pp × stages_per_rank blocks
    found, _ = layout_candidates(8, pp="auto", pp_schedule="interleaved-1f1b", shape=ModelShape(heads=32, blocks=6))
    assert degrees(found) == {(1, 1, 1), (1, 1, 2)}
    assert all(lay.stages_per_rank == 2 for lay in found if lay.pp > 1)


def test_degrees_that_cannot_split_stay_one_with_a_note():
    found, notes = layout_candidates(8, tp="auto", cp="auto", pp=2, shape=ModelShape(blocks=4))
    assert degrees(found) == {(1, 1, 2)}
    assert any(n.startswith("tp stays 1: the model names no attention heads") for n in notes)
    assert any(n.startswith("cp stays 1: the plan has no sequence length") for n in notes)
    _, notes = layout_candidates(8, tp="auto", shape=ModelShape(heads=2, kv_heads=1, blocks=4))
    assert notes == ["tp stays 1: no degree above 1 divides the world size and fits the model's 2 "
                     "attention and 1 key/value heads"]


def test_model_shape_from_a_config_or_attention_modules():
    from types import SimpleNamespace

    class HFLike(torch.nn.Module):  # a Hugging Face model's config attributes (LlamaConfig's names)
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    shape = model_shape(HFLike())
    assert shape == ModelShape(heads=8, kv_heads=2, hidden=64, blocks=3)
    assert shape.kv_hidden == 16
    plain = torch.nn.Sequential(torch.nn.Embedding(10, 32),
                                torch.nn.ModuleList(torch.nn.MultiheadAttention(32, 4) for _ in range(2)))
    assert model_shape(plain).heads == 4 and model_shape(plain).kv_heads == 4
    assert model_shape(torch.nn.Linear(3, 3)).heads is None


def test_communication_volume_follows_the_formulas():
    shape = ModelShape(heads=4, kv_heads=2, hidden=10, blocks=4)
    args = dict(shape=shape, seq_len=100, share=2, param_bytes=8000, activation_bytes=2)
    # DDP over 4: all-reduce 2 × 3/4 of the gradients; FSDP: 3 × 3/4 per micro-step.
    assert communication_bytes(Layout(), 4, sharded=False, **args) == 2 * 0.75 * 8000
    assert communication_bytes(Layout(), 4, sharded=True, steps=2, **args) == 6 * 0.75 * 8000
    # TP 2 on 4 (dp 2): 8 collectives × 4 blocks × 200 tokens × 10 × 2 B × 1/2, plus FSDP over 2
    # of the half the rank holds.
    tp = 8 * 4 * 200 * 10 * 2 * 0.5 + 3 * 0.5 * 4000
    assert communication_bytes(Layout(tp=2), 4, **args) == tp
    # CP 2 on 2: 6 × 4 blocks × 200 tokens × kv width 5 × 2 B × 1/2, and FSDP2 over the 2 cp ranks
    assert communication_bytes(Layout(cp=2), 2, **args) == 6 * 4 * 200 * 5 * 2 * 0.5 + 3 * 0.5 * 8000
    assert communication_bytes(Layout(cp=2), 2, sharded=False, **args) == 6 * 4 * 200 * 5 * 2 * 0.5
    # PP 2 on 2: forward activation and backward gradient, per stage a rank holds
    assert communication_bytes(Layout(pp=2), 2, **args) == 2 * 200 * 10 * 2
    assert communication_bytes(parse_layout(pp=2, pp_schedule="interleaved-1f1b"), 2, **args) == 4 * 200 * 10 * 2


def test_pipeline_bubble_by_schedule():
    assert pipeline_bubble(Layout(), 1) == 0
    assert pipeline_bubble(Layout(pp=4), 4) == pytest.approx(3 / 7)  # (p - 1)/(m + p - 1)
    assert pipeline_bubble(Layout(pp=4), 1) == pytest.approx(3 / 4)
    interleaved = parse_layout(pp=4, pp_schedule="interleaved-1f1b")  # 2 stages per rank
    assert pipeline_bubble(interleaved, 4) == pytest.approx(1.5 / 5.5)
    assert pipeline_bubble(parse_layout(pp=4, pp_schedule="zero-bubble"), 4) == pytest.approx(0.5 / 4.5)


def _table(answers):
    """evaluate() from {(tp, cp, pp): steps | "nowhere" | "screened" | "unavailable"}, recording
    the calls ("screened": fits nowhere, answered by one screening estimate)."""
    calls = []

    def evaluate(layout):
        calls.append((layout.tp, layout.cp, layout.pp))
        answer = answers[(layout.tp, layout.cp, layout.pp)]
        if answer in ("nowhere", "screened"):
            return LayoutOutcome(layout, error="does not fit", fits_nowhere=True, screened=answer == "screened")
        if answer == "unavailable":
            return LayoutOutcome(layout, error="not estimated: not available")
        return LayoutOutcome(layout, steps=answer, communication=10.0 * layout.model_parallel)

    return evaluate, calls


def _cost(layout):
    return {(1, 1, 1): 100, (2, 1, 1): 50, (1, 1, 2): 60, (4, 1, 1): 70, (2, 1, 2): 80, (4, 1, 2): 90}[
        (layout.tp, layout.cp, layout.pp)]


CANDIDATES = [Layout(), Layout(tp=2), Layout(pp=2), Layout(tp=4), Layout(tp=2, pp=2), Layout(tp=4, pp=2)]


def test_data_parallel_first_and_one_step_stops_the_search():
    evaluate, calls = _table({(1, 1, 1): 1})
    outcomes = search_layouts(CANDIDATES, evaluate, cost=_cost)
    assert calls == [(1, 1, 1)]
    assert [o.estimated for o in outcomes] == [True] + [False] * 5
    assert "one accumulation step was reached" in outcomes[1].error
    winner, reason = choose_layout(outcomes)
    assert winner.layout == Layout()
    assert reason.startswith("auto: data parallel: 1 accumulation step, the fewest")


def test_then_cheapest_communication_first_with_patience():
    evaluate, calls = _table({(1, 1, 1): 4, (2, 1, 1): 2, (1, 1, 2): 2, (4, 1, 1): 2, (2, 1, 2): 1,
                              (4, 1, 2): 1})
    outcomes = search_layouts(CANDIDATES, evaluate, cost=_cost, patience=2)
    # tp 2 cut steps; pp 2 and tp 4 did not: two in a row, so the rest is not estimated.
    assert calls == [(1, 1, 1), (2, 1, 1), (1, 1, 2), (4, 1, 1)]
    assert all("2 layout(s) in a row" in o.error for o in outcomes if not o.estimated)
    winner, reason = choose_layout(outcomes)
    # tp 2, pp 2 and tp 4 take 2 steps: pp 2 idles in its bubble, tp 2 communicates least.
    assert winner.layout == Layout(tp=2)
    assert "least communication of the 3 with 2 accumulation steps" in reason


def test_a_layout_that_fits_nowhere_rules_out_the_ones_it_dominates():
    evaluate, calls = _table({(1, 1, 1): "nowhere", (4, 1, 2): 3, (2, 1, 1): "nowhere",
                              (1, 1, 2): "nowhere", (4, 1, 1): 3, (2, 1, 2): "nowhere"})
    outcomes = search_layouts(CANDIDATES, evaluate, cost=_cost, patience=1)
    # After data parallel fit nowhere, every candidate left fits in the screening cap: the most
    # split go first (tp 4 × pp 2, then tp 4 and tp 2 × pp 2, the cheaper first), and tp 2 × pp 2
    # fitting nowhere rules out tp 2 and pp 2 without an estimate. Patience (1 here) stopped
    # nothing after tp 4 fitted without fewer steps.
    assert calls == [(1, 1, 1), (4, 1, 2), (4, 1, 1), (2, 1, 2)]
    by = {(o.layout.tp, o.layout.pp): o for o in outcomes}
    assert not by[(2, 1)].estimated and not by[(1, 2)].estimated
    assert by[(2, 1)].fits_nowhere and "tp 2 × pp 2 (1f1b)" in by[(1, 2)].error
    # The outcomes in the candidates' order (least split, then cheapest, first), as considered or not.
    assert [(o.layout.tp, o.layout.pp) for o in outcomes] == [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (4, 2)]
    winner, _ = choose_layout(outcomes)
    # tp 4 and tp 4 × pp 2 take 3 steps: tp 4 idles in no pipeline bubble.
    assert winner.steps == 3 and winner.layout == Layout(tp=4)
    # Where more candidates are left than the screening cap takes, data parallel fitting nowhere
    # sends the most split one next only; it fits, and the order is the candidates' again (a
    # layout that fits nowhere after one fitted changes it no more).
    evaluate, calls = _table({(1, 1, 1): "nowhere", (4, 1, 2): 3, (2, 1, 1): "nowhere",
                              (1, 1, 2): "nowhere", (4, 1, 1): 3, (2, 1, 2): "nowhere"})
    search_layouts(CANDIDATES, evaluate, cost=_cost, patience=5, max_screened=4)
    assert calls == [(1, 1, 1), (4, 1, 2), (2, 1, 1), (1, 1, 2), (4, 1, 1), (2, 1, 2)]
    assert dominates(Layout(tp=2, pp=2), Layout(pp=2)) and not dominates(Layout(tp=2), Layout(pp=2))
    # A dominated candidate is answered without an estimate.
    evaluate, calls = _table({(4, 1, 2): "nowhere", (1, 1, 1): "nowhere"})
    outcomes = search_layouts([Layout(), Layout(tp=4, pp=2), Layout(tp=2)], evaluate,
                              cost=lambda lay: lay.model_parallel)
    assert calls == [(1, 1, 1), (4, 1, 2)]
    skipped = next(o for o in outcomes if o.layout == Layout(tp=2))
    assert not skipped.estimated and skipped.fits_nowhere and "tp 4 × pp 2 (1f1b)" in skipped.error
    with pytest.raises(ConfigError, match="no layout fits: data parallel \\(does not fit\\)"):
        choose_layout(outcomes)


def test_an_exact_tie_goes_to_the_earlier_candidate_not_the_earlier_considered():
    # Data parallel fits nowhere: tp 2 × cp 2 is considered before cp 2 (the most split first),
    # and both plan 3 steps with as much communication; cp 2 comes first among the candidates.
    candidates = [Layout(), Layout(cp=2), Layout(tp=2, cp=2)]
    calls = []

    def evaluate(layout):
        calls.append(layout)
        if layout.trivial:
            return LayoutOutcome(layout, error="does not fit", fits_nowhere=True)
        return LayoutOutcome(layout, steps=3, communication=5.0)

    outcomes = search_layouts(candidates, evaluate, cost=lambda lay: lay.model_parallel)
    assert calls == [Layout(), Layout(tp=2, cp=2), Layout(cp=2)]
    assert [o.layout for o in outcomes] == candidates
    assert choose_layout(outcomes)[0].layout == Layout(cp=2)


def test_the_search_estimates_at_most_max_estimated():
    evaluate, calls = _table({(1, 1, 1): 4, (2, 1, 1): "unavailable", (1, 1, 2): 3, (4, 1, 1): 2,
                              (2, 1, 2): 2, (4, 1, 2): 2})
    outcomes = search_layouts(CANDIDATES, evaluate, cost=_cost, max_estimated=3, patience=10)
    # The cap counts memory answers: tp 2's refusal (a split this build lacks) is not one.
    assert calls == [(1, 1, 1), (2, 1, 1), (1, 1, 2), (4, 1, 1)]
    assert sum("at most 3 layouts" in (o.error or "") for o in outcomes) == 2
    # Screened answers (one estimate each) count against their own cap, not the planned one.
    answers = {(1, 1, 1): "nowhere", (4, 1, 2): 3, (2, 1, 1): "screened", (1, 1, 2): "screened",
               (4, 1, 1): "screened", (2, 1, 2): 2}
    evaluate, calls = _table(answers)
    outcomes = search_layouts(CANDIDATES, evaluate, cost=_cost, max_estimated=3, max_screened=2)
    # Data parallel fits nowhere, so the most split (tp 4 × pp 2) next, then two screens.
    assert calls == [(1, 1, 1), (4, 1, 2), (2, 1, 1), (1, 1, 2)]
    assert sum("screens at most 2 layouts" in (o.error or "") for o in outcomes) == 2
    evaluate, calls = _table(answers)
    outcomes = search_layouts(CANDIDATES, evaluate, cost=_cost, max_estimated=3)
    # Under the default screening cap, the most split first: tp 4 fitting nowhere rules out
    # tp 2, and pp 2 comes after the third planned layout (the estimating cap still holds).
    assert calls == [(1, 1, 1), (4, 1, 2), (4, 1, 1), (2, 1, 2)]
    assert "at most 3 layouts" in next(o for o in outcomes if o.layout == Layout(pp=2)).error
    assert choose_layout(outcomes)[0].layout == Layout(tp=2, pp=2)


def test_pipeline_bubble_breaks_ties_and_throughput_ranks_by_samples():
    flat = LayoutOutcome(Layout(tp=2), steps=2, communication=500.0, label="FSDP 4 × TP 2")
    piped = LayoutOutcome(Layout(pp=2), steps=2, communication=100.0, label="FSDP 4 × PP 2")
    winner, reason = choose_layout([piped, flat])
    assert winner is flat and "smallest pipeline bubble (0% of the step against FSDP 4 × PP 2's 33%)" in reason
    piped.samples_per_s, flat.samples_per_s = 3.0, 2.0
    winner, reason = choose_layout([piped, flat], rank_by_time=True)
    assert winner is piped and "most samples/s per GPU predicted (3)" in reason


class _StubPlanner:
    """plan()'s planner for search_layout, with a plan per layout from a table of the largest
    micro-batch each allows (None: fits nowhere; "unavailable": the split is not in this build)."""

    allowed = {}
    memoized = False
    runs = []  # (layout, search_details) of every run
    step_models = []  # no setting counted: no smaller shard group's bound

    def __init__(self, workload, options, *, inspected):
        from autotune.planning.policy import PlanRequest

        self.options, self.target, self.world_size, self.chosen = options, None, options.world_size, "bf16"
        self.usable = 80 * 2**30  # what a plan may hold (no trial holds it against anything here)
        self.request = PlanRequest(target_batch=options.target_batch, world_size=self.world_size,
                                   checkpointing="off", headroom=0.0, parallel=options.parallel,
                                   sharding="fsdp", precision="bf16")

    def run(self):
        import dataclasses

        from autotune import PlanError
        from autotune.planning.policy import build_plan
        from plan_helpers import device, fingerprint, linear_probe, setting

        allowed = self.allowed[self.options.parallel]
        self.runs.append((self.options.parallel, getattr(self, "search_details", None)))
        if allowed == "unavailable":
            raise ConfigError("tp 2: tensor parallelism is not available in this build of autotune")
        if allowed is None:
            raise PlanError("nothing fits: every setting runs out of memory at micro-batch 1")
        tried = dataclasses.replace(setting(linear_probe(allowed), precision="bf16", headroom=0.0),
                                    sharding="fsdp", shard_group=self.request.data_parallel,
                                    parallel=self.options.parallel)
        return build_plan(self.request, workload=fingerprint(param_bytes=8 * 2**20), settings=[tried],
                          device=device(), created_at="2026-12-01T00:00:00+00:00")


@pytest.mark.parametrize("memoized, throughput", [(True, False), (False, False), (False, True)])
def test_the_chosen_layout_alone_is_planned_in_detail_where_the_memo_answers_again(memoized, throughput):
    # Smaller shard groups and the sync-on-last window change neither steps nor bytes
    # communicated: with a memo (--gpu), each candidate is planned without them and the winner
    # again with them; without one (every trial would run twice) every candidate is planned in
    # detail at once (throughput ranking with a memo: the next test).
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    class Planner(_StubPlanner):
        runs = []

    Planner.memoized = memoized
    _StubPlanner.allowed = {Layout(): 2, Layout(tp=2): 4, Layout(tp=4): "unavailable", Layout(pp=2): None,
                            Layout(tp=2, pp=2): 8, Layout(pp=4): None, Layout(tp=4, pp=2): 8,
                            Layout(tp=2, pp=4): 8, Layout(tp=4, pp=4): 8, Layout(pp=8): None}
    options = PlanOptions(target_batch=64, world_size=8, sharding="fsdp", eval_batch=False,
                          **(dict(optimize="throughput", gpu="h100-80gb") if throughput else {}))
    planned = search_layout(SimpleNamespace(seq_len=None), options, dict(tp="auto", pp="auto"),
                            make_planner=Planner,
                            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True),
                                       ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)),
                            screen=lambda *args, **kwargs: None)
    assert planned.parallel == Layout(tp=2)
    details = [d for _, d in Planner.runs]
    if memoized and not throughput:
        assert not any(details[:-1]) and len(details) > 2
        assert Planner.runs[-1] == (Layout(tp=2), True)
        assert [layout for layout, _ in Planner.runs].count(Layout(tp=2)) == 2
    else:
        assert all(details)
        assert [layout for layout, _ in Planner.runs].count(Layout(tp=2)) == 1


def _ranked_stub_search(planner_type):
    """search_layout ranked by throughput (--gpu) over tp and pp on 8 GPUs, target 64, with
    ``planner_type`` (a ``_StubPlanner`` whose runs set their predicted samples/s)."""
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    _StubPlanner.allowed = {Layout(): 2, Layout(tp=2): 4, Layout(tp=4): "unavailable", Layout(pp=2): None,
                            Layout(tp=2, pp=2): 8, Layout(pp=4): None, Layout(tp=4, pp=2): 8,
                            Layout(tp=2, pp=4): 8, Layout(tp=4, pp=4): 8, Layout(pp=8): None}
    options = PlanOptions(target_batch=64, world_size=8, sharding="fsdp", eval_batch=False,
                          optimize="throughput", gpu="h100-80gb")
    return search_layout(SimpleNamespace(seq_len=None), options, dict(tp="auto", pp="auto"),
                         make_planner=planner_type,
                         inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True),
                                    ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)),
                         screen=lambda *args, **kwargs: None)


def test_ranked_by_time_a_layout_gets_its_sync_on_last_window_only_where_it_could_lead():
    # Ranked by throughput with a memo, data parallel is planned without its details (its
    # smaller shard groups, its sync-on-last window), and again with them only where they could
    # pass the winner (here its window's 1.1 cannot pass tp 2's 2.1); a model-parallel layout
    # first without its sync-on-last window, and again with it only where the most that window
    # could give passes the fastest planned so far. A layout that could not keeps its plan
    # (reduce-scattering every micro-step) and prediction; the winner is always a detailed one,
    # planned once so.
    from autotune.timing.window import WindowTime

    # (The search plans data parallel, tp 2, then tp 2 × pp 2: tp 2 has as few steps as any.)
    speeds = {Layout(): 1.0, Layout(tp=2): 2.0, Layout(tp=2, pp=2): 1.9, Layout(tp=4, pp=2): 1.5,
              Layout(tp=2, pp=4): 2.1, Layout(tp=4, pp=4): 0.5}
    upper, detailed = 1.1, 1.05  # what sync on last could give, and gives
    order = []  # (layout, details, its samples/s, the most it could reach, the fastest before it)

    class Planner(_StubPlanner):
        runs = []
        memoized = True
        target = None

        def run(self):
            layout = self.options.parallel
            made = super().run()
            details = self.search_details
            speed = speeds[layout] * (detailed if details and not layout.trivial else 1.0)
            made.step_time = WindowTime(step_s=1.0, compute_s=1.0, exposed_comm_s=0.0, bubble_s=0.0,
                                        recompute_s=0.0, samples_per_s=speed, tokens_per_s=None, mfu=None)
            self.sync_on_last_upper = speed if details else speed * upper
            order.append((layout, details, speed, self.sync_on_last_upper))
            return made

    planned = _ranked_stub_search(Planner)
    assert planned.parallel == Layout(tp=2) and planned.step_time.samples_per_s == 2.0 * detailed
    assert order[0] == (Layout(), False, 1.0, 1.0 * upper)
    fastest, again = 1.0, []
    for i, (layout, details, speed, most) in enumerate(order[1:], 1):
        if details:
            continue
        if most > fastest:  # it could lead: planned again, in detail, at once
            assert order[i + 1] == (layout, True, speed * detailed, speed * detailed)
            fastest, again = max(fastest, speed * detailed), again + [layout]
        else:
            assert layout not in [o[0] for o in order[i + 1:]]
    # tp 2 could pass data parallel (and did); tp 2 × pp 2's 1.9 could reach 2.09 with the
    # window, not tp 2's 2.1: planned once.
    assert again == [Layout(tp=2)]
    assert [o[0] for o in order] == [Layout(), Layout(tp=2), Layout(tp=2), Layout(tp=2, pp=2)]


@pytest.mark.parametrize("replicas_upper, again", [(2.0, False), (2.2, True)])
def test_ranked_by_time_data_parallels_details_are_planned_only_where_they_could_pass_the_winner(
        replicas_upper, again):
    # Data parallel is planned first without its details (smaller shard groups, its sync-on-last
    # window); tp 2 wins at 2.0. Where those details could give data parallel more than that
    # (``details_upper``), it is planned again in detail, and the choice made again.
    from autotune.timing.window import WindowTime

    speeds = {Layout(): 1.5, Layout(tp=2): 2.0, Layout(tp=2, pp=2): 1.0, Layout(tp=4, pp=2): 1.0,
              Layout(tp=2, pp=4): 1.0, Layout(tp=4, pp=4): 0.5}

    class Planner(_StubPlanner):
        runs = []
        memoized = True
        target = None

        def run(self):
            made = super().run()
            speed = speeds[self.options.parallel]
            made.step_time = WindowTime(step_s=1.0, compute_s=1.0, exposed_comm_s=0.0, bubble_s=0.0,
                                        recompute_s=0.0, samples_per_s=speed, tokens_per_s=None, mfu=None)
            self.sync_on_last_upper = replicas_upper if self.options.parallel.trivial else speed
            return made

    planned = _ranked_stub_search(Planner)
    assert planned.parallel == Layout(tp=2)
    replicas = [details for layout, details in Planner.runs if layout.trivial]
    assert replicas == ([False, True] if again else [False])


@pytest.mark.slow
def test_a_deferred_shard_group_search_plans_what_the_eager_one_plans(monkeypatch):
    # Wide blocks on 8 H100s at 128 samples per rank: FSDP 8 with shard group 2 at 32 × 2,
    # after the search planned FSDP over all 8 alone; its plan is the one every candidate's
    # eager shard-group search and sync-on-last estimate give.
    from autotune.orchestration import planner as planner_module

    def planned():
        made = plan(pathlib.Path(__file__).with_name("wide_mlp_model.py"), target_batch=512,
                    world_size=8, gpu="h100-80gb", tp="auto", pp="auto", eval_batch=False)
        found = made.to_dict()
        for setting in found["settings"]:  # the seconds each trial took aside
            probe = setting.get("probe") or {}
            probe.pop("seconds", None)
            for trial in probe.get("trials", []):
                trial.pop("seconds", None)
        return made, {k: v for k, v in found.items() if k not in ("created_at", "reasons")}

    deferred, deferred_fields = planned()
    monkeypatch.setattr(planner_module._Planner, "memoized", property(lambda self: False))
    eager, eager_fields = planned()
    assert (deferred.shard_group, deferred.micro_batch, deferred.accumulation_steps) == (2, 32, 2)
    assert deferred_fields == eager_fields
    assert deferred.reasons["layout"].startswith("auto: FSDP 8 (shard group 2): 2 accumulation steps")
    assert "loses to FSDP 8's 2 accumulation steps" in deferred.reasons["layout"]


def test_search_layout_plans_each_candidate_and_records_why(tmp_path):
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    _StubPlanner.allowed = {Layout(): 2, Layout(tp=2): 4, Layout(tp=4): "unavailable", Layout(pp=2): None,
                            Layout(tp=2, pp=2): 8, Layout(pp=4): None, Layout(tp=4, pp=2): 8,
                            Layout(tp=2, pp=4): 8, Layout(tp=4, pp=4): 8, Layout(pp=8): None}
    shape = ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)
    options = PlanOptions(target_batch=64, world_size=8, sharding="fsdp", eval_batch=False)
    workload = SimpleNamespace(seq_len=None)
    screened = []

    def screen(workload, planner, layout, checkpointable, micro_batch=1):  # one estimate of the least memory
        screened.append((layout, micro_batch))
        allowed = _StubPlanner.allowed[layout]
        return None if isinstance(allowed, int) and micro_batch <= allowed else "screened"

    planned = search_layout(workload, options, dict(tp="auto", pp="auto"), make_planner=_StubPlanner,
                            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True), shape),
                            screen=screen)
    # Least split first: data parallel (share 8, at most 2: 4 steps), then pp 2 (fits nowhere), so
    # the most split next: pp 8 (screened with one estimate: fits nowhere, which answers pp 4);
    # then tp 2 (share 16, at most 4: 4 steps) and tp 2 × pp 2 (4 steps): two without fewer steps.
    assert planned.accumulation_steps == 4 and planned.parallel == Layout(tp=2)
    assert screened == [(Layout(pp=8), 1), (Layout(tp=2), 1), (Layout(tp=2, pp=2), 1)]
    reason = planned.reasons["layout"]
    assert reason.startswith("auto: FSDP 4 × TP 2: 4 accumulation steps, the fewest of the layouts that "
                             "fit; the least communication of the 3 with 4 accumulation steps (36.06 MiB "
                             "per rank and step against FSDP 8's 84.00 MiB). ")
    # Each plan's peak beside its communication, named so neither reads as the other.
    # Listed in the candidates' order (least split, then cheapest, first), not as considered.
    assert ("FSDP 8 (4 accumulation steps, peak 120.00 MiB, 84.00 MiB communicated per rank and step); pp 2 (1f1b) (nothing fits: every setting runs out "
            "of memory at micro-batch 1); FSDP 4 × TP 2 (4 accumulation steps") in reason
    assert "bubble 20%); pp 8 (1f1b) (nothing fits: screened); " in reason
    assert ("FSDP 2 × TP 2 × PP 2 (1f1b) (4 accumulation steps, peak 180.00 MiB, 12.07 MiB communicated per "
            "rank and step, bubble 20%)") in reason
    assert ("pp 4 (1f1b) (fits nowhere, not estimated: a rank holds no less than under pp 8 (1f1b), "
            "which fits nowhere)") in reason
    assert reason.endswith("tp 4, tp 2 × pp 4 (1f1b), tp 4 × pp 2 (1f1b) (not estimated: 2 layout(s) in "
                           "a row fitted without fewer accumulation steps (later ones communicate more))")


def _recording_search(screened: list, planned_layouts: list, answer: str = "screened"):
    """A stub planner class and screen that record the layouts planned and screened (at which
    micro-batch); the screen passes up to ``_StubPlanner.allowed`` and says ``answer`` past it."""

    class Planner(_StubPlanner):
        def run(self):
            planned_layouts.append(self.options.parallel)
            return super().run()

    def screen(workload, planner, layout, checkpointable, micro_batch=1):
        screened.append((layout, micro_batch))
        allowed = _StubPlanner.allowed[layout]
        return None if isinstance(allowed, int) and micro_batch <= allowed else answer

    return Planner, screen


def test_a_layout_that_cannot_reach_the_fewest_steps_is_screened_not_planned():
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    _StubPlanner.allowed = {Layout(): 2, Layout(tp=2): 4, Layout(tp=4): "unavailable", Layout(pp=2): None,
                            Layout(tp=2, pp=2): 8, Layout(pp=4): None, Layout(tp=4, pp=2): 8,
                            Layout(tp=2, pp=4): 8, Layout(tp=4, pp=4): 8, Layout(pp=8): None}
    shape = ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)
    screened, planned_layouts = [], []
    Planner, screen = _recording_search(screened, planned_layouts)

    def search(**options):
        screened.clear(), planned_layouts.clear()
        return search_layout(SimpleNamespace(seq_len=None), PlanOptions(
            target_batch=64, world_size=8, sharding="fsdp", eval_batch=False, **options),
            dict(tp="auto", pp="auto"), make_planner=Planner, screen=screen,
            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True), shape))

    planned = search(precision="bf16")
    # Data parallel planned 4 steps (share 8, at most 2). pp 2's share is 16, and with 4 steps
    # its bubble would lose the tie: 3 steps need micro-batch 6, one estimate says no, and no
    # planner search runs. tp 2 would win a tie (less communication): 4 steps of its share of 16
    # need micro-batch 4, which fits, so it is planned (4 steps). Two in a row without fewer
    # steps end the search.
    assert screened == [(Layout(pp=2), 6), (Layout(tp=2), 4)]
    assert planned_layouts == [Layout(), Layout(tp=2)]
    assert planned.accumulation_steps == 4 and planned.parallel == Layout(tp=2)
    assert ("pp 2 (1f1b) (4 accumulation steps or more, where its bubble loses to FSDP 8's 4 "
            "accumulation steps: its share of 16 samples in 3 accumulation steps needs micro-batch 6; "
            "screened)") in planned.reasons["layout"]
    # The same plan as without the screen, where the planner may take another precision than the
    # screened one (auto without --gpu), which plans pp 2 in full.
    unscreened = search(precision="auto")
    assert (unscreened.accumulation_steps, unscreened.parallel) == (4, Layout(tp=2))
    assert Layout(pp=2) in planned_layouts and (Layout(pp=2), 4) not in screened


def test_a_screened_layouts_planner_probes_every_block_checkpointed_first():
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    _StubPlanner.allowed = {Layout(): 2, Layout(tp=2): 4, Layout(tp=4): "unavailable", Layout(pp=2): None,
                            Layout(tp=2, pp=2): 8, Layout(pp=4): None, Layout(tp=4, pp=2): 8,
                            Layout(tp=2, pp=4): 8, Layout(tp=4, pp=4): 8, Layout(pp=8): None}
    shape = ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)
    first = {}

    class Planner(_StubPlanner):
        def run(self):
            first[self.options.parallel] = self.every_block_first
            return super().run()

    def screen(workload, planner, layout, checkpointable, micro_batch=1):
        allowed = _StubPlanner.allowed[layout]
        return None if isinstance(allowed, int) and micro_batch <= allowed else "screened"

    def search(**options):
        first.clear()
        search_layout(SimpleNamespace(seq_len=None), PlanOptions(
            target_batch=64, world_size=8, sharding="fsdp", eval_batch=False, precision="bf16",
            **options), dict(tp="auto", pp="auto"), make_planner=Planner, screen=screen,
            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True), shape))
        return first

    # Data parallel is planned unscreened, as asked; tp 2's screen fitted with every block
    # checkpointed, so its planner starts there.
    assert search() == {Layout(): False, Layout(tp=2): True}


def test_data_parallel_offloads_only_where_no_layout_fits_on_the_device():
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    shape = ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)
    runs = []

    class Planner(_StubPlanner):
        def run(self):
            trivial = self.options.parallel == Layout()
            if trivial:
                runs.append(self.offload_last_resort)
            if trivial and self.offload_last_resort:  # fsdp-offload fits
                self.allowed = {**self.allowed, Layout(): 1}
            return super().run()

    def search():
        runs.clear()
        return search_layout(SimpleNamespace(seq_len=None), PlanOptions(
            target_batch=8, world_size=4, sharding="auto", eval_batch=False, precision="bf16"),
            dict(tp="auto", pp=1), make_planner=Planner, screen=lambda *args, **kwargs: None,
            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True), shape))

    # tp 4 fits on the device: data parallel was planned without host offload, once.
    _StubPlanner.allowed = {Layout(): None, Layout(tp=2): None, Layout(tp=4): 1}
    assert search().parallel == Layout(tp=4) and runs == [False]
    # No layout fits on the device: data parallel again, offload allowed.
    _StubPlanner.allowed = {Layout(): None, Layout(tp=2): None, Layout(tp=4): None}
    planned = search()
    assert planned.parallel == Layout() and runs == [False, True]
    assert planned.reasons["layout"].startswith("auto: FSDP 4: 2 accumulation steps")


def test_every_block_first_probes_none_at_its_micro_batch_only(examples_dir):
    from autotune.distributed.sharding.settings import Sharding
    from autotune.orchestration.planner import _Planner
    from autotune.orchestration.request import PlanOptions
    from autotune.planning.types import SettingTried
    from autotune.workload.contract import load_workload

    planner = _Planner(load_workload(examples_dir / "tiny_lm.py"), PlanOptions(
        target_batch=8, world_size=2, sharding="fsdp", eval_batch=False, precision="fp32",
        device="cpu", memory_limit="1GiB", parallel=Layout(tp=2)))
    calls, allowed, hints = [], {}, []

    def try_setting(checkpoint, precision=None, layout=None, upper=None, hint=None, least=None):
        calls.append((checkpoint.label, upper, least))
        hints.append(hint)
        return SettingTried(precision="fp32", checkpointing=checkpoint,
                            allowed_micro_batch=allowed[checkpoint.label])

    planner.try_setting = try_setting
    off, on = planner.first.label, planner.every_block.label
    allowed.update({on: 3, off: 0})
    assert [s.allowed_micro_batch for s in planner.try_layout((Sharding.FSDP, 1))] == [0, 3]
    assert calls == [(off, None, None), (on, None, None)]  # unscreened: none first, as ever
    calls.clear()
    planner.every_block_first = True
    found = planner.try_layout((Sharding.FSDP, 1))
    # None checkpointed holds no less: it can only tie every block's micro-batch, tried alone.
    assert calls == [(on, None, None), (off, 3, 3)]
    assert [s.checkpointing.label for s in found] == [off, on]
    assert found[0].only_micro_batch == 3 and found[1].only_micro_batch is None
    calls.clear()
    allowed[on] = 0  # fits nowhere with every block checkpointed: nor without
    assert [s.checkpointing.label for s in planner.try_layout((Sharding.FSDP, 1))] == [on]
    assert calls == [(on, None, None)]
    # Data parallel's planner in a layout search: its sharded settings alike; a replica's keep
    # none first (the fewest-blocks search starts from it).
    planner.every_block_first, planner.sharded_every_block_first = False, True
    allowed[on] = 3
    calls.clear()
    planner.try_layout((Sharding.FSDP, 1))
    assert calls == [(on, None, None), (off, 3, 3)]
    calls.clear()
    planner.try_layout((Sharding.DDP, None))
    assert calls[:2] == [(off, None, None), (on, None, None)]
    # Ranked by throughput, none checkpointed at a smaller micro-batch may win (no recompute):
    # its search runs below every block's micro-batch, not at it alone.
    planner.options.optimize = "throughput"  # what _every_block_first reads of the options
    calls.clear()
    found = planner.try_layout((Sharding.FSDP, 1))
    assert calls == [(on, None, None), (off, 3, None)]
    assert [s.checkpointing.label for s in found] == [off, on] and found[0].only_micro_batch is None
    assert hints[-1] is None  # no guess: the search's own order
    # A layout search's guess of where none fits (from data parallelism's trials) is where that
    # search starts: at 1 where nothing likely fits, never above every block's micro-batch.
    for guessed, hint in ((0, 1), (2, 2), (9, 3)):
        planner.likely_without_checkpointing = lambda guessed=guessed: guessed
        calls.clear(), hints.clear()
        planner.try_layout((Sharding.FSDP, 1))
        assert calls == [(on, None, None), (off, 3, None)] and hints == [None, hint]


def test_a_layout_search_probes_data_parallels_sharded_settings_every_block_first():
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    made = []

    class Planner(_StubPlanner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    _StubPlanner.allowed = {Layout(): 8, Layout(tp=2): 8}
    for optimize in ("memory", "throughput"):
        made.clear()
        search_layout(SimpleNamespace(seq_len=None), PlanOptions(
            target_batch=8, world_size=2, sharding="auto", eval_batch=False, precision="bf16",
            optimize=optimize, gpu="h100-80gb"), dict(tp="auto"), make_planner=Planner,
            screen=lambda *args, **kwargs: None,
            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True),
                       ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)))
        assert made[0].sharded_every_block_first
        # Where none checkpointed is searched below every block, it starts at data parallelism's
        # guess (here: no trials, nothing likely fits).
        assert made[0].likely_without_checkpointing() == 0


def test_a_layout_that_could_only_tie_at_micro_batch_1_and_runs_out_there_fits_nowhere():
    # 8B at sequence 131072 on 8 GPUs: CP 8 planned 8 steps of micro-batch 1 (its whole share),
    # so a later layout could only tie, at micro-batch 1. One estimate there says it fits nowhere
    # (its planner had tried 8 micro-batches that all ran out of memory, 47 CPU s).
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    _StubPlanner.allowed = {Layout(): None, Layout(tp=2): None, Layout(tp=4): 1}
    shape = ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)
    screened, planned_layouts = [], []
    Planner, screen = _recording_search(screened, planned_layouts, "runs out of memory")

    planned = search_layout(SimpleNamespace(seq_len=None), PlanOptions(
        target_batch=4, world_size=4, sharding="fsdp", eval_batch=False, precision="bf16"),
        dict(tp="auto", pp=1), make_planner=Planner, screen=screen,
        inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True), shape))
    # Data parallel fits nowhere, so tp 4 next: 4 steps of its share of 4. tp 2 (a share of 2)
    # could tie only at micro-batch 1, and runs out of memory there: no planner search.
    assert planned.parallel == Layout(tp=4) and planned.accumulation_steps == 4
    assert screened == [(Layout(tp=4), 1), (Layout(tp=2), 1)]
    assert planned_layouts == [Layout(), Layout(tp=4)]
    assert "tp 2 (nothing fits: runs out of memory)" in planned.reasons["layout"]


def test_a_screen_that_runs_out_of_memory_says_what_it_needs_or_held(examples_dir, monkeypatch):
    from types import SimpleNamespace

    from autotune.memory.fake import EstimateMemoryBackend
    from autotune.orchestration import layout_search
    from autotune.orchestration.layout_search import _screen
    from autotune.probing.result import Trial
    from autotune.units import format_bytes

    # mlp: 31.6 MB of parameters and optimizer state, 54.7 MB at micro-batch 1024. With a 40 MB
    # budget the CPU count stops at the allocation that passes it: the step needs at least that.
    planner = SimpleNamespace(backend=EstimateMemoryBackend(40_000_000), options=SimpleNamespace(sharding="ddp"),
                              chosen="fp32", world_size=1, usable=40_000_000,
                              request=SimpleNamespace(share=1024))
    why = _screen(examples_dir / "mlp.py", planner, Layout(), False, micro_batch=1024)
    assert why.startswith("micro-batch 1024 runs out of memory (needs at least ")
    # A modelled CUDA allocator fails an allocation with less than the budget reserved (a 31 GiB
    # logits tensor failed at 49.56 GiB of 78.71): that is what was in use, no peak.
    failed = Trial(micro_batch=1024, fits=False, peak_bytes=30_000_000, reserved_peak_bytes=30_000_000,
                   seconds=0.0)
    monkeypatch.setattr(layout_search, "window_trial", lambda *args, **kwargs: failed)
    assert _screen(examples_dir / "mlp.py", planner, Layout(), True, micro_batch=1024) == (
        f"micro-batch 1024, every block checkpointed runs out of memory (with {format_bytes(30_000_000)} "
        f"in use)")
    # A tensor floor's trial (affine_blocks) counts the whole step's tensors, past the budget.
    failed.peak_bytes, failed.reserved_peak_bytes = 54_743_240, None
    assert _screen(examples_dir / "mlp.py", planner, Layout(), True, micro_batch=1024) == (
        f"micro-batch 1024, every block checkpointed runs out of memory (needs at least "
        f"{format_bytes(54_743_240)})")
    # Ruled out by its tensors alone past the limit the screen plans within (the budget less the
    # headroom), below the budget: what the tensors held, a lower bound.
    failed.peak_bytes, failed.past_limit = 35_000_000, 32_000_000
    assert _screen(examples_dir / "mlp.py", planner, Layout(), True, micro_batch=1024) == (
        f"at least {format_bytes(35_000_000)} at micro-batch 1024, every block checkpointed, past "
        f"the {format_bytes(40_000_000)} the headroom leaves")
    monkeypatch.undo()
    planner.backend, planner.usable = EstimateMemoryBackend(None), 50_000_000
    assert _screen(examples_dir / "mlp.py", planner, Layout(), False, micro_batch=1024) == (
        f"{format_bytes(54_743_240)} at micro-batch 1024, past the {format_bytes(50_000_000)} the headroom leaves")


def test_a_screen_runs_the_window_the_probe_runs_at_its_micro_batch(monkeypatch):
    # So that where it fits, the probe of a --gpu plan takes its answer (the planner's memo of
    # fresh trials) instead of running the same window again.
    from types import SimpleNamespace

    from autotune.orchestration import layout_search
    from autotune.probing.result import Trial

    asked = []
    monkeypatch.setattr(layout_search, "window_trial", lambda *a, **kw: asked.append(kw) or Trial(
        micro_batch=kw["micro_batch"], fits=True, peak_bytes=1, reserved_peak_bytes=1, seconds=0.0))
    planner = SimpleNamespace(backend=None, options=SimpleNamespace(sharding="auto"), chosen="bf16",
                              world_size=8, usable=10, request=SimpleNamespace(share=8))
    for layout, n in ((Layout(tp=2), 2), (Layout(tp=2), 8), (Layout(cp=2), 3), (Layout(pp=2), 1)):
        assert layout_search._screen(None, planner, layout, True, micro_batch=n) is None
    assert [(kw["micro_batch"], kw["window"]) for kw in asked] == [(2, 4), (8, 1), (3, 3), (1, 2)]
    assert all(kw["reduce_every_micro_step"] and kw["sharding"] == "fsdp" for kw in asked)
    assert all(kw["limit"] == planner.usable for kw in asked)  # what a plan of it may hold


def test_steps_to_win_counts_the_tie_only_where_the_tie_breaks_could_pick_the_layout():
    from autotune.planning.layouts import steps_to_win

    leader = LayoutOutcome(Layout(), steps=4, communication=100.0, label="FSDP 8")
    # Less communication at 4 steps: a tie would pick it, so 4 steps are enough.
    assert steps_to_win(Layout(tp=2), leader, lambda steps: 50.0) == (
        4, "more than 4 accumulation steps (those of FSDP 8)")
    # More communication, or any bubble against none: it needs 3.
    steps, why = steps_to_win(Layout(tp=2), leader, lambda steps: 150.0)
    assert steps == 3 and "its communication (150 B per rank and step against 100 B)" in why
    assert steps_to_win(Layout(pp=2), leader, lambda steps: 1.0)[0] == 3
    # Equal in both: the earlier candidate wins the tie.
    assert steps_to_win(Layout(tp=2), leader, lambda steps: 100.0)[0] == 3
    # Against a pipeline leader, a flat layout wins the tie on the bubble.
    piped = LayoutOutcome(Layout(pp=2), steps=4, communication=1.0, label="FSDP 4 × PP 2")
    assert steps_to_win(Layout(tp=2), piped, lambda steps: 500.0)[0] == 4


def test_cli_tp_auto_plans_data_parallel_when_it_takes_one_step(tmp_path, examples_dir):
    from click.testing import CliRunner

    from autotune.cli.main import cli
    from autotune.planning.planfile import load_plan

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(examples_dir / "tiny_lm.py"), "--world-size", "4",
                                      "--target-batch", "8", "--tp", "auto", "--pp", "auto",
                                      "--memory-limit", "256MiB", "--no-eval-batch", "-o", str(out)])
    assert result.exit_code == 0, result.output
    planned = load_plan(out)
    assert planned.parallel == Layout()
    reason = planned.reasons["layout"]
    assert reason.startswith("auto: DDP 4: 1 accumulation step, the fewest")
    # tiny_lm's 4 heads and 4 blocks on 4 ranks: tp 2, 4; pp 2, 4; tp 2 × pp 2; none estimated.
    for name in ("tp 2", "tp 4", "pp 2 (1f1b)", "pp 4 (1f1b)", "tp 2 × pp 2 (1f1b)"):
        assert name in reason
    assert "(not estimated: one accumulation step was reached" in reason
    assert "layout:       DDP 4 (auto: DDP 4" in result.output
    bad = CliRunner().invoke(cli, ["plan", str(examples_dir / "tiny_lm.py"), "--tp", "some"])
    assert bad.exit_code == 2 and "'some' is not a valid integer" in bad.output


def test_a_layouts_step_time_adds_exposed_tensor_parallel_collectives_and_the_bubble():
    from autotune.timing.comm import Link, Network, collective_time
    from autotune.timing.layout import with_layout
    from autotune.timing.window import WindowTime

    network = Network(intra=Link(100e9, 1e-5), inter=None, gpus_per_node=8)
    base = WindowTime(step_s=1.0, compute_s=0.9, exposed_comm_s=0.1, bubble_s=0.0, recompute_s=0.0,
                      samples_per_s=4.0, tokens_per_s=4.0 * 1024, mfu=0.5, comm_s=0.2)
    layout = Layout(tp=2, pp=2)
    timed = with_layout(base, layout, micro_batches=[2, 2], seq_len=1024, hidden=4096, blocks=8,
                        activation_bytes=2, network=network)
    # 8 collectives per block of the stage's 4 blocks, per micro-step of 2 × 1024 tokens
    one = collective_time("all_gather", 2 * 1024 * 4096 * 2, 2, network.intra)
    comm = 2 * 8 * 4 * one
    assert timed.exposed_comm_s == pytest.approx(0.1 + comm)
    busy = 1.0 + comm  # 1F1B over 2 stages and 2 micro-batches idles 1/3 of the step
    assert timed.step_s == pytest.approx(busy * 1.5) and timed.bubble_s == pytest.approx(busy * 0.5)
    # One data-parallel rank's 4 samples are computed by its 4 GPUs.
    assert timed.samples_per_s == pytest.approx(4 / timed.step_s / 4)
    assert timed.tokens_per_s == pytest.approx(4 * 1024 / timed.step_s / 4)
    # Without a sequence length (a plan without --seq-len), the window's tokens per GPU likewise.
    unsized = with_layout(base, layout, micro_batches=[2, 2], seq_len=None, hidden=4096, blocks=8,
                          activation_bytes=2, network=network)
    assert unsized.tokens_per_s == pytest.approx(4 * 1024 / unsized.step_s / 4)
    assert with_layout(base, Layout(), micro_batches=[2, 2], seq_len=1024, hidden=4096, blocks=8,
                       activation_bytes=2, network=network) == base


def test_a_fixed_layouts_predicted_step_time_is_per_gpu_with_its_collectives(examples_dir, one_thread, monkeypatch):
    from autotune import plan
    from autotune.orchestration.planner import inspect_workload
    from autotune.timing.comm import network_from_profile
    from autotune.workload.contract import load_workload
    from autotune.timing.layout import tensor_parallel_seconds
    from autotune.gpus.catalog import load_profile

    from autotune.orchestration import predicted
    from autotune.timing.window import tokens_per_sample

    sequences = []
    original = predicted.with_layout

    def spy(timed, layout, **kwargs):
        sequences.append(kwargs["seq_len"])
        return original(timed, layout, **kwargs)

    monkeypatch.setattr(predicted, "with_layout", spy)
    planned = plan(examples_dir / "tiny_lm.py", target_batch=8, world_size=2, tp=2, gpu="h100-80gb",
                   optimize="throughput", sharding="fsdp", eval_batch=False)
    timed, samples = planned.step_time, sum(planned.micro_batches)
    # One data-parallel rank's samples (and their tokens) are computed by its 2 tensor-parallel GPUs.
    assert timed.samples_per_s == pytest.approx(samples / timed.step_s / 2)
    workload = load_workload(examples_dir / "tiny_lm.py")
    tokens = tokens_per_sample(workload)
    assert workload.seq_len is None and tokens > 1
    assert timed.tokens_per_s == pytest.approx(timed.samples_per_s * tokens)
    # Planned without --seq-len, the tensor-parallel collectives move the batch's tokens.
    assert sequences and set(sequences) == {tokens}
    _, shape = inspect_workload(workload)
    network = network_from_profile(load_profile("h100-80gb"))
    tp_comm = sum(tensor_parallel_seconds(planned.parallel, tokens=n * tokens,
                                          hidden=shape.hidden, blocks=shape.blocks, activation_bytes=2,
                                          network=network)
                  for n in planned.micro_batches)
    assert tp_comm > 0 and timed.exposed_comm_s >= tp_comm


@pytest.mark.slow
@pytest.mark.skipif(not fake_pipeline_supported(), reason="this torch's pipeline schedules do not run on "
                                                          "fake tensors (torch 2.14's do)")
def test_a_pipelines_predicted_step_idles_its_schedules_bubble(examples_dir, one_thread):
    """--optimize throughput --gpu with --pp 2: the slowest stage's counted micro-steps, the
    schedule's bubble (1F1B over p = 2 stages and m micro-batches idles (p − 1)/(m + p − 1) of
    the step), per GPU. A pipeline was a ConfigError here before its steps were counted."""
    from autotune import plan

    planned = plan(examples_dir / "tiny_lm.py", target_batch=8, world_size=2, pp=2, gpu="h100-80gb",
                   optimize="throughput", sharding="fsdp", eval_batch=False)
    timed, m = planned.step_time, len(planned.micro_batches)
    assert planned.parallel.pp == 2 and m >= 2
    assert timed.bubble_s == pytest.approx(timed.step_s / (m + 1))
    assert timed.samples_per_s == pytest.approx(sum(planned.micro_batches) / timed.step_s / 2)
    assert timed.compute_s > 0 and planned.predicted and planned.predicted[0].parallel.pp == 2


def test_a_fixed_tp_that_does_not_divide_the_heads_is_refused_naming_them(examples_dir):
    from click.testing import CliRunner

    from autotune.cli.main import cli

    result = CliRunner().invoke(cli, ["plan", str(examples_dir / "tiny_lm.py"), "--world-size", "6",
                                      "--target-batch", "6", "--tp", "3", "--memory-limit", "256MiB"])
    assert result.exit_code == 2  # a usage error, as the CLI's other option errors
    assert "--tp 3 does not divide the model's 4 attention heads" in result.output
    assert "use one of 1, 2, 4" in result.output


def test_a_split_this_build_lacks_is_answered_once():
    calls = []

    def evaluate(layout):
        calls.append(layout)
        if layout.tp > 1:
            return LayoutOutcome(layout, error="not estimated: tp 2: not available", unavailable="tp")
        return LayoutOutcome(layout, steps=4 // layout.pp)

    outcomes = search_layouts([Layout(), Layout(tp=2), Layout(tp=4), Layout(tp=2, pp=2), Layout(pp=2)],
                              evaluate, cost=lambda lay: lay.tp)
    assert calls == [Layout(), Layout(pp=2), Layout(tp=2)]
    assert [o.error for o in outcomes if not o.estimated] == [
        "not estimated: tp > 1 is not available in this build (tp 2 showed it)"] * 2
    assert choose_layout(outcomes)[0].layout == Layout(pp=2)


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_degree_the_model_cannot_take_is_skipped_where_the_search_chose_it(wrapped):
    # A pipeline over weights tied between the embedding and the head (Hugging Face GPT-2): under
    # --pp auto the search answers every pipeline alike and plans the others; under --pp 2 the
    # model's error is the answer. A step's error (StepError) that wraps it counts alike.
    from types import SimpleNamespace

    from autotune.errors import LayoutUnsupported, StepError
    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    runs = []

    class Planner(_StubPlanner):
        def run(self):
            runs.append(self.options.parallel)
            if self.options.parallel.pp > 1:
                tied = LayoutUnsupported("gpt2.py: parameter wte.weight is read both before the first block "
                                         "and after the last (tied weights?)", degree="pp")
                if not wrapped:
                    raise tied
                raise StepError("gpt2.py: the training step failed at micro-batch 1") from tied
            return super().run()

    _StubPlanner.allowed = {Layout(): 2, Layout(tp=2): 4, Layout(tp=4): 8}

    def search(**degrees):
        runs.clear()
        return search_layout(SimpleNamespace(seq_len=None), PlanOptions(
            target_batch=64, world_size=8, sharding="fsdp", eval_batch=False, precision="bf16"),
            degrees, make_planner=Planner, screen=lambda *args, **kwargs: None,
            inspected=(SimpleNamespace(param_bytes=8 * 2**20, checkpointable=True),
                       ModelShape(heads=4, kv_heads=4, hidden=64, blocks=8)))

    planned = search(tp="auto", pp="auto")
    assert planned.parallel == Layout(tp=4)
    assert sum(1 for layout in runs if layout.pp > 1) == 1  # the first pipeline answers for all
    reason = planned.reasons["layout"]
    assert "(not estimated: gpt2.py: parameter wte.weight is read both before the first block" in reason
    assert "(not estimated: pp > 1 is not available for this model (pp 2 (1f1b) showed it))" in reason
    with pytest.raises(LayoutUnsupported if not wrapped else StepError, match="the first block|failed"):
        search(tp="auto", pp=2)


def test_a_layout_search_plans_hugging_face_gpt2_whose_tied_weights_no_pipeline_can_hold(examples_dir):
    # Before, --pp auto on GPT-2 (its embedding tied to its head) ended the whole plan with the
    # pipeline's error wherever data parallelism left accumulation steps to save. One setting
    # (bf16, every block checkpointed) keeps the search to the layouts.
    planned = plan(str(examples_dir / "real" / "gpt2.py"), world_size=4, target_batch=128,
                   gpu="h100-80gb", headroom=0.999, tp="auto", pp="auto", eval_batch=False,
                   precision="bf16", checkpointing="on")
    assert planned.parallel == Layout() and planned.accumulation_steps == 2
    reason = planned.reasons["layout"]
    assert "pp 2 (1f1b) (not estimated: " in reason and "(tied weights?)" in reason
    assert "pp > 1 is not available for this model (pp 2 (1f1b) showed it)" in reason


def test_a_measured_throughput_search_does_not_search_layouts():
    from types import SimpleNamespace

    from autotune.orchestration.layout_search import search_layout
    from autotune.orchestration.request import PlanOptions

    options = PlanOptions(target_batch=64, world_size=8, optimize="throughput")
    with pytest.raises(ConfigError, match="optimize=.throughput. measures replicas on this device.*"
                                          "tp='auto'.*add gpu \\(ranked"):
        search_layout(SimpleNamespace(seq_len=None), options, dict(tp="auto", cp=1, pp="auto"),
                      make_planner=_StubPlanner, inspected=(None, LLAMA_8B))


def test_the_reason_names_the_one_micro_batch_none_checkpointed_was_tried_at():
    from autotune.planning.policy import PlanRequest, build_plan
    from plan_helpers import device, fingerprint, linear_probe, setting

    request = PlanRequest(target_batch=8, world_size=1, checkpointing="auto", headroom=0.0)
    on = setting(linear_probe(4, checkpointing=True), checkpointing=True, headroom=0.0)
    off = setting(None, error="ran out of memory", headroom=0.0)

    def reason(only):
        off.only_micro_batch = only
        planned = build_plan(request, workload=fingerprint(repeated_blocks=4), settings=[off, on],
                             device=device(), created_at="2026-12-01T00:00:00+00:00")
        assert planned.micro_batches == [4, 4]
        return planned.reasons["checkpointing"]

    # Tried at checkpointing's micro-batch alone, it is no proof that micro-batch 1 does not fit.
    assert "without it micro-batch 4 within the budget minus the headroom (the one checkpointing " \
           "reaches; smaller ones take more accumulation steps and were not tried) does not fit" in reason(4)
    assert "without it even micro-batch 1 within the budget minus the headroom does not fit" in reason(None)


def test_the_out_of_order_estimate_never_takes_a_pipeline_deeper_than_jump_max_pp():
    """405B on 512 GPUs: after data parallel fit nowhere the most split candidate was cp 8 × pp 64,
    whose estimate (64 micro-batches on each pipeline rank) took 30-64 CPU s per rank. The jump
    takes the most split of those no deeper than JUMP_MAX_PP instead."""
    from autotune.planning.layouts import JUMP_MAX_PP

    deep = Layout(cp=8, pp=8 * JUMP_MAX_PP)
    candidates = [Layout(), Layout(tp=2), Layout(cp=8, pp=JUMP_MAX_PP), deep]
    calls = []

    def evaluate(layout):
        calls.append(layout)
        return LayoutOutcome(layout, error="does not fit", fits_nowhere=True)

    search_layouts(candidates, evaluate, cost=lambda lay: lay.model_parallel, max_screened=1)
    assert calls[:2] == [Layout(), Layout(cp=8, pp=JUMP_MAX_PP)]
    # The deep pipeline still gets its answer, dominated by nothing that was estimated.
    assert calls[2:] == [Layout(tp=2), deep]


def test_ranked_by_throughput_the_out_of_order_layout_is_only_screened_and_planned_in_its_place():
    """70B on 256 GPUs ranked by throughput: after pp 2 fitted nowhere the search jumped to the most
    split candidate, FSDP 4 × CP 8 × PP 8, and planned it whole (windows of 32 to 128 micro-batches
    on 8 pipeline ranks, past 30 CPU minutes); screening it alone took 274 CPU s. Ranked by
    throughput, once a layout has fitted the search does not jump (patience ends it sooner), and
    where nothing has fitted yet the jump runs its screen only: where it fits it is planned in its
    place among the candidates."""
    candidates = [Layout(), Layout(pp=2), Layout(tp=2), Layout(tp=4), Layout(tp=8, pp=8)]
    calls = []
    fits_nowhere = {Layout(pp=2)}

    def evaluate(layout, screen_only=False):
        calls.append((layout.describe_degrees() if not layout.trivial else "dp", screen_only))
        if layout in fits_nowhere:
            return LayoutOutcome(layout, error="does not fit", fits_nowhere=True)
        if screen_only:
            return LayoutOutcome(layout, screened=True, error="fits at micro-batch 1 (screened)")
        speed = {Layout(): 1.0, Layout(tp=2): 0.9, Layout(tp=4): 0.8, Layout(tp=8, pp=8): 0.5}[layout]
        return LayoutOutcome(layout, steps=2, samples_per_s=speed)

    outcomes = search_layouts(candidates, evaluate, cost=lambda lay: lay.model_parallel,
                              rank_by_time=True, patience=2)
    assert calls == [("dp", False), ("pp 2 (1f1b)", False), ("tp 2", False), ("tp 4", False)]
    deep = next(o for o in outcomes if o.layout == Layout(tp=8, pp=8))
    assert not deep.estimated and "2 layout(s) in a row" in deep.error
    assert choose_layout(outcomes, rank_by_time=True)[0].layout == Layout()
    # Nothing fitted yet, and more candidates than the screening cap leaves: the jump screens only.
    calls.clear()
    fits_nowhere = {Layout(), Layout(pp=2)}
    outcomes = search_layouts(candidates, evaluate, cost=lambda lay: lay.model_parallel,
                              rank_by_time=True, patience=2, max_screened=2)
    assert calls == [("dp", False), ("tp 8 × pp 8 (1f1b)", True), ("pp 2 (1f1b)", False),
                     ("tp 2", False), ("tp 4", False), ("tp 8 × pp 8 (1f1b)", False)]  # in its place
    assert [o.layout for o in outcomes] == candidates  # each answered once, in the candidates' order
    assert choose_layout(outcomes, rank_by_time=True)[0].layout == Layout(tp=2)
    # A jump that fits nowhere still rules out what it dominates, ranked by throughput too.
    calls.clear()

    def nowhere(layout, screen_only=False):
        calls.append((layout, screen_only))
        if layout in (Layout(), Layout(tp=8, pp=8)):
            return LayoutOutcome(layout, error="does not fit", fits_nowhere=True, screened=screen_only)
        return LayoutOutcome(layout, steps=2, samples_per_s=1.0)

    outcomes = search_layouts([Layout(), Layout(pp=2), Layout(tp=2), Layout(tp=2, pp=8), Layout(tp=8, pp=8)],
                              nowhere, cost=lambda lay: lay.model_parallel, rank_by_time=True, patience=5,
                              max_screened=2)
    assert calls[:2] == [(Layout(), False), (Layout(tp=8, pp=8), True)]
    assert all(c[0] != Layout(tp=2, pp=8) for c in calls)
    assert next(o for o in outcomes if o.layout == Layout(tp=2, pp=8)).fits_nowhere
