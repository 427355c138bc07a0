"""Plan files: round trip, the shipped JSON Schema, validation errors, atomic writes."""

import json
import os
import warnings

import pytest

from autotune import Plan, load_plan, save_plan
from autotune.errors import PlanFileError
from autotune.planning.types import SCHEMA_VERSION
from autotune.planning.planfile import PlanFileWarning, first_schema_error, plan_schema
from autotune.workload.contract import Workload
from plan_helpers import device, make_plan


@pytest.fixture
def plan():
    return make_plan(127, 50, base_lr=1e-3, base_batch=32)


@pytest.fixture
def saved(plan, tmp_path):
    return save_plan(plan, tmp_path / "plan.json")


def _rewrite(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_round_trip(plan, saved):
    loaded = load_plan(saved)
    assert isinstance(loaded, Plan)
    assert loaded == plan
    assert loaded.micro_batches == [43, 42, 42]
    assert loaded.settings[0].probe.max_micro_batch == 50


def test_file_holds_what_the_issue_lists(saved):
    data = json.loads(saved.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert set(data["versions"]) == {"autotune", "torch", "cuda"}
    assert data["device"]["budget_bytes"] > 0 and data["headroom"] == 0.0
    assert data["workload"]["file_sha256"] and data["workload"]["param_count"] == 1000
    assert data["settings"][0]["probe"]["trials"]
    assert data["derived"]["effective_batch"] == 127
    assert data["created_at"]


def test_written_plans_match_the_shipped_schema(saved):
    jsonschema = pytest.importorskip("jsonschema")
    schema = plan_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(saved.read_text()), schema,
                        cls=jsonschema.Draft202012Validator)


def test_builtin_validator_agrees_with_jsonschema_on_a_broken_plan(saved):
    jsonschema = pytest.importorskip("jsonschema")
    data = json.loads(saved.read_text())
    data["lr"]["warmup_steps"] = -1
    assert first_schema_error(data, plan_schema()) == "field lr.warmup_steps must be at least 0, got -1"
    assert not jsonschema.Draft202012Validator(plan_schema()).is_valid(data)


def test_a_negative_byte_count_is_refused(saved):
    # predicted_peak_bytes -5 loaded, and show printed "peak: -5 B".
    data = json.loads(saved.read_text())
    data["predicted_peak_bytes"] = -5
    saved.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="field predicted_peak_bytes must be at least 0, got -5"):
        load_plan(saved)


def test_corrupt_file(saved):
    saved.write_text('{"schema_version": 1, "target_')
    with pytest.raises(PlanFileError) as info:
        load_plan(saved)
    assert "not valid JSON" in str(info.value) and str(saved) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(PlanFileError) as info:
        load_plan(tmp_path / "nope.json")
    assert "does not exist" in str(info.value)


@pytest.mark.parametrize("path,field", [(("target_batch",), "target_batch"),
                                        (("lr", "rule"), "lr.rule"),
                                        (("workload", "file_sha256"), "workload.file_sha256")])
def test_missing_field_is_named(saved, path, field):
    def drop(data):
        for key in path[:-1]:
            data = data[key]
        del data[path[-1]]

    _rewrite(saved, drop)
    with pytest.raises(PlanFileError) as info:
        load_plan(saved)
    assert f"missing field {field}" in str(info.value)


def test_wrong_type_is_named(saved):
    _rewrite(saved, lambda d: d["micro_batches"].__setitem__(1, "42"))
    with pytest.raises(PlanFileError) as info:
        load_plan(saved)
    assert "micro_batches[1]" in str(info.value)


def test_unknown_schema_version(saved):
    _rewrite(saved, lambda d: d.__setitem__("schema_version", 99))
    with pytest.raises(PlanFileError) as info:
        load_plan(saved)
    assert "schema_version 99" in str(info.value)


def test_precision_is_the_enum_end_to_end(plan, saved):
    from autotune import Precision

    loaded = load_plan(saved)
    for p in (plan, loaded):
        assert type(p.precision) is Precision
        assert all(type(s.precision) is Precision for s in p.settings)
        assert all(type(s.probe.precision) is Precision for s in p.settings if s.probe is not None)
    assert json.loads(saved.read_text())["precision"] == str(plan.precision)
    assert {Precision.BF16: 1}["bf16"] == 1  # equal to its value, and hashed like it


def test_a_version_1_file_loads_as_a_replicated_plan(saved):
    def as_version_1(data):
        data["schema_version"] = 1
        del data["sharding"], data["shard_group"]

    _rewrite(saved, as_version_1)
    loaded = load_plan(saved)
    assert loaded.sharding == "ddp" and loaded.sharding.sharded is False and loaded.shard_group is None


