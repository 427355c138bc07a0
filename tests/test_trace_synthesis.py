"""CUDA estimates (modelled caching allocator) from small builds' allocator traces, synthesized for
the whole model and replayed (autotune/probing/trace_synthesis.py, ``SynthesizedTrialsSession``):
the same reserved and tensor peaks as the full build, to the byte."""

import dataclasses
import pathlib

import pytest

from autotune.distributed.context_parallel import cpu_ring_available
from autotune.distributed.layout import parse_layout
from autotune.memory.cuda_allocator import CachingAllocatorModel
from autotune.probing import affine_blocks
from autotune.memory.fake import EstimateMemoryBackend
from autotune.probing.affine_blocks import full_builds, synthesized_traces
from autotune.probing.trace_synthesis import Synthesis, normalize, replay_peak, replay_trial

MODEL = pathlib.Path(__file__).with_name("trace_decoder.py")

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 1 << 20


def test_a_normalized_trace_replays_as_the_allocator_ran_it():
    # FSDP2 frees and refills its gathered parameters by resizing a storage: a new block, then the
    # old one freed (nothing to free after a resize to 0; nothing to allocate at 0 bytes).
    model = CachingAllocatorModel(record=True)
    model.malloc("a", 30 * MiB)
    model.malloc("b", 3 * MiB)
    model.resize("a", 0)
    model.malloc("c", 12 * MiB)
    model.resize("a", 30 * MiB)
    model.free("b")
    model.resize("c", 40 * MiB)
    events = [("mark", "trial"), *model.events]
    trace = normalize(events)
    assert [e[0] for e in trace] == ["mark", "m", "m", "f", "m", "m", "f", "m", "f"]
    assert replay_peak(trace) == model.peak_reserved


