"""The tests' launcher for their own multi-rank scripts: ``python tests/fork_ranks.py N script.py
ARGS...`` runs ``script.py ARGS`` as N ranks with the environment ``torchrun --standalone
--nproc_per_node N`` gives them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).

Each rank is forked from this process after it imported torch, autotune and (where a model file
among the arguments imports it) transformers, once. Under torchrun every rank and the launcher
import them again: about 2 CPU s a process for torch and autotune, more with transformers, which
was most of a short gloo test on CI's two cores. Nothing here runs before a rank's script but
imports: each rank's state is its script's, as under torchrun.

Tests that check autotune *as a user launches it* (the CLI under torchrun, restarts, signals sent
to torchrun, rendezvous across nodes) keep torchrun itself."""

import contextlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch  # noqa: F401  (the point: imported once, before the fork)
import torch.distributed  # noqa: F401

import autotune  # noqa: F401
import autotune.training  # noqa: F401
import autotune.distributed.pipeline  # noqa: F401
import autotune.distributed.tensor_parallel  # noqa: F401

POLL_S = 0.05
GRACE_S = 10  # after a rank fails, the others get this long after SIGTERM before SIGKILL


def _preload_for(args: list[str]) -> None:
    """Import transformers before the fork where a model file named in the arguments uses it."""
    for arg in args:
        path = Path(arg)
        if path.suffix == ".py" and path.is_file() and "transformers" in path.read_text():
            import transformers  # noqa: F401
            import transformers.models.llama.modeling_llama  # noqa: F401
            return


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_the_launcher() -> None:
    """A rank outlives a launcher killed by a test's timeout (SIGKILL) and would wait in its
    collective for ever, on cores the next tests need: Linux kills it with its parent."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: as under torchrun, whose ranks outlive a killed agent too


def _rank(rank: int, world: int, port: int, run_id: str, script: str, args: list[str]) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_the_launcher()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                      ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                      TORCHELASTIC_MAX_RESTARTS="0")
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (a rank's failure is printed and is its exit code, as under torchrun)
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: fork_ranks.py NPROC script.py [ARGS...]", file=sys.stderr)
        return 2
    world, script, args = int(argv[0]), argv[1], argv[2:]
    _preload_for(args)
    port, run_id = _free_port(), uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}

    def forward(signum, _frame):  # as torchrun's agent: a signal to the launcher goes to every rank
        for pid in list(ranks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(rank, world, port, run_id, script, args))
        ranks[pid] = rank
    failed = 0
    deadline = None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                forward(signal.SIGKILL, None)
                deadline = None
            time.sleep(POLL_S)
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            # As torchrun: one rank's failure stops the others (they would wait in a collective).
            print(f"fork_ranks: rank {rank} exited with {code}; stopping the others", file=sys.stderr)
            failed = code if code > 0 else 1
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + GRACE_S
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
