"""Plan files: ``Plan`` <-> versioned JSON, checked against the shipped JSON Schema.

The schema (``autotune/planning/schemas/plan.schema.json``) is the one description of the layout: it is
shipped for other tools, and ``load_plan`` checks files against it with the small validator below
(the subset of JSON Schema the file uses), so the runtime needs no jsonschema package and the two
cannot drift. Writes are atomic: a temporary file in the same directory, fsync, then os.replace,
so a crash leaves either the old plan or the new one, never half of one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import warnings
from importlib import resources
from pathlib import Path

from ..files.outputs import write_atomic
from ..errors import ConfigError, PlanFileError
from ..memory.base import DeviceInfo
from ..files.outputs import check_outputs
from .types import READABLE_SCHEMA_VERSIONS, Plan
from ..compiled import with_compile
from ..units import option_bytes
from ..workload.contract import Workload, load_workload


MAX_PLAN_BYTES = 4 * 1024 * 1024
"""Plan files are a few KiB (long splits are stored compactly); past this, a file is no plan and
is not read further (``/dev/zero`` would otherwise be read until memory runs out)."""


class PlanFileWarning(UserWarning):
    """A plan file is usable but was made for a different device than the one in use."""


@functools.cache
def plan_schema() -> dict:
    """The JSON Schema of plan files (draft 2020-12)."""
    text = resources.files("autotune.planning").joinpath("schemas/plan.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def plan_to_json(plan: Plan) -> str:
    # allow_nan=False: NaN and Infinity are not JSON; a plan never holds them (numbers are checked
    # where they enter), and if one slipped through, failing here beats writing a broken file.
    return json.dumps(plan.to_dict(), indent=2, allow_nan=False) + "\n"


def plan_from_json(text: str, *, source: str = "<plan>") -> Plan:
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise PlanFileError(f"plan file {source} holds JSON nested deeper than Python reads; it is "
                            f"no autotune plan (their nesting is a few levels). Re-create it with "
                            f"autotune plan") from None
    except _NonFiniteNumber as exc:
        raise PlanFileError(f"plan file {source} holds {exc}, which is not a JSON number; "
                            f"re-create it with autotune plan") from None
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"plan file {source} is not valid JSON (line {exc.lineno}, column "
                            f"{exc.colno}: {exc.msg}); re-create it with autotune plan") from None
    return plan_from_dict(data, source=source)


def plan_from_dict(data, *, source: str = "<plan>") -> Plan:
    if not isinstance(data, dict):
        raise PlanFileError(f"plan file {source} must hold a JSON object, got {type(data).__name__}")
    if "schema_version" not in data:
        raise PlanFileError(f"plan file {source} is missing the field schema_version; "
                            f"is it an autotune plan? Re-create it with autotune plan")
    version = data["schema_version"]
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise PlanFileError(f"plan file {source} has schema_version {version!r}, but this autotune "
                            f"reads schema_version {' or '.join(map(str, READABLE_SCHEMA_VERSIONS))}; re-create it with autotune plan "
                            f"(or use the autotune version that wrote it)")
    problem = first_schema_error(data, plan_schema()) or _semantic_error(data)
    if problem is not None:
        raise PlanFileError(f"plan file {source}: {problem}; re-create it with autotune plan")
    try:
        plan = Plan.from_dict(data)
    except ConfigError as exc:  # a value the schema's types allow but the field does not
        raise PlanFileError(f"plan file {source}: {exc}; re-create it with autotune plan") from None
    if plan.effective_batch != plan.target_batch:
        raise PlanFileError(
            f"plan file {source}: micro_batches {plan.micro_batches} × world_size {plan.world_size} = "
            f"{plan.effective_batch}, not target_batch {plan.target_batch}; re-create it with autotune plan")
    return plan


class _NonFiniteNumber(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NonFiniteNumber(name)


def _semantic_error(data: dict) -> str | None:
    """What the schema cannot say: a compact split's lengths and size, and a model file's hash."""
    split = data["micro_batches"]
    if isinstance(split, dict):
        if len(split["sizes"]) != len(split["counts"]):
            return "field micro_batches has sizes and counts of different lengths"
        if sum(split["counts"]) > data["target_batch"]:
            return (f"field micro_batches has {sum(split['counts'])} accumulation steps, more than "
                    f"target_batch {data['target_batch']}")
    tokens, seq_len = data.get("target_tokens"), data.get("seq_len")
    if tokens is not None and (seq_len is None or data["target_batch"] * seq_len != tokens):
        return (f"field target_tokens is {tokens}, but target_batch {data['target_batch']} × "
                f"seq_len {seq_len} is not that")
    workload = data["workload"]
    if workload["file_sha256"] is None and workload["source"].endswith(".py"):
        return (f"field workload.file_sha256 is null for the model file {workload['source']}; "
                f"without it the plan cannot be checked against the file")
    return None


def save_plan(plan: Plan, path) -> Path:
    """Write ``plan`` to ``path`` atomically; returns the path. The model file the plan names is
    never replaced (``OutputError``)."""
    check_plan_output(plan, path)
    data = plan_to_json(plan).encode("utf-8")
    return write_atomic(path, lambda handle: handle.write(data))


def check_plan_output(plan: Plan, path, *, option: str = "output") -> None:
    """``check_outputs`` for a file written from ``plan`` (the plan, its report, a plot), whose
    model file it must never replace."""
    check_outputs({option: path}, inputs={"model file (the plan's)": planned_model_file(plan)})


def load_plan(path, *, workload=None, device: DeviceInfo | None = None) -> Plan:
    """Read and validate a plan file.

    With ``workload`` (a model file path or ``Workload``), a plan made for another model file
    (a different file_sha256) is a ``PlanFileError``. With ``device`` (a ``DeviceInfo``), a plan
    made on another kind of device or one with a different name or memory gives a
    ``PlanFileWarning``: it may still work, but its micro-batch was measured elsewhere.
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PLAN_BYTES + 1)
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise PlanFileError(f"plan file {path} does not exist; create it with "
                            f"autotune plan MODEL.py --target-batch N -o {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanFileError(f"plan file {path} cannot be read: {exc}") from None
    if len(data) > MAX_PLAN_BYTES:
        raise PlanFileError(f"plan file {path} is larger than {MAX_PLAN_BYTES // 1024**2} MiB (it was "
                            f"not read further); plan files are a few KiB: is it a plan? Re-create "
                            f"it with autotune plan")
    plan = plan_from_json(text, source=str(path))
    if workload is not None:
        load_planned_workload(plan, workload, source=str(path))
    if device is not None:
        check_device(plan, device, source=str(path))
    return plan


def planned_model_file(plan: Plan, plan_path=None) -> Path | None:
    """The model file ``plan`` names, as the plan file sees it: a relative path is looked for
    beside the plan file first, then from the current folder (where ``autotune plan`` ran when
    the plan was written elsewhere); where both exist, the one with the plan's sha256 wins.
    None when the plan names no file (Python objects) or neither exists."""
    source = Path(plan.workload.source)
    if plan.workload.source.startswith("<"):
        return None
    candidates = [source] if source.is_absolute() or plan_path is None else [
        Path(plan_path).parent / source, source]
    found = [c for c in dict.fromkeys(candidates) if c.is_file()]
    planned = plan.workload.file_sha256
    for candidate in found:
        try:
            if planned is not None and hashlib.sha256(candidate.read_bytes()).hexdigest() == planned:
                return candidate
        except OSError:
            continue
    return found[0] if found else None


def model_file_not_found(plan: Plan, plan_path) -> PlanFileError:
    source = Path(plan.workload.source)
    where = (f"{source}" if source.is_absolute() or plan_path is None else
             f"{Path(plan_path).parent / source} (beside the plan) nor {source} (from the current folder)")
    return PlanFileError(f"plan file {plan_path or '<plan>'} names the model file {source}, which is "
                         f"not at {where}; pass the model file's path with --model PATH (workload= from Python)")


def load_planned_workload(plan: Plan, workload, *, source: str = "<plan>") -> Workload:
    """``load_workload(workload)`` for ``plan``: a model file whose sha256 differs from the plan's
    is refused before any of it is imported (a plan names the file to run; it must not choose the
    code). A plan with ``seq_len`` gets the workload at that length (``Workload.at_seq_len``)."""
    def check(model_source: str, sha256: str) -> None:
        _check_sha256(plan, sha256, model_source, source)

    loaded = load_workload(workload, check_sha256=check)
    check_workload(plan, loaded, source=source)
    # A plan with a sequence length was probed at it: every batch is made at it too.
    if plan.seq_len is not None:
        loaded = loaded.at_seq_len(plan.seq_len)
    # A plan made with --compile trains compiled with its backend (one made from a build_model
    # that compiles needs nothing: the file compiles again).
    return with_compile(loaded, plan.compile_backend) if plan.compile else loaded


def check_workload(plan: Plan, workload: Workload, *, source: str = "<plan>") -> None:
    _check_sha256(plan, workload.file_sha256, workload.source, source)


def _check_sha256(plan: Plan, current: str | None, model_source: str, source: str) -> None:
    planned = plan.workload.file_sha256
    if planned is not None and current is not None and planned != current:
        named = "the plan" if source == "<plan>" else f"plan file {source}"
        raise PlanFileError(
            f"{named} was made for another version of the model: its workload.file_sha256 "
            f"is {planned[:12]}…, {model_source} hashes to {current[:12]}… (it was not imported); "
            f"re-plan with {replan_command(plan, model_source)}")


def replan_command(plan: Plan, model_source: str) -> str:
    """``autotune plan`` for ``model_source`` with the options that shaped ``plan`` and that it
    records: the target, the world, the GPU profile or the memory limit, the headroom."""
    words = ["autotune plan", model_source]
    if plan.target_tokens is not None and plan.seq_len is not None:
        words += ["--target-tokens", str(plan.target_tokens), "--seq-len", str(plan.seq_len)]
    else:
        words += ["--target-batch", str(plan.target_batch)]
    if plan.world_size > 1:
        words += ["--world-size", str(plan.world_size)]
    device = plan.device
    if device is not None and device.budget_source.startswith("GPU profile "):
        words += ["--gpu", device.budget_source.removeprefix("GPU profile ").split(":", 1)[0]]
    elif device is not None and device.budget_source.startswith("--memory-limit"):
        words += ["--memory-limit", option_bytes(device.budget_bytes)]
    if plan.headroom != 0.1:
        words += ["--headroom", f"{plan.headroom:g}"]
    return " ".join(words)


def check_device(plan: Plan, device: DeviceInfo, *, source: str = "<plan>") -> None:
    planned = plan.device
    if planned is None:
        return
    for field in ("kind", "name", "total_bytes"):
        was, now = getattr(planned, field), getattr(device, field)
        if was != now:
            warnings.warn(f"plan file {source} was made on another device: device.{field} was "
                          f"{was!r}, now {now!r}; its micro-batch may not fit here (re-plan to be "
                          f"sure)", PlanFileWarning, stacklevel=3)
            return


# --- a validator for the subset of JSON Schema that plan.schema.json uses ---------------------------

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def first_schema_error(value, schema: dict, *, root: dict | None = None, where: str = "") -> str | None:
    """The first way ``value`` breaks ``schema``, naming the field (None when it conforms)."""
    root = root if root is not None else schema
    name = where or "the top level"
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return first_schema_error(value, target, root=root, where=where)
    if "oneOf" in schema:
        errors = [first_schema_error(value, s, root=root, where=where) for s in schema["oneOf"]]
        matched = errors.count(None)
        if matched == 1:
            return None
        if matched > 1:
            return f"field {name} matches more than one allowed form"
        # "must be null" says little about a value that is not null: report the other branch.
        telling = [e for s, e in zip(schema["oneOf"], errors) if s != {"type": "null"}]
        return (telling or errors)[0]
    if "const" in schema and value != schema["const"]:
        return f"field {name} must be {schema['const']!r}, got {value!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"field {name} must be one of {schema['enum']}, got {value!r}"
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            return f"field {name} must be {' or '.join(types)}, got {type(value).__name__} {value!r}"[:300]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"field {name} must be at least {schema['minimum']}, got {value!r}"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return f"field {name} must be more than {schema['exclusiveMinimum']}, got {value!r}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"field {name} must be at most {schema['maximum']}, got {value!r}"
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            return f"field {name} must be less than {schema['exclusiveMaximum']}, got {value!r}"
    if isinstance(value, str) and "pattern" in schema and not re.fullmatch(schema["pattern"], value):
        return f"field {name} must match {schema['pattern']}, got {value[:80]!r}"
    if isinstance(value, dict):
        return _object_error(value, schema, root, where)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return f"field {name} needs at least {schema['minItems']} item(s), got {len(value)}"
        if "items" in schema:
            for i, item in enumerate(value):
                problem = first_schema_error(item, schema["items"], root=root, where=f"{where}[{i}]")
                if problem:
                    return problem
    return None


def _object_error(value: dict, schema: dict, root: dict, where: str) -> str | None:
    prefix = f"{where}." if where else ""
    for key in schema.get("required", []):
        if key not in value:
            return f"missing field {prefix}{key}"
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        sub = properties.get(key, extra if isinstance(extra, dict) else None)
        if sub is not None:
            problem = first_schema_error(item, sub, root=root, where=f"{prefix}{key}")
            if problem:
                return problem
    return None
