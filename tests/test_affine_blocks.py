"""Estimates of a model with identical repeated blocks from small builds, extended to all blocks:
the same bytes as the full fake build (autotune/probing/affine_blocks.py)."""

import pathlib
import re

import pytest

from autotune.memory.fake import EstimateMemoryBackend
from autotune.probing import affine_blocks
from autotune.probing.affine_blocks import (BlockPattern, block_pattern, full_builds,
                                            identical_block_count)
from autotune.probing.api import window_trial
from autotune.probing.estimate import estimate_peaks
from autotune.workload.contract import load_workload

MODEL = pathlib.Path(__file__).with_name("twelve_block_lm.py")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def small_builds(monkeypatch):
    """The largest model each trial of a FewBlocksSession ran (a full build of 12 blocks means
    no extension happened, and an equality with the full build would prove nothing)."""
    ran = []
    original = affine_blocks.FewBlocksSession.run

    def run(self, n, **kwargs):
        ran.append(max(self._sizes()))
        return original(self, n, **kwargs)

    monkeypatch.setattr(affine_blocks.FewBlocksSession, "run", run)
    return ran


def both(micro_batches, **settings):
    few = estimate_peaks(MODEL, micro_batches, **settings)
    with full_builds():
        full = estimate_peaks(MODEL, micro_batches, **settings)
    return few, full


@pytest.mark.parametrize("checkpointing, blocks", [
    ("off", 5), pytest.param("on", 5, marks=pytest.mark.slow), (6, 10),
    pytest.param(1, 6, marks=pytest.mark.slow)])
def test_a_replica_from_few_blocks_is_the_full_build_to_the_byte(small_builds, checkpointing, blocks):
    # off and on repeat one block (builds of 4 and 5), 6 of 12 one checkpointed and one plain
    # block (8 and 10), 1 of 12 a checkpointed first block before plain ones (5 and 6).
    few, full = both([1, 3], checkpointing=checkpointing)
    assert few == full
    assert small_builds and max(small_builds) == blocks


@pytest.mark.slow
def test_fsdp_with_k_of_n_checkpointing_from_few_blocks_is_the_full_build(small_builds):
    few, full = both([2], sharding="fsdp", world_size=4, checkpointing=6, precision="bf16")
    assert few == full
    assert max(small_builds) == 10


@pytest.mark.slow
def test_cuda_estimates_run_the_whole_model(small_builds):
    # --gpu plans model torch's caching allocator, whose reserved memory does not extend from
    # small builds as tensor bytes do (docs/reserved-memory.md); their traces do, but three small
    # builds of 4, 5 and 6 blocks cost more than these twelve (SYNTHESIS_MAX_SHARE): the whole
    # model runs, its foreach AdamW step (one transient the size of every parameter) included.
    def trial():
        return window_trial(MODEL, EstimateMemoryBackend(None, for_cuda=True), micro_batch=2,
                            window=3, precision="fp32", checkpointing="on", sharding="fsdp",
                            world_size=2)

    few = trial()
    with full_builds():
        full = trial()
    fields = ("peak_bytes", "activation_peak_bytes", "step_peak_bytes", "baseline_bytes",
              "gradient_bytes", "held_gradient_bytes", "reserved_peak_bytes", "allocated_peak_bytes")
    assert [getattr(few, f) for f in fields] == [getattr(full, f) for f in fields]
    assert not small_builds



@pytest.fixture
def full_builds_made(monkeypatch):
    """The full builds the TensorFloorSessions of a test made, one per trial that passed the
    floor (the floor taken by this twelve-block model too, which is below FLOOR_MIN_BLOCKS)."""
    monkeypatch.setattr(affine_blocks, "FLOOR_MIN_BLOCKS", 0)
    made = []
    original = affine_blocks.TensorFloorSession._full_session

    def full_session(self):
        if self._full is None:
            made.append(self)
        return original(self)

    monkeypatch.setattr(affine_blocks.TensorFloorSession, "_full_session", full_session)
    return made


def _cuda_probe(budget, checkpointing, explain=False):
    from autotune.probing.api import probe

    try:
        result = probe(str(MODEL), backend=EstimateMemoryBackend(budget, for_cuda=True),
                       sharding="fsdp", world_size=4, precision="bf16", checkpointing=checkpointing,
                       max_micro_batch=64, explain=explain)
    except Exception as exc:  # noqa: BLE001 - compared with the full build's, type and message
        return type(exc), str(exc)
    return result.max_micro_batch, [(t.micro_batch, t.fits, t.peak_bytes if t.fits else None)
                                    for t in result.trials]


