"""Hostile and clumsy inputs (issue 14): no code runs from data, no file is harmed by an output,
no training on garbage passes quietly. docs/testing.md lists every case tried and its result."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from autotune.errors import OutputError
from autotune.planning.planfile import save_plan
from autotune.training import TrainError, train
from test_train_errors import MODEL_FILE, _plan_file
from train_helpers import make_plan, mlp_workload


class _RunsCode:
    """A pickled object whose unpickling calls a function: here it only creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_never_unpickles_code_from_a_checkpoint(tmp_path):
    first = train(make_plan([4]), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    state = torch.load(first.checkpoint, weights_only=True)  # what autotune writes loads as data
    marker = tmp_path / "code-ran"
    state["evil"] = _RunsCode(marker)
    torch.save(state, first.checkpoint)
    with pytest.raises(TrainError, match="not loaded, so none of its code ran"):
        train(make_plan([4]), mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True,
              progress=False)
    assert not marker.exists()


def test_resume_never_unpickles_code_from_a_sharded_checkpoint(tmp_path):
    import dataclasses

    from autotune.training.sharded_checkpoint import STATE_NAME

    plan = dataclasses.replace(make_plan([4]), sharding="fsdp")  # one process, in-process group
    train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    (state_file,) = tmp_path.glob(f"step-*/{STATE_NAME}")
    state = torch.load(state_file, weights_only=True)  # the train state loads as data
    marker = tmp_path / "code-ran"
    state["evil"] = _RunsCode(marker)
    torch.save(state, state_file)
    with pytest.raises(TrainError, match="not loaded, so none of its code ran"):
        train(plan, mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert not marker.exists()


def _cli(*args, **kwargs):
    from click.testing import CliRunner

    from autotune.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args], **kwargs)


def test_verify_checks_the_model_files_hash_before_importing_it(tmp_path, examples_dir):
    import dataclasses
    import hashlib

    from autotune.planning.planfile import save_plan

    model = tmp_path / "model.py"
    original = (examples_dir / "mlp.py").read_bytes()
    plan = make_plan([4], sha=hashlib.sha256(original).hexdigest())
    plan.workload = dataclasses.replace(plan.workload, source=str(model))
    save_plan(plan, tmp_path / "plan.json")
    marker = tmp_path / "code-ran"
    model.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                     + original.decode())  # the plan names this file; someone changed it
    result = _cli("verify", tmp_path / "plan.json", "--device", "cpu", "--memory-limit", "64MiB")
    assert result.exit_code == 1
    assert "was not imported" in result.output and "another version of the model" in result.output
    assert not marker.exists()


# -- 1. outputs never destroy what is at the path -------------------------------------------------
@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE)
    return path


