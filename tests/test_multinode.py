"""Two "hosts" on this machine (issue 23): two torchrun launchers (--nnodes 2 --nproc-per-node 2,
c10d rendezvous on localhost, gloo) train a world-size-4 plan to the parameters of one launcher's
4 processes; a host that dies (its launcher and its workers, kill -9) and a restart of both with
--resume end with exactly those parameters; a plan for another world is refused before any step,
naming both worlds."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from autotune.planning.planfile import save_plan
from conftest import rank_env
from train_helpers import make_plan

TESTS = Path(__file__).resolve().parent
MODEL = TESTS / "cluster_model.py"
STEPS = 6  # 48 samples in windows of 16: two epochs
TIMEOUT = 100


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _env(**extra):
    env = rank_env(**extra)
    for name in ("AUTOTUNE_TEST_KILL_ONCE", "AUTOTUNE_TEST_SLOW"):
        if name not in extra:
            env.pop(name, None)
    return env


def _train_args(plan_file, *args):
    return ["--no-python", sys.executable, "-c", "from autotune.cli import main; main()", "train",
            str(MODEL), "--plan", str(plan_file), "--steps", str(STEPS), "-q", *map(str, args)]


def _hosts(out, label, plan_file, *args, env=None, port=None):
    """Two torchrun launchers of one job, as two hosts would start them; returns the processes."""
    port = port or _free_port()
    launchers = []
    for host in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", label,
                   *_train_args(plan_file, *args)]
        log = open(out / f"{label}-host{host}.log", "w")
        launchers.append(subprocess.Popen(command, env=env or _env(), stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return launchers


def _wait(launchers, timeout=TIMEOUT):
    try:
        return [p.wait(timeout=timeout) for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                _kill_host(p)


def _kill_host(launcher):
    """kill -9 of a launcher and its workers at once, as when its host dies (torchrun starts its
    workers in sessions of their own, so killing the launcher alone leaves them running)."""
    try:
        victims = [psutil.Process(launcher.pid)]
        victims += victims[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    launcher.wait(timeout=30)


def _params(path):
    return torch.cat([t.reshape(-1) for t in torch.load(path, weights_only=True)["model"].values()])


def _log(out, label):
    return "\n".join((out / f"{label}-host{h}.log").read_text() for h in range(2))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The world-size-4 plan, and one launcher's 4 processes trained on it (--standalone)."""
    out = tmp_path_factory.mktemp("multinode")
    plan_file = save_plan(make_plan([2, 2], world_size=4, lr=1e-2, clip=1.0), out / "plan.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
               *_train_args(plan_file, "--save", out / "single.pt")]
    done = subprocess.run(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-4000:]
    return out, plan_file, _params(out / "single.pt")


@pytest.mark.slow
def test_two_hosts_train_the_plan_to_one_launchers_parameters(reference, tmp_path):
    _, plan_file, single = reference
    started = time.monotonic()
    codes = _wait(_hosts(tmp_path, "two", plan_file, "--save", tmp_path / "two.pt"))
    assert codes == [0, 0], _log(tmp_path, "two")[-6000:]
    difference = float((_params(tmp_path / "two.pt") - single).abs().max())
    print(f"two hosts vs one launcher: max |difference| {difference:.3g} "
          f"({time.monotonic() - started:.1f} s)")
    assert difference <= 1e-6


@pytest.mark.slow
def test_a_host_killed_then_restarted_resumes_exactly(reference, tmp_path):
    _, plan_file, single = reference
    metrics, folder = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    args = ("--checkpoint-dir", folder, "--checkpoint-every", 1, "--metrics", metrics,
            "--save", tmp_path / "resumed.pt")
    started = time.monotonic()
    first = _hosts(tmp_path, "first", plan_file, *args, env=_env(AUTOTUNE_TEST_SLOW="0.15"))
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and all(p.poll() is None for p in first):
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert all(p.poll() is None for p in first), _log(tmp_path, "first")[-6000:]
        _kill_host(first[1])
        # The other host's ranks lose their peers, and its launcher gives up (no --max-restarts).
        assert first[0].wait(timeout=60) != 0
    finally:
        for p in first:
            if p.poll() is None:
                _kill_host(p)
    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert done and done[-1] < STEPS, done  # killed mid-run
    codes = _wait(_hosts(tmp_path, "restart", plan_file, *args, "--resume"))
    assert codes == [0, 0], _log(tmp_path, "restart")[-6000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # one line per step across the restart
    difference = float((_params(tmp_path / "resumed.pt") - single).abs().max())
    print(f"killed at step {done[-1]}, resumed: max |difference| {difference:.3g} "
          f"({time.monotonic() - started:.1f} s)")
    assert difference <= 1e-6


@pytest.mark.slow
def test_a_plan_for_another_world_is_refused_before_any_step(tmp_path):
    plan_file = save_plan(make_plan([2, 2], world_size=8, lr=1e-2), tmp_path / "plan8.json")
    metrics = tmp_path / "metrics.jsonl"
    codes = _wait(_hosts(tmp_path, "mismatch", plan_file, "--metrics", metrics))
    assert codes[0] != 0 and codes[1] != 0
    log = _log(tmp_path, "mismatch")
    assert ("the plan is for world size 8 but this run has 4 processes (2 nodes × 2 per node, "
            "started by torchrun): launch 8 processes in all (nodes × processes per node), e.g. "
            "torchrun --nproc-per-node 8 on one node, or --nnodes 4 --nproc-per-node 2 on each of 4") in log
    assert "--world-size 4" in log
    assert not metrics.exists() or not metrics.read_text().strip()  # no step ran
