"""Small collectives on the real process group (torchrun) that leave no tensor of this process in
the hands of gloo's worker threads.

A gloo collective is run by a worker thread, which drops its references to the work's tensors
only after the call has returned to Python, and freeing a tensor that Python has already let go
of takes the GIL. If the interpreter is shutting down by then (a rank whose last act was a
collective, on a loaded machine), the thread cannot take the GIL and the process aborts
("terminate called without an active exception", SIGABRT) after its work is done. So every
tensor handed to a collective here stays alive in Python until the worker has let go of it, and
``settle()`` lets each worker finish what it holds before the caller goes on to exit.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

_RELEASE_TIMEOUT_S = 10.0
_POLL_S = 0.0005


def min_across_ranks(value: int) -> int:
    return int(all_reduce(torch.tensor([value], dtype=torch.int64, device=collective_device()),
                          dist.ReduceOp.MIN).item())


def max_across_ranks(values: list[int]) -> list[int]:
    """Each of ``values``, the largest any rank holds (every rank passes as many, in one order)."""
    return all_reduce(torch.tensor(values, dtype=torch.int64, device=collective_device()),
                      dist.ReduceOp.MAX).tolist()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``dist.all_reduce`` in place, returning once no worker thread holds ``tensor`` any more."""
    dist.all_reduce(tensor, op=op)
    if tensor.device.type == "cpu":
        _wait_released(tensor)
    return tensor


def settle() -> None:
    """Wait until gloo's worker threads hold nothing of this process: call on every rank (it is a
    collective) after the last one, before the process may exit."""
    if not (dist.is_available() and dist.is_initialized()) or "gloo" not in dist.get_backend():
        return
    # Each worker lets go of its last work before it takes the next: one small collective per
    # worker thread, each waited for until released, leaves none of them holding an older one,
    # unless a worker never took one of them: the others can take them all while it waits to be
    # scheduled (a loaded machine) between finishing its work and letting go of it.
    for _ in range(_worker_threads()):
        all_reduce(torch.zeros(1, device=collective_device()))
    _wait_workers_asleep()


def _wait_workers_asleep() -> None:
    """Until every gloo worker thread of this process sleeps (Linux: its state in /proc), twice
    in a row: an idle worker waits for work, and one still to let go of a tensor is runnable (or
    wakes for the GIL, which this thread leaves free while it sleeps here)."""
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        states = _worker_states()
        if states is None:
            return  # not Linux, or /proc unreadable: the collectives above are all there is
        quiet = quiet + 1 if all(state in _ASLEEP for state in states) else 0
        time.sleep(_POLL_S)


_WORKER_NAME = "pt_gloo_runloop"
_ASLEEP = ("S",)  # waiting in the kernel (a condition variable); R: running or about to


def _worker_states() -> list[str] | None:
    """The scheduler state letter of each of this process's gloo worker threads."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue  # a thread that ended meanwhile
        name, _, rest = stat.partition(b"(")[2].rpartition(b")")
        if name == _WORKER_NAME.encode():
            states.append(rest.split()[0].decode())
    return states


def _wait_released(tensor: torch.Tensor) -> None:
    # Sleeping releases the GIL, which the worker may need to let go of the work.
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while tensor._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def collective_device() -> torch.device:
    """Where the process group's collectives take their tensors: the current GPU under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker_threads() -> int:
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return max(1, int(backend.options._threads))
    except (AttributeError, RuntimeError, ValueError):
        return 2  # gloo's default
