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
