"""Checkpoint folders a hostile or clumsy user (or a crashed rank) hands to autotune (issue 25):
no code runs from a sharded checkpoint, only autotune's own step folders are ever removed, one run
per folder, torchrun's restarts continue what their run wrote, and tampered fields are named."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autotune.errors import OutputError
from autotune.planning.planfile import save_plan
from autotune.training import TrainError, train
from autotune.training.checkpoint_lock import LOCK_NAME
from autotune.training.sharded_checkpoint import MARKER_NAME, STATE_NAME
from test_train_errors import _plan_file
from train_helpers import make_plan, mlp_workload, params_of, relative_error

TESTS = Path(__file__).resolve().parent


class _RunsCode:
    """Unpickling it runs ``exec``: here the code only creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _sharded(micro_batches=(4,)):
    return dataclasses.replace(make_plan(list(micro_batches), lr=0.1), sharding="fsdp")


def _torchrun_env(monkeypatch, count, run_id="run-1"):
    for name, value in (("TORCHELASTIC_RUN_ID", run_id), ("TORCHELASTIC_MAX_RESTARTS", "1"),
                        ("TORCHELASTIC_RESTART_COUNT", str(count))):
        monkeypatch.setenv(name, value)


def _armed(tmp_path):
    """The planted pickle does run code when plain pickle loads it (so the tests below mean it)."""
    marker = tmp_path / "armed"
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.exists()


# -- 1. no code from a sharded checkpoint --------------------------------------------------------
def _cli_model_and_plan(tmp_path, sharding="fsdp"):
    from test_train_errors import MODEL_FILE

    model = tmp_path / "model.py"
    model.write_text(MODEL_FILE)
    plan = _plan_file(tmp_path, model, micro_batches=(4,))
    data = json.loads(plan.read_text())
    data["sharding"] = sharding
    plan.write_text(json.dumps(data))
    return model, plan


def _cli(*args):
    from click.testing import CliRunner

    from autotune.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _write_then_read(how, tmp_path, monkeypatch, plant):
    """Write a 1-step sharded checkpoint, ``plant(folder)`` into it, then read it ``how``: every
    way autotune reads one (train --resume, train(resume=True), torchrun's restart).
    Returns the error raised (a ``TrainError``) or the CLI's output."""
    folder = tmp_path / "c"
    if how == "cli":
        model, plan = _cli_model_and_plan(tmp_path)
        assert _cli("train", model, "--plan", plan, "--steps", 1, "--checkpoint-dir", folder).exit_code == 0
        (step,) = folder.glob("step-*")
        plant(step)
        out = _cli("train", model, "--plan", plan, "--steps", 2, "--checkpoint-dir", folder, "--resume")
        assert out.exit_code == 1, out.output
        return out.output
    if how == "restart":
        _torchrun_env(monkeypatch, 0)
    train(_sharded(), mlp_workload(16), steps=1, checkpoint_dir=folder, progress=False)
    (step,) = folder.glob("step-*")
    plant(step)
    if how == "restart":  # the same command, relaunched by torchrun: it resumes by itself
        _torchrun_env(monkeypatch, 1)
    with pytest.raises(TrainError) as error:
        train(_sharded(), mlp_workload(16), steps=2, checkpoint_dir=folder, resume=how == "api",
              progress=False)
    return str(error.value)


@pytest.mark.parametrize("how", ["api", "cli", "restart"])
def test_a_pickle_planted_as_sharded_metadata_never_runs(tmp_path, monkeypatch, how):
    _armed(tmp_path)
    marker = tmp_path / "code-ran"

    def plant(step):
        (step / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))

    message = _write_then_read(how, tmp_path, monkeypatch, plant)
    assert not marker.exists()
    assert "holds objects other than the ones torch.distributed.checkpoint writes (builtins.exec)" in message
    assert "it was not loaded, so none of its code ran" in message


