"""``--optimize throughput --gpu`` counts the steps its probes already ran (autotune.timing.recorded):
the record is the step counted again, op by op, and recording changes no byte the probe counts."""

import dataclasses

import pytest

import autotune
from autotune.gpus.target import profile_target
from autotune.orchestration import predicted
from autotune.probing.api import probe
from autotune.timing.count import count_steps_costs
from autotune.timing.recorded import recording_session

from conftest import ROOT

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
