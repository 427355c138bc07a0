"""The planner's search for the smallest shard group: the answer an exhaustive search over the
groups gives, in fewer probes and fake steps."""

import dataclasses
import itertools

import pytest

from autotune.errors import PlanError
from autotune.orchestration import planner as api
from autotune.orchestration.planner import _smallest_passing, plan
from autotune.probing.trial import TrialSession
from autotune.distributed.sharding import Sharding


@pytest.mark.parametrize("size", range(0, 7))
def test_smallest_passing_is_the_first_that_passes_wherever_it_starts(size):
    candidates = list(range(size))
    # Every monotone predicate: candidates from `boundary` on pass (size: none does).
    for boundary, first in itertools.product(range(size + 1), range(max(size, 1))):
        calls = []

        def passes(c):
            calls.append(c)
            return c >= boundary

        found = _smallest_passing(candidates, passes, first=first)
        assert found == (boundary if boundary < size else None)
        assert len(set(calls)) == len(calls)  # never asks twice
        if first == boundary or (first == size - 1 and boundary == size):
            # A right prediction: the candidate itself and its neighbour below prove it.
            assert len(calls) <= 2
        assert len(calls) <= 2 + max(size - 1, 1).bit_length()


def _counting(monkeypatch):
    probes, steps = [], []
    probe, run = api.probe, TrialSession.run

    def counted_probe(*args, **kwargs):
        probes.append((kwargs.get("sharding"), kwargs.get("shard_group"), kwargs.get("checkpointing")))
        return probe(*args, **kwargs)

    def counted_run(self, n, **kwargs):
        steps.append(n)
        return run(self, n, **kwargs)

    monkeypatch.setattr(api, "probe", counted_probe)
    monkeypatch.setattr(TrialSession, "run", counted_run)
    return probes, steps


@pytest.mark.slow  # 15-30 s: the fast suite is at its 10 minutes
def test_the_shard_group_search_finds_what_every_group_tried_finds(examples_dir, one_thread,
                                                                   monkeypatch):
    # mlp.py, one rank of 8: about 31 MiB on groups of 2, 23 MiB on 4, 18 MiB on 8, and a
    # replica does not fit. 28 MiB less the 10% headroom leaves 25.2 MiB: groups of 4 are the
    # smallest that reach one step.
    args = dict(target_batch=64, world_size=8, device="cpu", memory_limit="28MiB",
                precision="fp32", checkpointing="off")
    exhaustive = {}
    for g in (2, 4, 8):
        try:
            exhaustive[g] = plan(examples_dir / "mlp.py", sharding="fsdp", shard_group=g, **args)
        except PlanError:
            pass  # nothing fits on groups of g
    fewest = min(p.accumulation_steps for p in exhaustive.values())
    smallest = min(g for g, p in exhaustive.items() if p.accumulation_steps == fewest)
    assert smallest == 4  # the case this test is about: neither end of the groups

    probes, steps = _counting(monkeypatch)
    found = plan(examples_dir / "mlp.py", **args)
    assert (found.sharding, found.shard_group) == (Sharding.FSDP, smallest)
    assert found.micro_batches == exhaustive[smallest].micro_batches
    assert found.checkpointing == exhaustive[smallest].checkpointing
    # ddp, the whole world, the predicted group and the one below it: every group once at most.
    assert [p[1] for p in probes] == [None, 8, 4, 2]
    # The smaller groups start where the world's probe predicts: one step proves groups of 4
    # reach the micro-batch, two show groups of 2 do not.
    assert len(steps) <= 10, steps


def _trials(result):
    return result.max_micro_batch, [(t.micro_batch, t.fits, t.peak_bytes, t.activation_peak_bytes,
                                     t.step_peak_bytes, t.baseline_bytes) for t in result.trials]


def test_sharded_state_that_cannot_fit_skips_the_warm_up_step(examples_dir, one_thread, monkeypatch):
    from autotune.probing.api import probe
    from autotune.probing.trial import SetupOutOfMemory

    steps = []
    step = TrialSession._step
    monkeypatch.setattr(TrialSession, "_step", lambda self, n: steps.append(n) or step(self, n))
    # mlp.py: 40 MiB of parameters and AdamW state, 20 MiB on each of 2 ranks.
    with pytest.raises(SetupOutOfMemory, match="optimizer state alone pass"):
        probe(examples_dir / "mlp.py", sharding="fsdp", world_size=2, device="cpu",
              memory_limit="12MiB", explain=False)
    assert steps == []


@pytest.mark.slow
def test_the_probe_on_fake_tensors_counts_what_the_plain_session_counts(examples_dir, one_thread,
                                                                        monkeypatch):
    # The probe's sharded (and --gpu) trials run EstimateSession: Adam state without a step, the
    # optimizer phase measured once. Every trial must read as the plain TrialSession reads it,
    # failures against the budget included.
    from autotune.probing import api as probing

    def trials():
        result = probing.probe(examples_dir / "tiny_lm.py", sharding="fsdp", world_size=4,
                               device="cpu", memory_limit="24MiB", checkpointing=True, explain=False)
        return result.max_micro_batch, [(t.micro_batch, t.fits, t.peak_bytes, t.activation_peak_bytes,
                                         t.step_peak_bytes, t.baseline_bytes) for t in result.trials]

    estimated = trials()
    monkeypatch.setattr(probing, "EstimateSession", TrialSession)
    plain = trials()
    assert estimated == plain
    assert any(not fits for _, fits, *_ in plain[1])  # the budget was hit: the check is exercised


def test_a_setting_that_fits_nowhere_on_the_whole_world_is_not_probed_on_smaller_groups():
    from autotune.orchestration.planner import _no_fit_on_smaller_group
    from autotune.planning.types import SettingTried
    from autotune.distributed.sharding import Sharding
    from plan_helpers import linear_probe

    failed = SettingTried(precision="fp32", checkpointing=False, error="does not fit at micro-batch 1",
                          sharding=Sharding.FSDP, shard_group=8)
    known = _no_fit_on_smaller_group(failed, 4)
    assert known.probe is None and known.shard_group == 4 and known.sharding is Sharding.FSDP
    assert "fitted nowhere on shard group 8" in known.error and not known.checkpointing
    # Tried at one micro-batch only (every block checkpointed first, which fitted at 3): that one.
    tried_once = dataclasses.replace(failed, only_micro_batch=3)
    assert _no_fit_on_smaller_group(tried_once, 4).error.startswith(
        "does not fit at micro-batch 3: it did not fit at micro-batch 3 on shard group 8")
    fitted = SettingTried(precision="fp32", checkpointing=False, probe=linear_probe(3),
                          sharding=Sharding.FSDP, shard_group=8)
    assert _no_fit_on_smaller_group(fitted, 4) is None  # it must be probed: it may fit less