def test_a_cuda_probe_rules_out_what_the_small_builds_tensors_pass_without_the_full_build(
        small_builds, full_builds_made):
    # 8 MiB: the tensors of one step at micro-batch 1 alone pass it (reserved memory holds every
    # tensor), so the probe answers from the small builds (4 and 5 of 12 blocks) and never makes
    # the full build (whose own answer is the same: the slow test below); how far over it is
    # comes from the small builds too, as a lower bound.
    error, message = _cuda_probe(8 << 20, "off", explain=True)
    assert small_builds and max(small_builds) == 5
    assert not full_builds_made
    assert re.search(r"micro-batch 1 needs [0-9.]+ MiB of tensors alone \(reserved memory holds "
                     r"more\), [0-9.]+x the 8.00 MiB budget", message), message


def test_a_model_of_few_blocks_takes_no_tensor_floor(monkeypatch):
    # Twelve blocks: the floor's builds of 4 and 5 would cost 75% of the full build's steps on
    # top of it wherever the setting fits (FLOOR_MIN_BLOCKS), so the full build runs alone.
    floors = []
    monkeypatch.setattr(affine_blocks.TensorFloorSession, "run",
                        lambda self, *a, **k: floors.append(1) or pytest.fail("floored"))
    assert affine_blocks.FLOOR_MIN_BLOCKS > 12
    trial = window_trial(MODEL, EstimateMemoryBackend(8 << 20, for_cuda=True), micro_batch=1,
                         window=1, precision="bf16", checkpointing="off", sharding="fsdp",
                         world_size=4)
    assert trial is not None and not trial.fits and not floors