def _null_device(path):
    """A character device node like /dev/null, made in a temporary folder (needs root)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


def test_outputs_write_through_a_device_node_never_replace_it(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    device = _null_device(tmp_path / "null")
    assert _cli("export", plan, "--to", "hf", "-o", device).exit_code == 0
    save_plan(make_plan([4]), device)
    result = _cli("train", model_file, "--plan", plan, "--steps", "1", "--save", device,
                  "--metrics", device)
    assert result.exit_code == 0, result.output
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_a_fifo_output_is_written_through(tmp_path):
    import json
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    save_plan(make_plan([4]), fifo)
    reader.join(timeout=30)
    assert json.loads(received[0])["micro_batches"] == [4]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_symlink_output_is_refused_and_neither_link_nor_target_changes(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    for args in (("export", plan, "--to", "hf", "-o", link),
                 ("plan", model_file, "--target-batch", "8", "-o", link),
                 ("train", model_file, "--plan", plan, "--steps", "1", "--save", link),
                 ("train", model_file, "--plan", plan, "--steps", "1", "--metrics", link)):
        result = _cli(*args)
        assert result.exit_code == 1 and "is a symlink to" in result.output, (args, result.output)
    assert link.is_symlink() and target.read_text() == "keep me"


def test_no_output_replaces_an_input_of_the_same_command(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    model_text, plan_text = model_file.read_text(), plan.read_text()
    for args, name in ((("plan", model_file, "--target-batch", "8", "-o", model_file), "MODEL_FILE"),
                       (("train", model_file, "--plan", plan, "--steps", "1", "--save", model_file),
                        "model file"),
                       (("train", model_file, "--plan", plan, "--steps", "1", "--metrics", plan),
                        "--plan"),
                       (("export", plan, "--to", "hf", "-o", plan), "PLAN_FILE"),
                       (("verify", plan, "--device", "cpu", "-o", plan), "PLAN_FILE")):
        result = _cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert f"this command's own {name}" in result.output, result.output
    assert model_file.read_text() == model_text and plan.read_text() == plan_text


def test_a_checkpoint_dir_with_a_checkpoint_needs_resume_or_overwrite(tmp_path, model_file):
    plan = _plan_file(tmp_path, model_file)
    folder = tmp_path / "ckpt"
    train_args = ("train", model_file, "--plan", plan, "--checkpoint-dir", folder)
    assert _cli(*train_args, "--steps", "3").exit_code == 0
    result = _cli(*train_args, "--steps", "1")
    assert result.exit_code == 1 and "--resume" in result.output and "--overwrite" in result.output
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["step"] == 3  # kept
    assert _cli(*train_args, "--steps", "1", "--overwrite").exit_code == 0
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["step"] == 1


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_umask_default(tmp_path):
    existing = tmp_path / "plan.json"
    existing.write_text("{}")
    existing.chmod(0o640)
    save_plan(make_plan([4]), existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640
    umask = os.umask(0o027)
    try:
        save_plan(make_plan([4]), tmp_path / "new.json")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    import socket
    import subprocess
    import sys

    host = socket.gethostname().replace(".", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f".plan.json.{host}-{dead}.x1y2.tmp"
    live = tmp_path / f".plan.json.{host}-{os.getpid()}.a1b2.tmp"  # a writer still at work
    other = tmp_path / ".other.json.tmp"
    for path in (stale, live, other):
        path.write_bytes(b"half")
    save_plan(make_plan([4]), tmp_path / "plan.json")
    assert not stale.exists() and live.exists() and other.exists()


# -- 5. no training on garbage ---------------------------------------------------------------------
def _poisoned_from(call, value):
    calls = {"n": 0}

    def loss_fn(model, batch):
        from train_helpers import mean_loss

        calls["n"] += 1
        loss = mean_loss(model, batch)
        return loss * value if calls["n"] >= call else loss
    return loss_fn


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, value):
    # micro-batches [4]: one forward per step, so call 3 is step 3.
    workload = mlp_workload(32, loss_fn=_poisoned_from(3, value))
    with pytest.raises(TrainError, match=r"step 3: the (loss|gradient norm) is (nan|inf).*"
                                         r"last good checkpoint.*\(step 2\)"):
        train(make_plan([4]), workload, steps=6, checkpoint_dir=tmp_path, checkpoint_every=1,
              progress=False)
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 2
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


def test_cli_non_finite_loss_is_exit_1(tmp_path, model_file):
    poisoned = tmp_path / "nan_model.py"
    poisoned.write_text(MODEL_FILE + "\nBASE = loss_fn\ndef loss_fn(model, batch):\n"
                                     "    return BASE(model, batch) * float('nan')\n")
    plan = _plan_file(tmp_path, poisoned)
    result = _cli("train", poisoned, "--plan", plan, "--steps", "3")
    assert result.exit_code == 1 and "step 1: the loss is nan" in result.output, result.output


@pytest.mark.parametrize("count, message", [
    (0, "sum to 0 over the window"),
    (torch.tensor(-3), "sum to -3 over the window"),
    (-2, "item_count -2"),
    ("12", "item_count a str"),
])
def test_bad_item_counts_get_the_model_file_contracts_error(count, message):
    from autotune.errors import WorkloadError
    from train_helpers import mean_loss

    workload = mlp_workload(16, loss_fn=lambda model, batch: (mean_loss(model, batch), count))
    with pytest.raises(WorkloadError, match=message):
        train(make_plan([4]), workload, steps=1, progress=False)


def test_a_detached_loss_is_named_as_the_loss_fns_fault():
    from autotune.errors import WorkloadError
    from train_helpers import mean_loss

    workload = mlp_workload(16, loss_fn=lambda model, batch: mean_loss(model, batch).detach())
    with pytest.raises(WorkloadError, match="loss from loss_fn does not require grad"):
        train(make_plan([4]), workload, steps=1, progress=False)


def test_divergence_is_warned_once(capsys):
    workload = mlp_workload(32, loss_fn=_poisoned_from(3, 50.0))  # the loss jumps 50x at step 3
    result = train(make_plan([4]), workload, steps=5)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "divergent" in line]
    assert len(warnings) == 1 and "at step 3" in warnings[0] and result.steps == 5


def test_fp16_skips_a_non_finite_step_but_stops_when_every_step_is_skipped(monkeypatch):
    from autotune.training import loop

    monkeypatch.setattr(loop, "MAX_SKIPS_IN_A_ROW", 3)
    workload = mlp_workload(64, dtype=torch.float32, loss_fn=_poisoned_from(3, float("nan")))
    with pytest.raises(TrainError, match="step 5: fp16's GradScaler skipped 3 steps in a row"):
        train(make_plan([4], precision="fp16"), workload, steps=8, device="cpu", progress=False)


# -- 4. numbers are checked where they enter -------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_cli_base_lr_must_be_finite(tmp_path, examples_dir, value):
    out = tmp_path / "plan.json"
    result = _cli("plan", examples_dir / "mlp.py", "--target-batch", "8", "--device", "cpu",
                  "--memory-limit", "64MiB", f"--base-lr={value}", "--base-batch", "8", "-o", out)
    assert result.exit_code == 2 and "--base-lr" in result.output, result.output
    assert not out.exists()


def test_a_model_files_nan_base_lr_is_refused(tmp_path):
    from autotune.errors import WorkloadError
    from autotune.workload.contract import load_workload

    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE + "\nBASE_LR = float('nan')\nBASE_BATCH = 8\n")
    with pytest.raises(WorkloadError, match="BASE_LR must be a finite number"):
        load_workload(path)


def test_a_plan_never_holds_nan_as_json():
    from autotune.planning.planfile import plan_to_json

    plan = make_plan([4], lr=float("nan"))  # only a hand-built Plan can hold it
    with pytest.raises(ValueError):
        plan_to_json(plan)


_EDITS = {
    "negative lr": (lambda d: d["lr"].__setitem__("lr", -5), "lr.lr must be more than 0"),
    "huge micro-batch": (lambda d: d.update(micro_batches=[10**9], target_batch=10**9),
                         "must be at most 16777216"),
    "NaN headroom": (lambda d: d.update(headroom="__NaN__"), "holds NaN"),
    "Infinity lr": (lambda d: d["lr"].__setitem__("lr", "__Infinity__"), "holds Infinity"),
    "boolean schema_version": (lambda d: d.update(schema_version=True), "schema_version True"),
    "null sha of a file": (lambda d: d["workload"].update(file_sha256=None, source="model.py"),
                           "file_sha256 is null"),
    "not a sha": (lambda d: d["workload"].update(file_sha256="abc"), "must match"),
    "negative clip": (lambda d: d.update(clip_grad_norm=-1), "clip_grad_norm must be more than 0"),
    "counts longer than the batch": (lambda d: d.update(micro_batches={"sizes": [1], "counts": [10**12]}),
                                     "accumulation steps, more than target_batch"),
}


@pytest.mark.parametrize("edit", list(_EDITS), ids=list(_EDITS))
def test_a_hand_edited_plan_with_garbage_numbers_is_refused(tmp_path, edit):
    import json

    from autotune.errors import PlanFileError
    from autotune.planning.planfile import load_plan

    path = tmp_path / "plan.json"
    save_plan(make_plan([4, 4], lr=0.1, clip=1.0, sha="0" * 64), path)
    data = json.loads(path.read_text())
    change, message = _EDITS[edit]
    change(data)
    path.write_text(json.dumps(data).replace('"__NaN__"', "NaN").replace('"__Infinity__"', "Infinity"))
    with pytest.raises(PlanFileError, match=message):
        load_plan(path)
    shown = _cli("show", path)
    assert shown.exit_code == 1 and message.split()[0] in shown.output


def test_long_uneven_splits_are_stored_as_sizes_with_counts_and_older_lists_still_load(tmp_path):
    import json

    from autotune.planning.planfile import load_plan

    split = [13] * 400 + [12]
    plan = make_plan(split)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert data["micro_batches"] == {"sizes": [13, 12], "counts": [400, 1]}
    assert path.stat().st_size < 4000
    assert load_plan(path).micro_batches == split
    data["micro_batches"] = split  # as older files (and short splits) hold it
    path.write_text(json.dumps(data))
    assert load_plan(path).micro_batches == split
    assert "13 × 400 + 12" in _cli("show", path).output


def test_a_target_batch_past_the_bound_is_a_usage_error(tmp_path, examples_dir):
    result = _cli("plan", examples_dir / "mlp.py", "--target-batch", str(10**12), "--device", "cpu",
                  "--memory-limit", "64MiB", "-o", tmp_path / "plan.json")
    assert result.exit_code == 2 and "more than 16777216" in result.output, result.output


@pytest.mark.parametrize("limit, message", [("1e30", "more than this machine's"),
                                            ("inf", "not a size"), ("nan", "not a size")])
def test_a_cpu_budget_must_be_finite_and_within_physical_memory(examples_dir, limit, message):
    result = _cli("probe", examples_dir / "mlp.py", "--device", "cpu", "--memory-limit", limit)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e400])
def test_a_non_finite_size_from_python_is_a_config_error(value):
    from autotune.errors import ConfigError
    from autotune.units import parse_bytes

    with pytest.raises(ConfigError, match="not a finite size"):
        parse_bytes(value)


def test_a_gpu_profile_with_absurd_memory_is_refused(tmp_path):
    from autotune.errors import ConfigError
    from autotune.gpus.catalog import bundled_profiles_dir, load_profile

    text = (bundled_profiles_dir() / "a100-40gb.toml").read_text()
    import re

    path = tmp_path / "huge.toml"
    path.write_text(re.sub(r"(?m)^memory_bytes\s*=.*$", f"memory_bytes = {10**27}", text))
    with pytest.raises(ConfigError, match="memory_bytes .* is invalid"):
        load_profile(path)


# -- 6. resume checks the checkpoint against the plan and the model --------------------------------
def test_resume_under_a_plan_with_another_lr_is_refused(tmp_path):
    train(make_plan([4], lr=0.1), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(TrainError, match="the LR was 0.1 when checkpoint .* is 0.2 now"):
        train(make_plan([4], lr=0.2), mlp_workload(16), steps=2, checkpoint_dir=tmp_path,
              resume=True, progress=False)


def test_resume_after_the_model_file_changed_names_it(tmp_path, model_file):
    first = _plan_file(tmp_path, model_file)
    folder = tmp_path / "ckpt"
    assert _cli("train", model_file, "--plan", first, "--steps", "1",
                "--checkpoint-dir", folder).exit_code == 0
    model_file.write_text(MODEL_FILE.replace("nn.Linear(4, 2)", "nn.Linear(4, 3)"))
    second = _plan_file(tmp_path, model_file)  # re-planned for the edited model
    result = _cli("train", model_file, "--plan", second, "--steps", "2", "--checkpoint-dir", folder,
                  "--resume")
    assert result.exit_code == 1 and "the model file's sha256 was" in result.output, result.output
    assert "Traceback" not in result.output


def test_resume_into_a_model_of_other_shapes_is_a_train_error(tmp_path):
    import torch.nn as nn

    train(make_plan([4]), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    other = mlp_workload(16, model=lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Dropout(0.0),
                                                         nn.Linear(5, 3)).double())
    with pytest.raises(TrainError, match="holds another model's weights"):
        train(make_plan([4]), other, steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)


def test_a_checkpoint_missing_keys_is_a_train_error(tmp_path):
    first = train(make_plan([4]), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    state = torch.load(first.checkpoint, weights_only=True)
    del state["split"]
    torch.save(state, first.checkpoint)
    with pytest.raises(TrainError, match="lacks split"):
        train(make_plan([4]), mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True,
              progress=False)


# -- 8. output locations are checked before the work -----------------------------------------------
def test_outputs_in_missing_or_impossible_folders_fail_before_any_work(tmp_path, model_file, monkeypatch):
    import autotune.orchestration.planner as planning_api

    def no_probing(*args, **kwargs):
        raise AssertionError("planned although the output cannot be written")

    monkeypatch.setattr(planning_api, "plan", no_probing)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    # Training would write "trained" beside the model; nothing may run that far.
    marker = tmp_path / "trained"
    model_file.write_text(MODEL_FILE.replace(
        "def loss_fn(model, batch):",
        f"def loss_fn(model, batch):\n    open({str(marker)!r}, 'w').close()"))
    plan = _plan_file(tmp_path, model_file)
    for args, option in ((("plan", model_file, "--target-batch", "8", "-o", tmp_path / "missing" / "p.json"), "-o"),
                         (("export", plan, "--to", "hf", "-o", tmp_path / "missing" / "hf.json"), "-o"),
                         (("train", model_file, "--plan", plan, "--steps", "1", "--save", a_file / "m.pt"), "--save"),
                         (("train", model_file, "--plan", plan, "--steps", "1", "--metrics", a_file / "m.jsonl"), "--metrics"),
                         (("train", model_file, "--plan", plan, "--steps", "1", "--checkpoint-dir", a_file / "c"), "--checkpoint-dir")):
        result = _cli(*args)
        assert result.exit_code == 1 and result.output.startswith(f"Error: {option} "), (args, result.output)
        assert "does not exist" in result.output or "is a file, not a folder" in result.output
    assert not marker.exists()
    assert not (tmp_path / "missing").exists()


def test_a_save_that_fails_after_training_says_where_the_model_is(tmp_path):
    from autotune.training import save_model

    result = train(make_plan([4]), mlp_workload(16), steps=2, checkpoint_dir=tmp_path / "ckpt",
                   progress=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OutputError, match=r"--save .*; the trained model is in the last checkpoint, .*checkpoint.pt"):
        save_model(result, blocker / "model.pt")


def test_a_full_disk_is_one_line_and_the_old_file_stays(tmp_path):
    import errno

    from autotune.files.outputs import write_atomic

    path = tmp_path / "plan.json"
    path.write_text("old")

    def fill(handle):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match="could not be written \\(No space left on device\\)") as caught:
        write_atomic(path, fill)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


# -- 9. messages where tracebacks were --------------------------------------------------------------
def _train_args(tmp_path, model_file):
    return ("train", model_file, "--plan", _plan_file(tmp_path, model_file), "--steps", "1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_train_on_cuda_without_cuda_is_a_usage_error(tmp_path, model_file):
    result = _cli(*_train_args(tmp_path, model_file), "--device", "cuda")
    assert result.exit_code == 2 and "sees no CUDA device" in result.output, result.output


@pytest.mark.parametrize("seed", [str(2**70), "-1"])
def test_an_overflowing_seed_is_a_usage_error(tmp_path, model_file, seed):
    result = _cli(*_train_args(tmp_path, model_file), f"--seed={seed}")
    assert result.exit_code == 2 and "--seed" in result.output, result.output


def test_a_bad_world_size_variable_is_a_usage_error(tmp_path, model_file):
    result = _cli(*_train_args(tmp_path, model_file), env={"WORLD_SIZE": "abc"})
    assert result.exit_code == 2 and "WORLD_SIZE='abc'" in result.output, result.output


@pytest.mark.parametrize("storage", ["bogus", "http://example.invalid/x", "sqlite:///missing/dir/x.db"])
def test_a_bad_storage_url_is_a_usage_error_before_any_probing(tmp_path, examples_dir, storage, monkeypatch):
    import autotune.orchestration.planner as planning_api

    def no_probing(*args, **kwargs):
        raise AssertionError("probed before opening the storage")

    monkeypatch.setattr(planning_api, "_probe_setting", no_probing)
    monkeypatch.chdir(tmp_path)
    result = _cli("plan", examples_dir / "mlp.py", "--target-batch", "8", "--device", "cpu",
                  "--memory-limit", "64MiB", "--optimize", "throughput", "--storage", storage)
    assert result.exit_code == 2 and "--storage" in result.output and "cannot be opened" in result.output


@pytest.mark.parametrize("option", [("--budget", "10s"), ("--storage", "sqlite:///x.db")])
def test_throughput_options_without_optimize_throughput_are_usage_errors(tmp_path, examples_dir, option):
    result = _cli("plan", examples_dir / "mlp.py", "--target-batch", "8", *option, "-o", tmp_path / "p.json")
    assert result.exit_code == 2 and "--optimize throughput" in result.output


def test_a_model_file_that_calls_sys_exit_is_named(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(3)\n")
    result = _cli("probe", path)
    assert result.exit_code == 1 and "called sys.exit(3)" in result.output


def test_prints_from_the_model_file_do_not_break_json(tmp_path, examples_dir):
    import json

    path = tmp_path / "chatty.py"
    path.write_text("print('hello from the model file')\n" + (examples_dir / "mlp.py").read_text()
                    .replace("def make_batch(", "def make_batch(*a, **k):\n    print('batch!')\n"
                                                "    return _make_batch(*a, **k)\n\n\ndef _make_batch("))
    result = _cli("estimate", path, "--micro-batch", "4", "--json")
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)) == ["4"]
    assert "hello from the model file" in result.stderr


def test_a_shape_bug_is_not_preceded_by_torchs_fake_tensor_log(tmp_path, capfd):
    from autotune.probing.estimate import estimate_peak

    path = tmp_path / "shapes.py"
    path.write_text("import torch\nfrom torch import nn\n\ndef build_model():\n"
                    "    return nn.Sequential(nn.Linear(8, 16), nn.Linear(17, 2))\n\n"
                    "def make_batch(n):\n    return torch.randn(n, 8)\n\n"
                    "def loss_fn(model, batch):\n    return model(batch).sum()\n")
    from autotune.errors import StepError

    with pytest.raises(StepError, match="same reduction dim") as caught:
        estimate_peak(str(path), 4)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "failed while attempting to run meta" not in capfd.readouterr().err


# -- 7 (and issue 12.3). a module instance probes as its model file does -----------------------------
def _as_instance(workload):
    import dataclasses

    torch.manual_seed(0)
    return dataclasses.replace(workload, model=workload.model(), source="<instance>", file_sha256=None)


@pytest.mark.parametrize("example, limit", [("mlp.py", "64MiB"),
                                            pytest.param("tiny_lm.py", "32MiB", marks=pytest.mark.slow)])
def test_an_instance_gets_the_answer_of_its_model_file(examples_dir, one_thread, example, limit):
    import autotune
    from autotune.workload.contract import load_workload

    workload = load_workload(examples_dir / example)
    from_file = autotune.probe(workload, device="cpu", memory_limit=limit)
    instance = _as_instance(workload)
    before = {k: v.clone() for k, v in instance.model.state_dict().items()}
    from_instance = autotune.probe(instance, device="cpu", memory_limit=limit)
    assert from_instance.max_micro_batch == from_file.max_micro_batch
    assert [t.baseline_bytes for t in from_instance.trials] == [t.baseline_bytes for t in from_file.trials]
    after = instance.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the user's weights restored


_GPT2_FILE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def make_batch(n):
    ids = torch.randint(0, 1000, (n, 64), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": ids}
'''


@pytest.mark.slow  # about 12 s of out-of-memory trials
def test_a_checkpointed_gpt2_instance_gets_its_files_answer_after_out_of_memory_trials(tmp_path, one_thread):
    pytest.importorskip("transformers")
    import autotune
    from autotune.workload.contract import load_workload

    path = tmp_path / "gpt2_tiny.py"
    path.write_text(_GPT2_FILE)
    workload = load_workload(path)
    # Real trials only, so the search runs out of memory (in backward) on its way to the answer.
    options = dict(device="cpu", memory_limit="48MiB", checkpointing=True, use_estimate=False)
    from_file = autotune.probe(workload, **options)
    from_instance = autotune.probe(_as_instance(workload), **options)
    assert any(not t.fits for t in from_file.trials)
    for result in (from_file, from_instance):  # a failed trial leaves nothing counted behind
        assert len({t.baseline_bytes for t in result.trials}) == 1, result.trials
    assert from_instance.max_micro_batch == from_file.max_micro_batch
    assert from_file.max_micro_batch == autotune.probe(workload, device="cpu", memory_limit="48MiB",
                                                       checkpointing=True).max_micro_batch
