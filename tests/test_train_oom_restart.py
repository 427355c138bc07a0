"""Out of memory where the ranks cannot agree in-process (inside FSDP2's collectives, inside DDP's
last backward): the rank records the finer split and exits, torchrun restarts every rank, and they
resume from the last checkpoint with it; the parameters are those of a run planned with the
smaller micro-batch from the start."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotune.errors import OutputError
from autotune.planning.planfile import save_plan
from autotune.training import OOMRestart, TrainError, train
from autotune.training.restart import RECORD_NAME, Restarts, restart_after_oom
from autotune.workload.contract import load_workload
from train_helpers import OOMOnce, build_mlp, make_plan, mlp_workload, params_of, relative_error

TESTS = Path(__file__).resolve().parent
MODEL = TESTS / "oom_restart_model.py"
TIMEOUT = 300
STEPS = 4  # 48 samples in windows of 16: an epoch boundary after step 3


def _torchrun(out, label, plan, *args, oom=None, max_restarts=0):
    """``autotune train`` under torchrun on 2 gloo ranks; returns (exit code, log)."""
    plan_file = save_plan(plan, out / f"plan-{label}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("AUTOTUNE_TEST_OOM", None)
    if oom is not None:
        env["AUTOTUNE_TEST_OOM"] = oom
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               "--max-restarts", str(max_restarts), "--no-python", sys.executable, "-c",
               "from autotune.cli import main; main()", "train", str(MODEL), "--plan", str(plan_file),
               "--steps", str(STEPS), *map(str, args)]
    # A timeout here is the hang this recovery must never cause.
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT)
    (out / f"log-{label}.txt").write_text(done.stdout)
    return done.returncode, done.stdout


def _plan(micro_batches, sharding):
    plan = make_plan(micro_batches, world_size=2, lr=1e-2, clip=1.0)
    return dataclasses.replace(plan, sharding=sharding)


def _saved(path):
    model = load_workload(MODEL).new_model()
    model.load_state_dict(torch.load(path, weights_only=True)["model"])
    return params_of(model)


@pytest.mark.slow
@pytest.mark.parametrize("sharding, oom, where", [
    ("fsdp", "1:3:forward", "in a forward or backward of an FSDP2"),   # step 2, first micro-step
    ("ddp", "1:4:backward", "inside the window's last backward"),      # step 2, last micro-step
    ("fsdp", "0:4:backward", "in a forward or backward of an FSDP2"),  # rank 0, reduce-scatters due
    # Step 2's first micro-step before the model ran: rank 0 waited in DDP's bucket rebuild and
    # rank 1 in the window's agreement, for good (the hang this test's timeout catches).
    ("ddp", "1:3:before", "before the model's forward, while the other ranks wait"),
])
def test_oom_inside_a_collective_restarts_with_a_smaller_micro_batch(tmp_path, sharding, oom, where):
    code, log = _torchrun(tmp_path, "oom", _plan([4, 4], sharding), "--checkpoint-dir", tmp_path / "ckpt",
                          "--checkpoint-every", 1, "--save", tmp_path / "recovered.pt", "--metrics",
                          tmp_path / "metrics.jsonl", oom=oom, max_restarts=1)
    assert code == 0, log[-6000:]
    failed, other = oom[0], 1 - int(oom[0])
    assert f"Error: rank {failed} ran out of memory at step 2 with micro-batch 4 " + where in log
    assert f"Error: rank {other} stopped (" in log
    assert f"because rank {failed} ran out of memory at step 2; micro-batch 2 is recorded in" in log
    assert "Recorded micro-batch 2 (4 accumulation steps; the effective batch and the LR schedule are " \
           "unchanged)" in log
    assert "restart 1 of 1) and they resume from the checkpoint of step 1" in log
    assert f"rank {failed} ran out of memory at step 2 inside a collective" in log
    assert "training from step 1 with micro-batch 2 x 4 accumulation steps" in log
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["micro_batch"] for r in records] == [4, 2, 2, 2]
    assert [r["oom_recoveries"] for r in records] == [0, 1, 1, 1]
    assert not (tmp_path / "ckpt" / RECORD_NAME).exists()  # the later checkpoints carry the split
    code, log = _torchrun(tmp_path, "reference", _plan([2, 2, 2, 2], sharding), "--save",
                          tmp_path / "reference.pt")
    assert code == 0, log[-6000:]
    assert relative_error(_saved(tmp_path / "recovered.pt"), _saved(tmp_path / "reference.pt")) <= 1e-5


@pytest.mark.slow
def test_no_restart_left_fails_clearly_and_no_rank_hangs(tmp_path):
    code, log = _torchrun(tmp_path, "oom", _plan([4, 4], "fsdp"), "--checkpoint-dir", tmp_path / "ckpt",
                          "--checkpoint-every", 1, oom="1:3:forward", max_restarts=0)
    assert code != 0
    assert "but torchrun was launched without --max-restarts: rerun with --resume (it continues from the " \
           "checkpoint of step 1 with it)" in log
    assert "Error: rank 0 stopped (" in log
    assert json.loads((tmp_path / "ckpt" / RECORD_NAME).read_text())["micro_batch"] == 2


# -- one process: the same record, resumed by hand -----------------------------------------------
def _wrapped(**oom):
    return mlp_workload(48, model=lambda: OOMOnce(build_mlp(), **oom))


def _assert_as_planned_with(micro_batches, saved, tmp_path, steps=3):
    """``saved`` holds the parameters of a run planned with ``micro_batches`` from the start."""
    train(_sharded(micro_batches), _wrapped(), steps=steps, progress=False, save_path=tmp_path / "ref.pt")
    model, reference = OOMOnce(build_mlp()), OOMOnce(build_mlp())
    model.load_state_dict(torch.load(saved, weights_only=True)["model"])
    reference.load_state_dict(torch.load(tmp_path / "ref.pt", weights_only=True)["model"])
    assert relative_error(params_of(model), params_of(reference)) <= 1e-12


def _sharded(micro_batches):
    return dataclasses.replace(make_plan(micro_batches, lr=0.1), sharding="fsdp")


def test_sharded_oom_records_the_split_and_resume_uses_it(tmp_path, capsys):
    """One process (no torchrun to restart it): the error says how to continue, and --resume
    trains on with the recorded micro-batch to the parameters of a run planned with it."""
    failing = _wrapped(fail_at={5})  # step 3, first micro-step
    with pytest.raises(TrainError, match=r"at step 3 with micro-batch 8 in a forward or backward of an "
                                         r"FSDP2 .* this process was not launched by torchrun: rerun with "
                                         r"resume=True \(it continues from the checkpoint of step 2"):
        train(_sharded([8, 8]), failing, steps=3, progress=False, checkpoint_dir=tmp_path / "c",
              checkpoint_every=1)
    record = json.loads((tmp_path / "c" / RECORD_NAME).read_text())
    assert (record["level"], record["micro_batch"], record["accumulation_steps"]) == (1, 4, 4)
    resumed = train(_sharded([8, 8]), _wrapped(), steps=3, progress=True, checkpoint_dir=tmp_path / "c",
                    resume=True, save_path=tmp_path / "resumed.pt")
    assert "training from step 2 with micro-batch 4 x 4 accumulation steps" in capsys.readouterr().err
    assert resumed.micro_batches == [4, 4, 4, 4] and resumed.oom_recoveries == 1
    assert [m["micro_batch"] for m in resumed.metrics] == [4]
    assert not (tmp_path / "c" / RECORD_NAME).exists()
    _assert_as_planned_with([4, 4, 4, 4], tmp_path / "resumed.pt", tmp_path)


def test_a_rerun_uses_the_recorded_split_and_overwrite_forgets_it(tmp_path):
    for start_over, expected in ((True, [8, 8]), (False, [4, 4, 4, 4])):
        folder = tmp_path / str(start_over)
        with pytest.raises(TrainError, match="rerun the same command \\(it starts over with it\\)"):
            train(_sharded([8, 8]), _wrapped(fail_at={1}), steps=1, progress=False, checkpoint_dir=folder)
        assert (folder / RECORD_NAME).exists()
        again = train(_sharded([8, 8]), _wrapped(), steps=1, progress=False, checkpoint_dir=folder,
                      overwrite=start_over)
        assert again.micro_batches == expected
        assert not (folder / RECORD_NAME).exists()


def test_torchrun_restart_resumes_by_itself_even_under_overwrite(tmp_path, monkeypatch):
    """torchrun's environment in one process: the first attempt exits with OOMRestart, the
    relaunched one (same command, --overwrite included) resumes from the checkpoint of step 2."""
    for name, value in (("TORCHELASTIC_RUN_ID", "run-1"), ("TORCHELASTIC_MAX_RESTARTS", "1"),
                        ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    common = dict(steps=3, progress=False, checkpoint_dir=tmp_path / "c", checkpoint_every=1, overwrite=True)
    with pytest.raises(OOMRestart, match=r"restart 1 of 1\) and they resume from the checkpoint of step 2"):
        train(_sharded([8, 8]), _wrapped(fail_at={5}), **common)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resumed = train(_sharded([8, 8]), _wrapped(), save_path=tmp_path / "resumed.pt", **common)
    assert [m["step"] for m in resumed.metrics] == [3] and resumed.micro_batches == [4, 4, 4, 4]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    _assert_as_planned_with([4, 4, 4, 4], tmp_path / "resumed.pt", tmp_path)


def test_a_sharded_checkpoint_is_not_started_over_without_resume_or_overwrite(tmp_path):
    """A first launch into a folder holding a checkpoint: refused, not lost (a torchrun restart
    continues its own run's checkpoint: tests/test_checkpoint_safety.py)."""
    train(_sharded([8, 8]), _wrapped(), steps=1, progress=False, checkpoint_dir=tmp_path / "c")
    with pytest.raises(OutputError, match="already holds a checkpoint .*checkpoint.json.*resume=True, start over with overwrite=True"):
        train(_sharded([8, 8]), _wrapped(), steps=2, progress=False, checkpoint_dir=tmp_path / "c")


@pytest.mark.parametrize("text, message", [("{", "cannot be read"), ('{"level": NaN}', "its level must be"),
                                           ('{"level": 99}', "its level must be"), ("[1]", "its level must be")])
def test_a_damaged_record_is_refused_naming_the_file(tmp_path, text, message):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / RECORD_NAME).write_text(text)
    with pytest.raises(TrainError, match=f"{RECORD_NAME} .*{message}.*delete it to train with the plan's"):
        train(_sharded([8, 8]), _wrapped(), steps=1, progress=False, checkpoint_dir=tmp_path / "c")


