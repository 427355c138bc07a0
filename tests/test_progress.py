"""Progress bars: drawn on a terminal, on rank 0, unless quiet; the training peak is the tracked one."""

import json

import pytest
import torch
from click.testing import CliRunner

import autotune
from autotune import progress
from autotune.cli.main import cli
from autotune.training import metrics as metrics_module
from autotune.training.metrics import format_progress
from train_helpers import make_plan, mlp_workload


@pytest.fixture
def terminal(monkeypatch, capsys):
    """stderr taken for a terminal; the test reads what was drawn with ``terminal()``."""
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    return lambda: capsys.readouterr().err


def test_bar_only_on_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert not progress.shown()  # pytest's captured stderr is no terminal
    train_quietly = autotune.train(make_plan([4, 4]), mlp_workload(), steps=3, progress=True)
    err = capsys.readouterr().err
    assert train_quietly.steps == 3
    assert "\r" not in err and "it/s" not in err and "step/s" not in err
    assert "step 3/3" in err  # the plain log line stands in for the bar


def test_training_bar_shows_loss_speed_and_the_tracked_peak(terminal):
    autotune.train(make_plan([4, 4]), mlp_workload(), steps=3, progress=True)
    out = terminal()
    assert "train" in out and "3/3" in out and "\r" in out
    assert "loss " in out and "samples/s" in out and "tensors" in out
    assert "step 3/3  loss" not in out  # the bar replaces the log lines


def test_quiet_and_other_ranks_draw_nothing(terminal, monkeypatch):
    with progress.quiet():
        assert not progress.shown()
        autotune.train(make_plan([4]), mlp_workload(), steps=2, progress=True)
    assert "\r" not in terminal()
    monkeypatch.setenv("RANK", "1")
    assert not progress.shown()
    monkeypatch.setenv("RANK", "0")
    assert progress.shown()


def test_probe_bar_names_the_setting_the_micro_batch_and_fake_or_real(terminal, examples_dir,
                                                                       one_thread):
    autotune.probe(examples_dir / "mlp.py", device="cpu", memory_limit="96MiB", max_micro_batch=64)
    out = terminal()
    assert "estimate fp32, checkpointing off" in out and "probe fp32, checkpointing off" in out
    assert "(fake tensors)" in out and "(real)" in out
    assert "trying micro-batch" in out and ": fits, peak" in out


def test_cli_quiet_turns_bars_off(monkeypatch, tmp_path, examples_dir, one_thread):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    args = ["probe", str(examples_dir / "mlp.py"), "--device", "cpu", "--memory-limit", "96MiB",
            "--max-micro-batch", "32"]
    shown = CliRunner().invoke(cli, args)
    quiet = CliRunner().invoke(cli, [*args, "--quiet"])
    assert shown.exit_code == quiet.exit_code == 0, shown.output + quiet.output
    assert "probe fp32" in shown.stderr
    assert "probe fp32" not in quiet.stderr and "trying" not in quiet.stderr


