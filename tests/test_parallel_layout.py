"""The parallel layout value (autotune.Layout): degrees, mesh, ranks, checks, and how a plan
carries it. Pure: no process group."""

import json

import pytest
from click.testing import CliRunner

from autotune import ConfigError, Layout, PipelineSchedule, PlanError
from autotune.cli.main import cli
from autotune.distributed.layout import parse_layout
from autotune.planning.policy import PlanRequest
from autotune.planning.types import Plan, SettingTried

from plan_helpers import make_plan


def test_degrees_and_data_parallel_ranks():
    layout = Layout(tp=8, pp=4)
    assert layout.model_parallel == 32 and not layout.trivial
    assert layout.data_parallel(256) == 8
    assert Layout().trivial and Layout().data_parallel(7) == 7


def test_mesh_follows_torchtitans_order_and_hybrid_groups():
    layout = Layout(tp=2, cp=2, pp=2)
    assert layout.mesh_dims(16) == [("pp", 2), ("dp_shard", 2), ("cp", 2), ("tp", 2)]
    assert Layout(tp=2).mesh_dims(16, shard_group=2) == [("dp_replicate", 4), ("dp_shard", 2), ("tp", 2)]
    with pytest.raises(ConfigError, match="shard_group=3 does not divide the 8 data-parallel"):
        Layout(tp=2).mesh_dims(16, shard_group=3)


def test_tensor_parallel_peers_are_neighbours_and_share_a_data_rank():
    layout = Layout(tp=2, pp=2)
    # rank = ((pp * dp) + dp_index) * tp + tp_index: tp groups are runs of neighbouring ranks
    assert layout.coordinates(5, 8) == {"pp": 1, "dp_shard": 0, "tp": 1}
    assert [layout.data_rank(r, 8) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # The data rank does not depend on how hybrid sharding splits the data-parallel ranks.
    hybrid = Layout(tp=2)
    for rank in range(16):
        coords = hybrid.coordinates(rank, 16, shard_group=2)
        assert coords["dp_replicate"] * 2 + coords["dp_shard"] == hybrid.data_rank(rank, 16)


def test_world_size_must_be_a_multiple_of_the_model_parallel_ranks():
    with pytest.raises(ConfigError, match=r"tp 2 × pp 2 \(1f1b\) needs a world size that is a multiple "
                                          r"of 4, and world_size=6 is not; use 4 or 8 ranks"):
        Layout(tp=2, pp=2).data_parallel(6)


def test_model_limits_name_the_limit():
    with pytest.raises(ConfigError, match="tp=3 does not divide the model's 32 attention heads.*1, 2, 4, 8, 16, 32"):
        Layout(tp=3).check_model(heads=32)
    with pytest.raises(ConfigError, match="tp=16 does not divide the model's 8 key/value heads"):
        Layout(tp=16).check_model(heads=32, kv_heads=8)
    with pytest.raises(ConfigError, match="needs 8 pipeline stages and the model has 6 repeated"):
        parse_layout(pp=4, pp_schedule="interleaved-1f1b").check_model(blocks=6)
    Layout(tp=8).check_model(heads=64, kv_heads=8, blocks=80)  # Llama-3.1-70B: fine


def test_tensor_and_context_groups_stay_inside_a_host():
    with pytest.raises(ConfigError, match="16 ranks in each tensor/context-parallel group.*gpus_per_node=8"):
        Layout(tp=8, cp=2).check_hosts(8)
    with pytest.raises(ConfigError, match="gpus_per_node=8"):
        Layout(tp=3).check_hosts(8)
    Layout(tp=4, cp=2, pp=8).check_hosts(8)
    Layout(tp=8).check_hosts(None)


def test_schedule_and_stages_per_rank_must_agree():
    assert parse_layout(pp=2, pp_schedule="zero-bubble").stages_per_rank == 2
    assert parse_layout(pp=2).pp_schedule is PipelineSchedule.ONE_F_ONE_B
    with pytest.raises(ConfigError, match="runs several stages per rank"):
        Layout(pp=2, pp_schedule="interleaved-1f1b", stages_per_rank=1)
    with pytest.raises(ConfigError, match="runs one stage per rank, not 2"):
        Layout(pp=2, stages_per_rank=2)
    with pytest.raises(ConfigError, match="describe a pipeline"):
        parse_layout(pp_schedule="zero-bubble")
    with pytest.raises(ConfigError, match="is not a pipelineschedule"):
        parse_layout(pp=2, pp_schedule="gpipe")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="is not a number of ranks"):
            Layout(tp=bad)