def _block_trace(blocks, size):
    """A toy step: each block's forward keeps an activation, its backward frees it (LIFO)."""
    events, live = [("malloc", "weights", 64 * MiB)], []
    events.append(("mark", "trial"))
    events.append(("mark", "S"))
    for b in range(blocks):
        events += [("mark", "F", b), ("malloc", ("act", b), size), ("malloc", ("tmp", b), 3 * MiB),
                   ("free", ("tmp", b))]
    events.append(("mark", "H"))
    for b in reversed(range(blocks)):
        events += [("mark", "B", b), ("malloc", ("grad", b), size // 2), ("free", ("act", b))]
    events.append(("mark", "T"))
    events.append(("mark", "O"))
    events += [("free", ("grad", b)) for b in range(blocks)]
    events.append(("mark", "Oend"))
    return normalize(events)


def test_a_toy_step_synthesizes_to_its_full_trace():
    synthesis = Synthesis(tuple(_block_trace(n, 22 * MiB) for n in (4, 5, 6)), 4)
    full = _block_trace(40, 22 * MiB)
    assert synthesis.trace(40) == full
    assert replay_peak(synthesis.trace(40)) == replay_peak(full)


def test_a_free_of_the_block_before_synthesizes_at_any_depth():
    # A checkpointed block's input is the previous block's output, freed in this block's backward:
    # between them lie as many blocks of the same size as there are blocks after it, so no rank
    # among the live blocks of its size names it at every depth; the block it came from does.
    def trace(blocks):
        events = [("malloc", "weights", 64 * MiB), ("mark", "trial"), ("mark", "S")]
        for b in range(blocks):
            events += [("mark", "F", b), ("malloc", ("out", b), 8 * MiB)]
        events.append(("mark", "H"))
        for b in reversed(range(blocks)):
            events += [("mark", "B", b), ("malloc", ("grad", b), 8 * MiB)]
            if b:
                events.append(("free", ("out", b - 1)))
            events.append(("free", ("grad", b)))
        events += [("free", ("out", blocks - 1)), ("mark", "T"), ("mark", "O"), ("mark", "Oend")]
        return normalize(events)

    synthesis = Synthesis(tuple(trace(n) for n in (4, 5, 6)), 4)
    assert synthesis.trace(30) == trace(30)


def test_the_replay_lifts_the_budget_where_the_session_set_up_without_it():
    # A sharded session builds the whole model before sharding it, outside the budget (and
    # releases the cache it leaves).
    trace = normalize([("mark", "unbudgeted"), ("malloc", "full model", 900 * MiB), ("free", "full model"),
                       ("empty_cache",), ("mark", "budgeted"), ("mark", "trial"), ("malloc", "shard", 90 * MiB),
                       ("mark", "O"), ("mark", "Oend")])
    assert replay_trial(trace, limit=100 * MiB).fits
    assert not replay_trial(trace, limit=80 * MiB).fits
    assert not replay_trial([e for e in trace if e[1:] not in (("unbudgeted",), ("budgeted",))],
                            limit=100 * MiB).fits


def _estimate(micro_batches, settings, budget=None):
    """{micro-batch: the trial's peaks} of a CUDA estimate (H100, allocator modelled)."""
    from autotune.probing.api import window_trial

    settings = dict(settings)
    window = settings.pop("window", 1)
    out = {}
    for n in micro_batches:
        trial = window_trial(MODEL, EstimateMemoryBackend(budget, for_cuda=True,
                                                          target=_h100(budget)),
                             micro_batch=n, window=window, precision="bf16", **settings)
        out[n] = None if trial is None else (trial.fits, trial.peak_bytes, trial.reserved_peak_bytes,
                                             trial.allocated_peak_bytes, trial.activation_peak_bytes,
                                             trial.step_peak_bytes)
    return out


def _h100(budget):
    from autotune.memory.base import DeviceInfo

    return DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", budget_bytes=budget or 0)


def both(micro_batches, budget=None, **settings):
    """The estimate from synthesized small-build traces (failing where it would fall back to the
    full build) and from the full build, and the largest small build each trial ran."""
    ran = []
    original = affine_blocks.FewBlocksSession.run

    def run(self, n, **kwargs):
        trial = original(self, n, **kwargs)
        ran.append(max(self._sizes()))
        return trial

    def full_build(self, *args):
        raise AssertionError(f"a full build where the traces should synthesize: {self.unsynthesizable}")

    affine_blocks.FewBlocksSession.run = run
    affine_blocks.SynthesizedTrialsSession._full_session = full_build
    try:
        with synthesized_traces(max_share=None):
            few = _estimate(micro_batches, settings, budget)
    finally:
        affine_blocks.FewBlocksSession.run = original
        del affine_blocks.SynthesizedTrialsSession._full_session
    with full_builds():
        full = _estimate(micro_batches, settings, budget)
    return few, full, ran


FSDP8 = dict(sharding="fsdp", world_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(checkpointing="on", **FSDP8),
    dict(checkpointing="off", **FSDP8),
    dict(checkpointing="on", sharding="fsdp", world_size=8, shard_group=4),
    dict(checkpointing="on", **FSDP8, parallel=parse_layout(tp=2)),
    pytest.param(dict(checkpointing="on", **FSDP8, parallel=parse_layout(cp=2)), marks=pytest.mark.skipif(
        not cpu_ring_available(), reason="context parallelism on CPU tensors needs torch 2.14's hooks")),
    dict(checkpointing="on", **FSDP8, window=3),
    dict(checkpointing="off", **FSDP8, window=2, reduce_every_micro_step=True),
], ids=["fsdp8-on", "fsdp8-off", "hsdp-4x2-on", "fsdp4-tp2-on", "fsdp4-cp2-on", "fsdp8-window3",
        "fsdp8-window2-reduce-every"])
def test_synthesized_reserved_peaks_are_the_full_builds_to_the_byte(settings):
    few, full, ran = both([1, 2], **settings)
    assert ran and max(ran) == 6  # small builds of 4, 5 and 6 blocks, not the 12
    assert few == full  # {micro-batch: (fits, peak, reserved, tensors, activation, step)}


@pytest.mark.slow
@pytest.mark.parametrize("budget_mib", [700, 1200, 2000])
def test_under_a_budget_the_synthesized_trials_fit_where_the_full_builds_fit(budget_mib):
    # The sharded set-up holds the whole model before sharding it, past the budget: only the
    # measured steps are held to it, in the replay as in the full build. A trial whose tensors
    # alone pass the budget stops at the first two builds (the tensor floor, whose bytes it
    # reports); the others replay to the full build's answer, to the byte.
    few, full, ran = both([1, 4, 16], budget=budget_mib * MiB, checkpointing="on", **FSDP8)
    assert ran
    assert {n: found[0] for n, found in few.items()} == {n: found[0] for n, found in full.items()}
    for n, found in few.items():
        if found[2] is not None:  # replayed: reserved bytes
            assert found == full[n]
        else:  # the floor: the tensors' peak, past the budget and above what the full build held
            assert found[1] > budget_mib * MiB and found[1] >= full[n][3]
    if budget_mib == 700:
        assert all(found[2] is None for found in few.values())
    if budget_mib == 2000:  # 1 and 4 fit, replayed from three builds
        assert few[1][0] and few[4][0] and max(ran) == 6


@pytest.mark.slow
def test_offloaded_shards_synthesize_under_a_budget():
    few, full, ran = both([1, 2], budget=1200 * MiB, checkpointing="on", sharding="fsdp-offload",
                          world_size=8)
    assert ran and max(ran) == 6
    assert few == full


@pytest.mark.slow
def test_traces_that_do_not_extend_fall_back_to_the_full_build(monkeypatch):
    # One GPU, no sharding: the small builds free the cut blocks' parameters where the model is
    # built, in a chunk the synthesis cannot repeat, so the trial runs on the full build (and says
    # why), with the full build's answer.
    reasons = []
    original = affine_blocks.SynthesizedTrialsSession._fresh_trial

    def fresh(self, *args):
        trial = original(self, *args)
        reasons.append(self.unsynthesizable)
        return trial

    monkeypatch.setattr(affine_blocks.SynthesizedTrialsSession, "_fresh_trial", fresh)
    settings = dict(checkpointing="on", sharding="ddp", world_size=1)
    with synthesized_traces(max_share=None):
        few = _estimate([1, 2], settings)
    with full_builds():
        full = _estimate([1, 2], settings)
    assert few == full
    assert len(reasons) == 2 and all(reasons)


@pytest.mark.slow
def test_every_other_block_checkpointed_synthesizes_from_units_of_two(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRACE_SHAPE", "16,1024,2816,8,4,32000")
    few, full, ran = both([2], checkpointing=8, **FSDP8)
    assert ran and max(ran) == 12  # 4, 5 and 6 units of two blocks
    assert few == full


def test_a_model_whose_small_builds_cost_about_as_much_runs_the_full_build(monkeypatch):
    # Twelve blocks: small builds of 4, 5 and 6 hold more blocks than the model, past
    # SYNTHESIS_MAX_SHARE, so each trial runs on a full build of its own.
    made = []
    monkeypatch.setattr(affine_blocks.FewBlocksSession, "run",
                        lambda self, *a, **k: pytest.fail("synthesized"))
    original = affine_blocks.SynthesizedTrialsSession._fresh_trial

    def fresh(self, *args):
        made.append(self.unsynthesizable)
        return original(self, *args)

    monkeypatch.setattr(affine_blocks.SynthesizedTrialsSession, "_fresh_trial", fresh)
    assert _estimate([1], dict(checkpointing="on", **FSDP8))[1][0]
    assert made and "do not repeat in three small builds that cost less" in made[0]


@pytest.fixture
def built(monkeypatch):
    """The sizes of the traced small builds set up, in order."""
    sizes = []
    original = affine_blocks.FewBlocksSession._child

    def child(self, size):
        if self._traced and size not in self._children:
            sizes.append(size)
        return original(self, size)

    monkeypatch.setattr(affine_blocks.FewBlocksSession, "_child", child)
    return sizes


@pytest.mark.slow
def test_a_trial_the_tensors_rule_out_sets_up_no_third_build(built):
    # Under a budget, the first two traced builds' tensors, extended (the tensor floor), rule a
    # trial out before the third is set up: 16 samples without checkpointing hold 4.2 GiB of
    # tensors, past 3000 MiB; with it 2.0 GiB, and 2.5 GiB reserved.
    with synthesized_traces(max_share=None):
        off = _estimate([16], dict(checkpointing="off", **FSDP8), budget=3000 * MiB)
        assert off[16][0] is False and sorted(built) == [4, 5]
        assert off[16][1] > 4 << 30  # the tensors' floor, as the message's "in use" says
        built.clear()
        on = _estimate([16], dict(checkpointing="on", **FSDP8), budget=3000 * MiB)
    assert on[16][0] is True and sorted(built) == [4, 5, 6]
    with full_builds():
        assert _estimate([16], dict(checkpointing="on", **FSDP8), budget=3000 * MiB) == on


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(checkpointing="on", **FSDP8), dict(checkpointing="off", **FSDP8, window=2),
    dict(checkpointing="on", **FSDP8, parallel=parse_layout(tp=2)),
    dict(checkpointing="on", sharding="fsdp-offload", world_size=8),
], ids=["fsdp8-on", "fsdp8-off-window2", "fsdp4-tp2-on", "offload8-on"])
def test_the_floor_from_two_traced_builds_is_the_tensor_floors(monkeypatch, settings):
    # Where it rules a trial out, the peak it reports is what a TensorFloorSession's own small
    # builds count (tensors only, segment by segment): 500 MiB holds the state (shards, optimizer)
    # but rules out every trial by its tensors alone (offloaded, the trials fit: then both are
    # the full build's answer).
    with synthesized_traces(max_share=None):
        traced = _estimate([1, 2], settings, budget=500 * MiB)
    monkeypatch.setattr(affine_blocks, "FLOOR_MIN_BLOCKS", 0)
    with synthesized_traces(False):
        floored = _estimate([1, 2], settings, budget=500 * MiB)
    assert traced == floored
    if settings["sharding"] == "fsdp":  # offloaded shards leave room: synthesized and full builds
        assert all(found[0] is False and found[1] > 500 * MiB for found in traced.values())