def test_a_pickle_planted_among_a_shard_files_values_never_runs(tmp_path, monkeypatch):
    """DCP keeps non-tensor values (the optimizer's param_groups) as pickles in the shard files
    and loads them with weights_only=False; the metadata may point any of them at any bytes."""
    marker = tmp_path / "code-ran"

    def plant(step):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        with open(step / ".metadata", "rb") as handle:
            metadata = pickle.load(handle)  # written by this test's own run
        evil = step / "evil.distcp"
        torch.save(_RunsCode(marker), evil)
        lr_items = [index for index in metadata.storage_data
                    if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
        assert lr_items  # param_groups values are stored as bytes
        for index in lr_items:
            metadata.storage_data[index] = dataclasses.replace(
                metadata.storage_data[index], relative_path=evil.name, offset=0, length=evil.stat().st_size)
        (step / ".metadata").write_bytes(pickle.dumps(metadata))

    message = _write_then_read("api", tmp_path, monkeypatch, plant)
    assert not marker.exists()
    assert "holds objects other than the ones torch.distributed.checkpoint writes" in message
    assert "none of its code ran" in message


def test_a_sharded_checkpoint_still_resumes_to_the_parameters_of_an_uninterrupted_run(tmp_path):
    """The restricted reader reads what DCP writes (the optimizer's values included)."""
    plan = dataclasses.replace(_sharded((4, 4)), lr=dataclasses.replace(_sharded().lr, lr=0.05))
    whole = train(plan, mlp_workload(32, optimizer="adamw"), steps=3, progress=False)
    train(plan, mlp_workload(32, optimizer="adamw"), steps=1, checkpoint_dir=tmp_path, progress=False)
    resumed = train(plan, mlp_workload(32, optimizer="adamw"), steps=3, checkpoint_dir=tmp_path,
                    resume=True, progress=False)
    from autotune.distributed.sharding.wrap import full_state_dict

    a, b = full_state_dict(whole.model), full_state_dict(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("damage, expected", [
    ("truncate-shard", "cannot be read (rank 0: "),
    ("garbage-metadata", "is damaged (UnpicklingError"),
    ("pointer-escapes", "names the folder '../elsewhere', not a step-NNNNNNNN folder"),
], ids=["truncated-shard", "garbage-metadata", "pointer-escapes"])
def test_a_damaged_sharded_checkpoint_is_a_train_error(tmp_path, damage, expected):
    train(_sharded(), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    (step,) = tmp_path.glob("step-*")
    if damage == "truncate-shard":
        (shard,) = step.glob("*.distcp")
        shard.write_bytes(shard.read_bytes()[:40])
    elif damage == "garbage-metadata":
        (step / ".metadata").write_bytes(b"\x80\x05garbage")
    else:
        pointer = json.loads((tmp_path / "checkpoint.json").read_text())
        (tmp_path / "checkpoint.json").write_text(json.dumps({**pointer, "folder": "../elsewhere"}))
    with pytest.raises(TrainError, match="resume=True: .*" + expected.replace("(", r"\(")):
        train(_sharded(), mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)


# -- 2. only autotune's own step folders are removed --------------------------------------------
USER_FOLDERS = ("step-by-step-notes", ".step-notes", "step-00000001-mine", "step-00000002.tmp", "..step-3",
                "step-5", "step-000000001")


def test_sharded_checkpoints_remove_only_the_step_folders_autotune_wrote(tmp_path):
    for name in USER_FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    (tmp_path / ".step-00000009").write_text("a file named like a step folder")
    train(_sharded(), mlp_workload(16), steps=3, checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    for name in USER_FOLDERS:
        assert (tmp_path / name / "notes.txt").read_text() == "mine"
    assert (tmp_path / ".step-00000009").read_text() == "a file named like a step folder"
    ours = sorted(p.name for p in tmp_path.iterdir() if (p / MARKER_NAME).is_file())
    assert ours == ["step-00000003"]  # the checkpoints of steps 1 and 2 were removed


@pytest.mark.parametrize("name", ["step-00000002", ".step-00000002.tmp"])
def test_a_folder_named_exactly_like_a_step_folder_is_refused_before_training(tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=f"holds {name}, which is named as autotune names its step folders "
                                          f"but was not written by it"):
        train(_sharded(), mlp_workload(16), steps=3, checkpoint_dir=tmp_path, checkpoint_every=1,
              progress=False)
    assert (tmp_path / name / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "checkpoint.json").exists()


# -- 4. one run per checkpoint folder ------------------------------------------------------------
@pytest.fixture
def other_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def _lock(folder, **fields):
    folder.mkdir(exist_ok=True)
    record = {"pid": 1, "host": socket.gethostname().replace(".", "_"), "started": "2026-01-01T00:00:00+00:00",
              "command": "autotune train other.py", **fields}
    (folder / LOCK_NAME).write_text(json.dumps(record))
    return record


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_first(tmp_path, other_process, sharded):
    plan = _sharded() if sharded else make_plan([4], lr=0.1)
    _lock(tmp_path, pid=other_process.pid)
    for resume in (False, True):
        with pytest.raises(TrainError, match=f"checkpoint_dir {tmp_path} is in use by another run: pid "
                                             f"{other_process.pid} on .*, started 2026-01-01T00:00:00.* "
                                             f"\\(autotune train other.py\\)"):
            train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path, resume=resume, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing written


def test_a_lock_on_another_host_is_refused_and_the_message_says_how_to_clear_it(tmp_path):
    _lock(tmp_path, pid=os.getpid(), host="some-other-node")
    with pytest.raises(TrainError, match=f"pid {os.getpid()} on some-other-node.*if that run is gone.*delete "
                                         f"{tmp_path / LOCK_NAME}"):
        train(make_plan([4], lr=0.1), mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)


def test_stale_locks_are_taken_over_and_the_lock_is_removed_at_the_end(tmp_path, other_process):
    plan = make_plan([4], lr=0.1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    cases = [dict(pid=int(dead)),                                       # its process is gone
             dict(pid=other_process.pid, process_start=1),              # its pid runs another program
             dict(pid=12345, host="n", run_id="job-7", restart=0)]      # torchrun's restart of its run
    for i, fields in enumerate(cases):
        folder = tmp_path / str(i)
        _lock(folder, **fields)
        with pytest.MonkeyPatch.context() as env:
            if "run_id" in fields:
                _torchrun_env(env, 1, run_id="job-7")
            train(plan, mlp_workload(16), steps=1, checkpoint_dir=folder, progress=False)
        assert not (folder / LOCK_NAME).exists()


def test_the_lock_is_held_while_training(tmp_path):
    seen = []

    def loss(model, batch):
        seen.append(json.loads((tmp_path / LOCK_NAME).read_text()))
        from train_helpers import mean_loss

        return mean_loss(model, batch)

    train(make_plan([4], lr=0.1), mlp_workload(16, loss_fn=loss), steps=1, checkpoint_dir=tmp_path,
          progress=False)
    assert seen and seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname().replace(".", "_")
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_checkpoint_written_by_a_run_started_beside_this_one_is_refused_under_the_lock(tmp_path, sharded):
    # Two runs started together: both found the folder empty, the other one trained, wrote its
    # checkpoint and let go of the lock while this one built its dataset; this one then took the
    # lock and started over on top of that checkpoint, without --overwrite.
    plan = _sharded() if sharded else make_plan([4], lr=0.1)
    folder, other = tmp_path / "shared", tmp_path / "other"
    train(plan, mlp_workload(16), steps=1, checkpoint_dir=other, progress=False)
    workload = mlp_workload(16)
    build_dataset = workload.build_dataset

    def other_run_ends_meanwhile():
        shutil.copytree(other, folder, dirs_exist_ok=True)
        return build_dataset()

    workload.build_dataset = other_run_ends_meanwhile
    before = {p.relative_to(other): p.read_bytes() for p in other.rglob("*") if p.is_file()}
    with pytest.raises(OutputError, match=f"checkpoint_dir {folder} already holds a checkpoint"):
        train(plan, workload, steps=2, checkpoint_dir=folder, progress=False)
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert not (folder / LOCK_NAME).exists()


# -- 5. torchrun's restart continues what its run wrote ------------------------------------------
class _FailsOnce(torch.nn.Module):
    """Raises in its ``fail_at``-th forward, as a rank's crash would end the attempt."""

    def __init__(self, fail_at):
        super().__init__()
        from train_helpers import build_mlp

        self.inner, self.calls, self.fail_at = build_mlp(), 0, fail_at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("Connection closed by peer (a rank was killed)")
        return self.inner(x)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_torchrun_restart_resumes_from_its_runs_checkpoint_whatever_the_failure(
        tmp_path, monkeypatch, sharded):
    plan = _sharded((4, 4)) if sharded else make_plan([4, 4], lr=0.1)

    def workload(fail_at=None):
        return mlp_workload(32, model=lambda: _FailsOnce(fail_at))

    reference = train(plan, workload(), steps=3, progress=False)
    common = dict(steps=3, checkpoint_dir=tmp_path / "c", checkpoint_every=1, progress=False)
    _torchrun_env(monkeypatch, 0)
    with pytest.raises(RuntimeError, match="Connection closed"):
        train(plan, workload(fail_at=5), **common)  # step 3's first micro-step
    _torchrun_env(monkeypatch, 1)  # the same command, no --resume
    resumed = train(plan, workload(), **common)
    assert [m["step"] for m in resumed.metrics] == [3]
    from autotune.distributed.sharding.wrap import full_state_dict

    a, b = full_state_dict(reference.model), full_state_dict(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_torchrun_restart_never_resumes_another_runs_checkpoint(tmp_path, monkeypatch):
    plan = make_plan([4], lr=0.1)
    train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)  # not under torchrun
    for count, run_id in ((1, "run-1"), (1, "none")):
        _torchrun_env(monkeypatch, count, run_id=run_id)
        with pytest.raises(OutputError, match="already holds a checkpoint"):
            train(plan, mlp_workload(16), steps=2, checkpoint_dir=tmp_path, progress=False)
    _torchrun_env(monkeypatch, 0, run_id="run-2")  # another torchrun run's checkpoint
    train(plan, mlp_workload(16), steps=2, checkpoint_dir=tmp_path, progress=False, resume=True)
    _torchrun_env(monkeypatch, 1, run_id="run-3")
    with pytest.raises(OutputError, match="already holds a checkpoint"):
        train(plan, mlp_workload(16), steps=3, checkpoint_dir=tmp_path, progress=False)


# -- 6. tampered fields --------------------------------------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(step="abc"), "the field 'step' is 'abc', not a non-negative integer"),
    (lambda s: s.update(step=-5), "the field 'step' is -5, not a non-negative integer"),
    (lambda s: s.update(step=True), "the field 'step' is True"),
    (lambda s: s.update(skipped_steps=9), "the field 'skipped_steps' is 9, more than its step 1"),
    (lambda s: s["rng"][0].update(torch=torch.zeros(3, dtype=torch.uint8)),
     "the field 'rng' is rank 0's random state, which is rejected"),
    (lambda s: s["rng"][0]["python"].update(words=[1, 2]), "the field 'rng' is rank 0's random state"),
    (lambda s: s.update(rng="garbage"), "the field 'rng' is not one random state per rank"),
    (lambda s: s.update(scheduler="garbage"), "the field 'scheduler' cannot be restored"),
    (lambda s: s.update(split={"level": "x"}), "the field 'split' cannot be restored"),
    (lambda s: s.update(data={}), "the field 'data' cannot be restored"),
], ids=["step-text", "step-negative", "step-bool", "skipped-above-step", "rng-tensor", "rng-words", "rng-text",
        "scheduler", "split", "data"])
def test_tampered_checkpoint_fields_are_named(tmp_path, edit, message, sharded):
    plan = _sharded() if sharded else make_plan([4], lr=0.1)
    first = train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    path = next(tmp_path.glob(f"step-*/{STATE_NAME}")) if sharded else first.checkpoint
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    with pytest.raises(TrainError, match=message.replace("(", r"\(")):
        train(plan, mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)


def test_a_tampered_optimizer_state_is_named(tmp_path):
    # It raised torch's ValueError with a traceback ("a different number of parameter groups").
    plan = make_plan([4], lr=0.1)
    first = train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path, progress=False)
    state = torch.load(first.checkpoint, weights_only=True)
    state["optimizer"] = {"state": {}, "param_groups": []}
    torch.save(state, first.checkpoint)
    with pytest.raises(TrainError, match="the field 'optimizer' cannot be restored .*ValueError.*damaged"):
        train(plan, mlp_workload(16), steps=2, checkpoint_dir=tmp_path, resume=True, progress=False)


def test_a_rejected_random_state_leaves_the_processs_own_as_it_was():
    import random

    from autotune.training.checkpoint import check_train_state, rng_state

    saved = {"step": 1, "skipped_steps": 0, "rng": [{**rng_state(), "numpy": {"name": "MT19937"}}]}
    torch.manual_seed(123)
    random.seed(123)
    before = (torch.get_rng_state(), random.getstate())
    with pytest.raises(TrainError, match="the field 'rng' is rank 0's random state, which is rejected"):
        check_train_state(saved, path="ckpt", rank=0)  # torch and random were set before numpy failed
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


@pytest.mark.parametrize("steps", [2, 1])
def test_resume_at_or_past_the_steps_asked_for_says_there_is_nothing_to_train(tmp_path, steps):
    model, plan = _cli_model_and_plan(tmp_path, sharding="ddp")
    folder = tmp_path / "c"
    assert _cli("train", model, "--plan", plan, "--steps", 2, "--checkpoint-dir", folder).exit_code == 0
    written = (folder / "checkpoint.pt").stat().st_mtime_ns
    out = _cli("train", model, "--plan", plan, "--steps", steps, "--checkpoint-dir", folder, "--resume",
               "--save", tmp_path / "final.pt", "--metrics", tmp_path / "m.jsonl")
    assert out.exit_code == 0, out.output
    assert "nan" not in out.output
    # Said once (the loop, on stderr) with the fix, and the summary line says what was done.
    assert out.output.count("nothing to train") == 1, out.output
    assert (f"nothing to train: the checkpoint in {folder} is at step 2 and this run asks for {steps} "
            f"steps in all; give --steps (or --epochs) beyond 2 to train on") in out.output
    assert "trained 0 optimizer steps (the checkpoint is at step 2); its model saved to" in out.output
    assert (folder / "checkpoint.pt").stat().st_mtime_ns == written  # not rewritten
    saved = torch.load(tmp_path / "final.pt", weights_only=True)
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert saved["steps"] == 2
    assert all(torch.equal(saved["model"][k], checkpoint["model"][k]) for k in saved["model"])


# -- under torchrun (slow: a few launches of 2 gloo ranks) ---------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_rank_killed_with_sigkill_is_recovered_by_torchruns_restart(tmp_path, monkeypatch, sharding):
    """kill -9 of rank 1 in step 3 under --max-restarts 1: torchrun relaunches both ranks with the
    same command (no --resume); they continue from the checkpoint of step 2 and end with the
    parameters of an uninterrupted run."""
    from test_train_oom_restart import _plan, _saved, _torchrun

    monkeypatch.setenv("AUTOTUNE_TEST_KILL", "1:5")  # rank 1's 5th forward: step 3, first micro-step
    code, log = _torchrun(tmp_path, "killed", _plan([4, 4], sharding), "--checkpoint-dir", tmp_path / "ckpt",
                          "--checkpoint-every", 1, "--save", tmp_path / "recovered.pt", "--metrics",
                          tmp_path / "metrics.jsonl", max_restarts=1)
    assert code == 0, log[-6000:]
    assert "(exitcode: -9) local_rank: 1" in log, log[-6000:]
    assert "torchrun restart 1: resumed from the checkpoint of step 2 in" in log
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not (tmp_path / "ckpt" / LOCK_NAME).exists()
    monkeypatch.delenv("AUTOTUNE_TEST_KILL")
    code, log = _torchrun(tmp_path, "reference", _plan([4, 4], sharding), "--save", tmp_path / "reference.pt")
    assert code == 0, log[-6000:]
    assert relative_error(_saved(tmp_path / "recovered.pt"), _saved(tmp_path / "reference.pt")) <= 1e-12


@pytest.mark.slow
def test_a_torchrun_run_holds_its_folder_against_a_second_run(tmp_path):
    """Run A (2 ranks, held in its forwards until B is done) holds the lock for its whole run; run B on the same folder is
    refused naming A's rank 0; after A ends the lock is gone and B may continue A's checkpoint."""
    from test_train_oom_restart import MODEL, STEPS, TESTS as HERE, _plan

    plan = save_plan(_plan([4, 4], "ddp"), tmp_path / "plan.json")
    folder = tmp_path / "ckpt"
    # A's forwards wait until B is done: slowed by a fixed time, A once finished first on a busy
    # machine where B took longer to start, and B met no lock.
    b_done = tmp_path / "b_done"
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOTUNE_TEST_WAIT_FOR=str(b_done),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    train_args = ["train", str(MODEL), "--plan", str(plan), "--steps", str(STEPS), "--checkpoint-dir", str(folder)]
    first = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--standalone", "--no-python", sys.executable, "-c",
                              "from autotune.cli import main; main()", *train_args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (folder / LOCK_NAME).exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        while not (folder / LOCK_NAME).read_text().strip() and time.time() < deadline:
            time.sleep(0.05)  # made, its record not written yet
        held = json.loads((folder / LOCK_NAME).read_text())
        second = subprocess.run([sys.executable, "-m", "autotune", *train_args, "--resume"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert first.poll() is None  # A was still running, so the refusal was tested against it
        b_done.touch()
        output, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 1, second.stderr
    assert f"is in use by another run: pid {held['pid']} on {held['host']}, started {held['started']}" \
        in second.stderr
    assert first.returncode == 0, output[-6000:]
    assert not (folder / LOCK_NAME).exists()
    again = subprocess.run([sys.executable, "-m", "autotune", *train_args, "--resume"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "is in use" not in again.stderr  # the plan's 2 ranks, not the lock
    assert "the plan is for world size 2 but this run has 1 process (not started by torchrun or srun)" \
        in again.stderr


def test_overwrite_leaves_a_checkpoint_pt_that_autotune_did_not_write(tmp_path):
    # --overwrite replaced the user's own file of that name (a sharded run's files were refused).
    from autotune.errors import OutputError

    mine = tmp_path / "checkpoint.pt"
    mine.write_text("my precious")
    plan = make_plan([4], lr=0.1)
    with pytest.raises(OutputError, match="is not an autotune checkpoint .* it is left as it is"):
        train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path, overwrite=True, progress=False)
    assert mine.read_text() == "my precious"
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"weights": torch.zeros(2)}, other / "checkpoint.pt")  # a torch file, not ours
    with pytest.raises(OutputError, match="is not an autotune checkpoint"):
        train(plan, mlp_workload(16), steps=1, checkpoint_dir=other, overwrite=True, progress=False)
    # autotune's own checkpoint is started over, as before.
    train(plan, mlp_workload(16), steps=1, checkpoint_dir=tmp_path / "ours", progress=False)
    again = train(plan, mlp_workload(16), steps=2, checkpoint_dir=tmp_path / "ours", overwrite=True,
                  progress=False)
    assert again.steps == 2