def test_plan_checks_a_fixed_degree_beside_a_searched_one_before_loading_the_model(monkeypatch):
    """plan(tp="auto", cp="2") raised a TypeError from deep in the layout search, after loading the
    model: a search took its fixed degrees as given."""
    import autotune
    from autotune.orchestration import planner

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before its degrees were checked")

    monkeypatch.setattr(planner, "load_workload", not_loaded)
    for degrees in (dict(tp="auto", cp="2"), dict(tp="auto", pp=0), dict(cp="auto", tp=1.0), dict(tp="2")):
        with pytest.raises(ConfigError, match='is not a number of ranks; give a positive int .* or "auto"'):
            autotune.plan("model.py", target_batch=8, world_size=4, **degrees)


def test_descriptions():
    layout = parse_layout(tp=8, pp=8, pp_schedule="interleaved-1f1b")
    assert layout.describe(512, "FSDP") == "FSDP 8 × TP 8 × PP 8 (interleaved-1f1b, 2 stages per rank)"
    assert Layout().describe_degrees() == "no model parallelism"
    assert Layout.from_dict(layout.to_dict()) == layout
    assert Layout.from_dict(None) == Layout()


def test_the_target_divides_over_data_parallel_ranks():
    request = PlanRequest(target_batch=64, world_size=16, parallel=Layout(tp=4))
    assert request.data_parallel == 4 and request.share == 16
    with pytest.raises(PlanError, match="target_batch=66 is not divisible by the 4 data-parallel "
                                          "rank\\(s\\) of world_size=16 under tp 4; use 64 or 68"):
        PlanRequest(target_batch=66, world_size=16, parallel=Layout(tp=4)).share


def _plan_dict(**fields) -> dict:
    plan = make_plan()
    data = plan.to_dict()
    data.update(fields)
    return data


def test_a_plan_round_trips_its_layout_and_counts_data_parallel_ranks():
    data = _plan_dict(world_size=8, micro_batches=[4, 4], target_batch=16,
                      parallel={"tp": 2, "cp": 1, "pp": 2, "pp_schedule": "1f1b", "stages_per_rank": 1})
    plan = Plan.from_dict(json.loads(json.dumps(data)))
    assert plan.parallel == Layout(tp=2, pp=2)
    assert plan.data_parallel == 2 and plan.effective_batch == (4 + 4) * 2 == plan.target_batch
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.parallel == plan.parallel and again.to_dict()["derived"]["data_parallel"] == 2


def test_older_plan_files_are_data_parallel():
    data = _plan_dict()
    data.pop("parallel")
    plan = Plan.from_dict(data)
    assert plan.parallel.trivial and plan.data_parallel == plan.world_size


def test_a_plan_whose_layout_does_not_divide_its_world_is_refused():
    with pytest.raises(ConfigError, match="multiple of 4"):
        Plan.from_dict(_plan_dict(world_size=6, parallel={"tp": 4}))


def test_setting_labels_name_the_split():
    setting = SettingTried(precision="bf16", checkpointing="off", sharding="fsdp", shard_group=4,
                           parallel=Layout(tp=2))
    assert setting.layout == "fsdp (shard group 4) × tp 2"
    assert SettingTried.from_dict(json.loads(json.dumps(setting.to_dict()))).parallel == Layout(tp=2)


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "tp 3 needs a world size that is a multiple of 3, and --world-size 4 is not"),
    (["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--stages-per-rank", "1"],
     "--pp-schedule 'interleaved-1f1b' runs several stages per rank and --stages-per-rank 1"),
    (["--pp", "4", "--pp-schedule", "interleaved-1f1b"],
     "needs 8 pipeline stages and the model has 4 repeated block"),
    (["--pp", "2", "--sharding", "ddp"],
     "--sharding 'ddp' with pp 2 (1f1b): model-parallel layouts train with FSDP2 over their "
     "data-parallel ranks; use --sharding 'fsdp' or auto"),
    (["--tp", "4", "--gpu", "h100-80gb", "--gpus-per-node", "2"],
     "puts 4 ranks in each tensor/context-parallel group, which must stay inside one host of "
     "--gpus-per-node 2"),
])
def test_the_cli_names_the_limit(args, message, tmp_path):
    device = ["--world-size", "8"] if "--gpu" in args else ["--world-size", "4", "--memory-limit", "1GiB"]
    result = CliRunner().invoke(cli, ["plan", "examples/tiny_lm.py", "--target-batch", "16", *device,
                                      "-o", str(tmp_path / "p.json"), *args])
    assert result.exit_code in (1, 2), result.output
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "p.json").exists()