@pytest.mark.slow
def test_a_gpu_plan_from_synthesized_traces_is_the_full_builds_plan(monkeypatch):
    # The planner's probe, its window trials and the plan's own trial, all synthesized: the same
    # split and per-rank peak (modelled reserved memory) as on full builds.
    import autotune

    traced = []
    original = affine_blocks.FewBlocksSession.run

    def run(self, n, **kwargs):
        traced.append(self._traced)
        return original(self, n, **kwargs)

    def full_build(self, *args):
        raise AssertionError(f"a full build where the traces should synthesize: {self.unsynthesizable}")

    monkeypatch.setattr(affine_blocks.FewBlocksSession, "run", run)
    settings = dict(target_batch=16384, world_size=8, gpu="h100-80gb", precision="bf16",
                    sharding="fsdp", checkpointing="on")
    with synthesized_traces(max_share=None), monkeypatch.context() as patched:
        patched.setattr(affine_blocks.SynthesizedTrialsSession, "_full_session", full_build)
        few = autotune.plan(MODEL, **settings)
    assert traced.count(True) >= 3  # the probe's trials and the plan's own
    with full_builds():
        full = autotune.plan(MODEL, **settings)
    assert (few.micro_batch, few.accumulation_steps, few.predicted_peak_bytes) == (
        full.micro_batch, full.accumulation_steps, full.predicted_peak_bytes)
    assert few.predicted_peak_bytes > 60 << 30  # the budget's edge: the probe searched up to it