def test_training_peak_is_the_tracked_peak_the_plan_predicted(tmp_path, examples_dir, one_thread):
    """Issue 12 item 8: the CPU peak was the process RSS (590 MiB for a plan predicting 89 MiB)."""
    plan = autotune.plan(examples_dir / "tiny_lm.py", target_batch=8, device="cpu", precision="fp32",
                         checkpointing="off", memory_limit="64MiB")
    metrics = tmp_path / "m.jsonl"
    autotune.train(plan, examples_dir / "tiny_lm.py", steps=3, metrics_path=metrics, progress=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = records[-1]
    assert steady["peak_memory_kind"] == "tensors"
    predicted = plan.predicted_peak_bytes
    assert abs(steady["peak_memory_bytes"] - predicted) <= 0.02 * predicted, (steady, predicted)
    assert steady["rss_peak_bytes"] > steady["peak_memory_bytes"]  # RSS holds far more than tensors
    line = format_progress(steady, 3, predicted)
    assert "tensors (plan " in line and "process RSS" in line


def _stderr_through_a_terminal(argv) -> str:
    """Run ``argv`` with stderr on a pseudo-terminal (80 columns); what it drew there."""
    pty = pytest.importorskip("pty")
    import fcntl
    import os
    import struct
    import subprocess
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert child.wait() == 0
    return drawn.decode(errors="replace")


@pytest.mark.slow
def test_a_real_terminal_gets_bars_and_a_pipe_does_not(examples_dir):
    import subprocess
    import sys

    argv = [sys.executable, "-m", "autotune", "probe", str(examples_dir / "mlp.py"), "--device", "cpu",
            "--memory-limit", "96MiB", "--max-micro-batch", "8"]
    drawn = _stderr_through_a_terminal(argv)
    assert "probe fp32, checkpointing off" in drawn and "trial" in drawn and "\r" in drawn
    piped = subprocess.run(argv, capture_output=True, text=True)
    # A pipe gets no bar, but a line as each trial starts (a hanging trial is the last line).
    assert piped.returncode == 0 and "\r" not in piped.stderr
    assert "probe fp32, checkpointing off: trying micro-batch 8 (real)" in piped.stderr.splitlines()
    quiet = subprocess.run([*argv, "--quiet"], capture_output=True, text=True)
    assert quiet.returncode == 0 and "trying micro-batch" not in quiet.stderr


def test_throughput_search_bar_counts_seconds_and_shows_the_best(terminal):
    from autotune.tuning.measure import Configuration, Measurement
    from autotune.tuning.search import Candidate, search_throughput

    speeds = {8: 100.0, 16: 180.0}
    candidates = [Candidate(config=Configuration(precision="fp32", checkpointing=False,
                                                 micro_batches=(m,) * (32 // m)),
                            predicted_peak_bytes=m << 20, predicted_fits=True) for m in speeds]
    seconds = iter(range(0, 10_000))
    result = search_throughput(
        candidates, lambda c, _seconds: Measurement(samples_per_s=speeds[c.micro_batch], peak_bytes=1),
        lambda configs, s: [Measurement(samples_per_s=speeds[c.micro_batch], peak_bytes=1) for c in configs],
        budget_s=60, usable_bytes=1 << 30, study_name="progress", clock=lambda: float(next(seconds)))
    assert result.winner.micro_batch == 16
    drawn = terminal()
    assert "throughput search" in drawn and "/60" in drawn
    assert "2 measured" in drawn and "best so far 180.0" in drawn


def test_the_cpu_counts_the_first_steps_every_hundredth_and_the_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics_module, "COUNT_EVERY", 10)
    metrics = tmp_path / "m.jsonl"
    autotune.train(make_plan([4, 4]), mlp_workload(), steps=25, metrics_path=metrics, progress=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    counted = [r["step"] for r in records if r["peak_memory_bytes"] is not None]
    assert counted == [1, 2, 10, 20, 25]
    logged = {line.split()[1]: line for line in capsys.readouterr().err.splitlines()
              if line.startswith("step ")}
    assert "tensors (counted at step 2)" in logged["3/25"]  # not counted there: the last, said so
    assert "counted at" not in logged["10/25"] and "tensors" in logged["10/25"]
    assert "peak not counted" in format_progress(records[2], 25)
    assert all(r["peak_memory_kind"] == "tensors" for r in records)
    steady = {r["peak_memory_bytes"] for r in records[1:] if r["peak_memory_bytes"] is not None}
    assert len(steady) == 1  # the same step, the same tensors


def test_cli_train_quiet_prints_no_progress(tmp_path, examples_dir):
    from autotune.planning.planfile import save_plan

    save_plan(make_plan([4, 4]), tmp_path / "plan.json")
    args = ["train", str(examples_dir / "mlp.py"), "--plan", str(tmp_path / "plan.json"), "--steps", "2",
            "--device", "cpu"]
    loud = CliRunner().invoke(cli, args)
    quiet = CliRunner().invoke(cli, [*args, "--quiet"])
    assert loud.exit_code == quiet.exit_code == 0, loud.output + quiet.output
    assert "step 2/2" in loud.stderr and "tensors" in loud.stderr
    assert "step 2/2" not in quiet.stderr and "trained 2 optimizer steps" in quiet.stdout