def test_sharded_oom_without_a_checkpoint_folder_says_how_to_enable_recovery():
    failing = _wrapped(fail_at={2})
    with pytest.raises(TrainError, match="needs a checkpoint folder: train with checkpoint_dir D .* under "
                                         "torchrun --max-restarts N"):
        train(_sharded([8, 8]), failing, steps=2, progress=False)


def test_sharded_oom_at_micro_batch_one_is_a_clear_error(tmp_path):
    failing = _wrapped(fail_above=0)
    with pytest.raises(TrainError, match="a micro-batch of 1 sample ran out of memory"):
        train(_sharded([1]), failing, steps=1, progress=False, checkpoint_dir=tmp_path / "c")
    assert not (tmp_path / "c" / RECORD_NAME).exists()


def test_restart_message_counts_torchrun_restarts(tmp_path):
    common = dict(directory=tmp_path, rank=1, step=5, where="inside X", micro_batch=8, level=1,
                  finer=[4, 4], recoveries=1, from_step=4)
    error = restart_after_oom(**common, restarts=Restarts(count=1, maximum=3, run_id="r"))
    assert isinstance(error, OOMRestart)
    assert "restart 2 of 3) and they resume from the checkpoint of step 4" in str(error)
    error = restart_after_oom(**common, restarts=Restarts(count=3, maximum=3, run_id="r"))
    assert not isinstance(error, OOMRestart) and "no restart left (--max-restarts 3, all used)" in str(error)
    assert json.loads((tmp_path / RECORD_NAME).read_text())["run_id"] == "r"