def test_small_builds_synthesize_up_to_half_the_models_blocks():
    # 8B's 32 blocks, every one checkpointed: builds of 4, 5 and 6 (15, under half) synthesize;
    # 16 of them checkpointed in units of two take builds of 8, 10 and 12 (30) and twelve blocks
    # take 15: the full build runs those.
    from types import SimpleNamespace

    def synthesizable(total, checkpointing):
        session = affine_blocks.FewBlocksSession(
            SimpleNamespace(source="model.py"), SimpleNamespace(allocator=object()), session_type=None,
            total_blocks=total, layout={}, precision=None, checkpointing=checkpointing, sharded=True,
            offload=False, reduce_every_micro_step=False, traced=True)
        session.set_checkpointing(checkpointing)
        return session.synthesizable

    assert synthesizable(32, "on")
    assert not synthesizable(32, 16)
    assert not synthesizable(12, "on")
    assert synthesizable(80, "on") and synthesizable(126, "on")  # 70B, 405B


@pytest.mark.slow
def test_a_trial_past_the_planners_limit_stops_at_its_tensor_floor(built):
    # Micro-batch 16, every block checkpointed, FSDP 8 under 3000 MiB: about 2.0 GiB of tensors
    # and 2.5 GiB reserved, so it fits the budget. Where the caller plans within a limit below
    # its tensors (a budget less the headroom), the first two builds' floor rules it out: no
    # third build, the floor as its peak, marked past that limit. A limit between the tensors
    # and the reserved peak rules nothing out (only the replay knows the reserved bytes).
    from autotune.probing.api import window_trial


    def trial(limit, backend=None):
        built.clear()
        backend = backend or EstimateMemoryBackend(3000 * MiB, for_cuda=True, target=_h100(3000 * MiB))
        return window_trial(MODEL, backend, micro_batch=16, window=1, precision="bf16",
                            checkpointing="on", limit=limit, **FSDP8)

    with synthesized_traces(max_share=None):
        whole = trial(None)
        assert whole.fits and whole.past_limit is None and sorted(built) == [4, 5, 6]
        tensors, reserved = whole.allocated_peak_bytes, whole.peak_bytes
        assert tensors < reserved <= 3000 * MiB
        below = trial(tensors - MiB)
        assert sorted(built) == [4, 5]
        assert not below.fits and below.past_limit == tensors - MiB
        assert tensors - MiB < below.peak_bytes <= tensors  # the floor, less the cuBLAS workspaces
        between = trial((tensors + reserved) // 2)
        assert sorted(built) == [4, 5, 6] and between == dataclasses.replace(whole, seconds=between.seconds)

        # A planner's memo answers a trial ruled out past a limit only within that limit or less.
        planner = EstimateMemoryBackend(3000 * MiB, for_cuda=True, target=_h100(3000 * MiB))
        planner.trials_memo = {}
        ruled_out = trial(tensors - MiB, planner)
        assert (ruled_out.fits, ruled_out.peak_bytes, ruled_out.past_limit) == (False, below.peak_bytes, tensors - MiB)
        assert trial(tensors - 2 * MiB, planner).past_limit == tensors - MiB and built == []
        assert trial(None, planner).fits and sorted(built) == [4, 5, 6]
        assert trial(tensors - MiB, planner).fits and built == []  # the whole answer, remembered



@pytest.mark.slow
def test_a_tensor_floor_without_synthesis_stops_a_trial_past_the_limit_too(monkeypatch):
    # The floor of a TensorFloorSession (settings that do not synthesize: here synthesis is off)
    # rules a trial out past the caller's limit as the synthesized floor does: no full build.
    from autotune.probing.api import window_trial

    full = []
    original = affine_blocks.TensorFloorSession._fresh_trial

    def fresh(self, *args):
        full.append(args[0])
        return original(self, *args)

    monkeypatch.setattr(affine_blocks.TensorFloorSession, "_fresh_trial", fresh)
    monkeypatch.setattr(affine_blocks, "FLOOR_MIN_BLOCKS", 0)

    def trial(limit, backend=None):
        full.clear()
        backend = backend or EstimateMemoryBackend(3000 * MiB, for_cuda=True, target=_h100(3000 * MiB))
        return window_trial(MODEL, backend, micro_batch=16, window=1, precision="bf16",
                            checkpointing="on", limit=limit, **FSDP8)

    with synthesized_traces(False):
        whole = trial(None)
        assert whole.fits and whole.past_limit is None and full == [16]
        tensors = whole.allocated_peak_bytes
        below = trial(tensors - MiB)
        assert full == [] and not below.fits and below.past_limit == tensors - MiB
        assert tensors - MiB < below.peak_bytes <= tensors  # the small builds' tensors, extended
        assert trial(whole.peak_bytes).fits and full == [16]  # within the limit: the full build answers
        # A planner's memo: the floor remembered answers within the limit it was ruled out past.
        planner = EstimateMemoryBackend(3000 * MiB, for_cuda=True, target=_h100(3000 * MiB))
        planner.trials_memo = {}
        assert trial(tensors - MiB, planner).past_limit == tensors - MiB and full == []
        assert trial(None, planner).fits and full == [16]


@pytest.mark.slow
def test_the_probe_plans_within_its_limit_above_micro_batch_1(built):
    # A planner's probe passes its limit (the budget less the headroom): a trial above
    # micro-batch 1 whose tensors pass it stops at the floor, as good as out of memory to the
    # search, whose answer is then the largest within the limit; at micro-batch 1 the trial runs
    # to its answer, so that a model that fits nowhere is told by what it needs.
    from autotune.probing.api import probe

    def probed(limit, checkpointing="on"):
        built.clear()
        backend = EstimateMemoryBackend(3000 * MiB, for_cuda=True, target=_h100(3000 * MiB))
        with synthesized_traces(max_share=None):
            return probe(MODEL, backend=backend, precision="bf16", checkpointing=checkpointing,
                         max_micro_batch=16, share=16, limit=limit, explain=False, **FSDP8)

    free = probed(None)
    assert free.max_micro_batch == 16 and free.trials[0].fits  # one step of the whole share
    tensors = free.trials[0].allocated_peak_bytes
    held = probed(tensors - MiB)
    first = held.trials[0]
    assert (first.micro_batch, first.fits, first.past_limit) == (16, False, tensors - MiB)
    assert all(t.fits and t.peak_bytes <= tensors - MiB for t in held.trials if t.micro_batch == held.max_micro_batch)
    assert all(t.past_limit is None for t in held.trials if t.micro_batch == 1)
    assert 1 <= held.max_micro_batch < 16