@pytest.mark.parametrize("budget", [8 << 20, pytest.param(64 << 20, marks=pytest.mark.slow)])  # 64 MiB: 14 s
def test_a_tensor_floor_asked_again_is_answered_from_the_memo(small_builds, full_builds_made, budget):
    # A layout search plans its chosen layout again (its deferred shard groups): the --gpu
    # planner's memo answers the floor's trials as it answers the full build's, no build made.
    backend = EstimateMemoryBackend(budget, for_cuda=True)
    backend.trials_memo = {}

    def trial():
        return window_trial(MODEL, backend, micro_batch=1, window=2, precision="bf16",
                            checkpointing="off", sharding="fsdp", world_size=4)

    first = trial()
    ran, made = len(small_builds), len(full_builds_made)
    assert ran and first.fits == (budget > 8 << 20) and made == (budget > 8 << 20)
    again = trial()
    assert (len(small_builds), len(full_builds_made)) == (ran, made)
    assert (again.fits, again.peak_bytes) == (first.fits, first.peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("budget, checkpointing", [(8 << 20, "off"), (24 << 20, "on"), (64 << 20, "off"),
                                                   (64 << 20, "on")])
def test_a_cuda_probe_with_the_tensor_floor_answers_what_the_full_build_answers(
        full_builds_made, budget, checkpointing):
    # 8 MiB: the floor rules micro-batch 1 out (the test above); 24 MiB: the tensors fit,
    # reserved memory (the cuBLAS workspaces' 22 MiB with them) does not; 64 MiB: both fit up to
    # a micro-batch, which the full build's trials find, each of the same peak as without the floor.
    few = _cuda_probe(budget, checkpointing)
    assert bool(full_builds_made) == (budget > 8 << 20)
    with full_builds():
        full = _cuda_probe(budget, checkpointing)
    if budget > 8 << 20:
        assert few == full
        return
    # The same error, but for the bytes in use when it ran out: the floor's are the tensors',
    # the full build's the allocator's reserved memory, cuBLAS workspaces included.
    def without_bytes_in_use(message):
        before, after = message.split(" in use ")
        return before.rsplit(" with ", 1)[0], after

    assert few[0] is full[0]
    assert without_bytes_in_use(few[1]) == without_bytes_in_use(full[1])


def test_blocks_that_differ_are_estimated_on_the_full_build(monkeypatch, small_builds):
    monkeypatch.setenv("AUTOTUNE_BLOCKS_DIFFER", "1")
    assert identical_block_count(load_workload(MODEL)) is None
    monkeypatch.delenv("AUTOTUNE_BLOCKS_DIFFER")
    assert identical_block_count(load_workload(MODEL)) == 12


OWN_LIST = """
import runpy
import torch

_M = runpy.run_path({model!r})
make_batch, loss_fn = _M["make_batch"], _M["loss_fn"]


class OwnList(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _M["build_model"]()
        self.__dict__["all_blocks"] = list(self.inner.blocks)

    def forward(self, tokens):
        x = self.inner.embed(tokens) + self.inner.pos[: tokens.shape[1]]
        for block in self.__dict__["all_blocks"]:
            x = block(x)
        return self.inner.head(self.inner.ln(x))


def build_model():
    return OwnList()
"""


@pytest.mark.parametrize("settings", [
    dict(checkpointing="on"),
    # Sharded, the set-up's warm-up step runs the model: a dropped block, cut before its tensors
    # were made (left on the meta device), runs there first.
    pytest.param(dict(sharding="fsdp", world_size=2, checkpointing="on", precision="bf16"),
                 marks=pytest.mark.slow)])
def test_a_model_running_blocks_it_keeps_elsewhere_falls_back_to_the_full_build(tmp_path, small_builds, settings):
    # The forward iterates a plain list of the blocks: cutting the container changes no step,
    # and extending it would count blocks that are not cut as if they were.
    path = tmp_path / "own_list.py"
    path.write_text(OWN_LIST.format(model=str(MODEL)))
    few = estimate_peaks(path, [2], **settings)
    with full_builds():
        full = estimate_peaks(path, [2], **settings)
    assert few == full
    assert max(small_builds) == 12  # the small builds' steps ran the cut blocks: the full build ran


def test_small_builds_make_only_the_blocks_they_keep(monkeypatch, small_builds):
    # Cut on the meta device before the fake tensors are made: a small build never makes the
    # twelve blocks' tensors only to drop most of them.
    from autotune.memory import fake_build

    made = []
    to_fake = fake_build._fake_from_meta
    monkeypatch.setattr(fake_build, "_fake_from_meta",
                        lambda model: made.append(len(model.blocks)) or to_fake(model))
    few = estimate_peaks(MODEL, [1, 3], checkpointing="off")
    assert small_builds and max(small_builds) == 5
    assert sorted(set(made)) == [4, 5]
    with full_builds():
        assert estimate_peaks(MODEL, [1, 3], checkpointing="off") == few


def test_a_hugging_face_llamas_small_builds_are_cut_before_their_tensors_are_made(monkeypatch, small_builds):
    # transformers' LlamaForCausalLM (twelve layers, tiny config) builds on the meta device too:
    # only the 4 and 5 layers kept become fake tensors, and the estimate is the full build's.
    from autotune.memory import fake_build

    llama = pathlib.Path(__file__).with_name("twelve_block_llama.py")
    made = []
    to_fake = fake_build._fake_from_meta
    monkeypatch.setattr(fake_build, "_fake_from_meta",
                        lambda model: made.append(len(model.model.layers)) or to_fake(model))
    few = estimate_peaks(llama, [1, 2], checkpointing="on")
    assert sorted(made) == [4, 5] and max(small_builds) == 5
    with full_builds():
        assert estimate_peaks(llama, [1, 2], checkpointing="on") == few


LISTED_TENSOR = """
import runpy
import torch

_M = runpy.run_path({model!r})
make_batch, loss_fn = _M["make_batch"], _M["loss_fn"]


def build_model():
    model = _M["build_model"]()
    # A tensor in a list: no module table holds it, so a meta build would leave it on meta.
    model.head.scales = [torch.ones(model.head.out_features)]
    forward = model.head.forward
    model.head.forward = lambda x: forward(x) * model.head.scales[0]
    return model
"""


def test_a_model_holding_a_tensor_no_cut_build_finds_is_cut_after_its_fake_build(tmp_path, small_builds):
    path = tmp_path / "listed_tensor.py"
    path.write_text(LISTED_TENSOR.format(model=str(MODEL)))
    few = estimate_peaks(path, [2], checkpointing="off")
    with full_builds():
        full = estimate_peaks(path, [2], checkpointing="off")
    assert few == full
    assert small_builds and max(small_builds) == 5


def test_block_patterns():
    assert block_pattern(0, 32) == BlockPattern((), (False,), 32)
    assert block_pattern(32, 32) == BlockPattern((), (True,), 32)
    assert block_pattern(0, 32).small == (4, 5)
    assert block_pattern(16, 32) == BlockPattern((), (True, False), 16)
    assert block_pattern(1, 32) == BlockPattern((True,), (False,), 31)
    assert block_pattern(8, 32) == BlockPattern((), (True, False, False, False), 8)
    assert block_pattern(5, 32) is None  # 0, 6, 12, 19, 25: no repeating unit
    assert block_pattern(4, 8) is None  # a unit of 2 blocks: the larger build has 10
    assert BlockPattern((True,), (False,), 31).checkpointed(4) == [0]
    assert BlockPattern((), (True, False), 16).checkpointed(2) == [0, 2]
    # Named from the nearer end; the units between are not named (their peaks lie below).
    pattern = BlockPattern((True,), (True, False), 10)
    assert [pattern.position(i, 5) for i in range(11)] == [
        ("prefix", 0), (0, 0), (0, 1), (1, 0), (1, 1), None, None, (-2, 0), (-2, 1), (-1, 0), (-1, 1)]


def test_the_tensor_floor_runs_plain_estimate_sessions_under_a_recording_one():
    # A probe that records its steps' costs (the throughput ranking) records the full build's:
    # the floor's small builds run the plain session its type names.
    from autotune.probing.estimate import EstimateSession
    from autotune.timing.recorded import recording_session

    assert recording_session({}).plain_type is EstimateSession is EstimateSession.plain_type