def test_sharding_round_trips_and_bad_sharding_is_named(plan, tmp_path):
    import dataclasses

    sharded = dataclasses.replace(plan, sharding="fsdp", shard_group=plan.world_size)
    loaded = load_plan(save_plan(sharded, tmp_path / "sharded.json"))
    assert loaded.sharding == "fsdp" and loaded.shard_group == plan.world_size
    assert json.loads((tmp_path / "sharded.json").read_text())["sharding"] == "fsdp"
    _rewrite(tmp_path / "sharded.json", lambda d: d.__setitem__("sharding", "zero9"))
    with pytest.raises(PlanFileError, match="sharding"):
        load_plan(tmp_path / "sharded.json")


def test_split_that_does_not_add_up(saved):
    _rewrite(saved, lambda d: d.__setitem__("target_batch", 128))
    with pytest.raises(PlanFileError) as info:
        load_plan(saved)
    assert "not target_batch 128" in str(info.value)


def test_plan_for_another_workload(saved, tmp_path):
    other = Workload(model=lambda: None, make_batch=lambda n: None, source="other.py",
                     file_sha256="cd" * 32)
    with pytest.raises(PlanFileError) as info:
        load_plan(saved, workload=other)
    assert "workload.file_sha256" in str(info.value)
    same = Workload(model=lambda: None, make_batch=lambda n: None, source="model.py",
                    file_sha256="ab" * 32)
    assert load_plan(saved, workload=same).target_batch == 127


def test_plan_for_another_device_warns(saved):
    with pytest.warns(PlanFileWarning, match="device.name"):
        load_plan(saved, device=device(name="another GPU"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_plan(saved, device=device())


def test_save_is_atomic(plan, tmp_path, monkeypatch):
    path = save_plan(plan, tmp_path / "plan.json")
    before = path.read_text()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    changed = make_plan(128, 64)
    with pytest.raises(OSError):
        save_plan(changed, path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left


def test_checkpointing_is_one_value_end_to_end(plan, tmp_path):
    import dataclasses

    from autotune import Checkpointing

    some = dataclasses.replace(plan, checkpointing=Checkpointing.of(2, 6),
                               workload=dataclasses.replace(plan.workload, repeated_blocks=6))
    path = save_plan(some, tmp_path / "some.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 3
    assert data["checkpointing"] == {"blocks": 2, "total": 6} and "checkpointed_blocks" not in data
    assert data["settings"][0]["checkpointing"] == data["settings"][0]["probe"]["checkpointing"]
    assert data["derived"]["checkpointed_blocks"] == 2
    loaded = load_plan(path)
    assert loaded == some and type(loaded.checkpointing) is Checkpointing
    assert loaded.checkpointing_label == "2 of 6 blocks" and loaded.blocks == 2
    assert all(type(s.checkpointing) is Checkpointing and type(s.probe.checkpointing) is Checkpointing
               for s in loaded.settings)


@pytest.mark.parametrize("on, blocks, label", [(False, None, "off"), (True, None, "on"),
                                               (True, 2, "2 of 6 blocks")])
def test_a_version_2_file_with_the_bool_and_the_count_loads(saved, on, blocks, label):
    def as_version_2(data):
        data["schema_version"] = 2
        data["workload"]["repeated_blocks"] = 6
        data["checkpointing"], data["checkpointed_blocks"] = on, blocks
        for setting in data["settings"]:
            setting["checkpointing"], setting["checkpointed_blocks"] = False, None
            setting["probe"]["checkpointing"], setting["probe"]["checkpointed_blocks"] = False, 0
        data["throughput"] = [{"precision": "fp32", "checkpointing": on, "checkpointed_blocks": blocks,
                               "micro_batches": [43, 42, 42], "samples_per_s": 10.0, "peak_bytes": 1,
                               "fits": True, "status": "measured"}]

    _rewrite(saved, as_version_2)
    loaded = load_plan(saved)
    assert loaded.checkpointing_label == label and bool(loaded.checkpointing) is on
    assert loaded.throughput[0].checkpointing == loaded.checkpointing
    assert [s.checkpointing_label for s in loaded.settings] == ["off"]
    assert json.loads(json.dumps(loaded.to_dict()))["checkpointing"]["blocks"] == (
        0 if not on else blocks or 6)


@pytest.mark.parametrize("value", [{"blocks": -1, "total": 4}, {"blocks": 5, "total": 4}, "on",
                                   {"total": 4}])
def test_a_bad_checkpointing_object_is_named(saved, value):
    _rewrite(saved, lambda d: d.__setitem__("checkpointing", value))
    with pytest.raises(PlanFileError, match="checkpointing.*re-create it"):
        load_plan(saved)
