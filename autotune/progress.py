"""Progress on stderr for work that takes more than a second or two (probe, plan, throughput
search, training), drawn by tqdm.

A bar shows only where someone watches it: stderr is a terminal, this is rank 0, and nobody asked
for quiet (``--quiet``, or ``quiet()`` around the call). Everywhere else ``bar()`` returns a tqdm
that draws nothing, so callers never branch on it. Where stderr is no terminal (a log file, a
pipe, a batch job), a probe's trials are logged as plain lines instead, one as each starts: a
trial that hangs is the last line.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys

import torch.distributed as dist
from tqdm import tqdm

from .units import format_bytes

_QUIET = contextvars.ContextVar("autotune_quiet", default=False)


@contextlib.contextmanager
def quiet(flag: bool = True):
    """No progress bars inside this block (``--quiet``)."""
    token = _QUIET.set(flag)
    try:
        yield
    finally:
        _QUIET.reset(token)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def shown() -> bool:
    """Whether a bar would be drawn here and now."""
    return not _QUIET.get() and _rank() == 0 and stderr_is_terminal()


def lines_shown() -> bool:
    """Whether plain lines stand in for a bar: not quiet, rank 0, stderr no terminal."""
    return not _QUIET.get() and _rank() == 0 and not stderr_is_terminal()


def bar(desc: str, *, total: float | None = None, unit: str = "it") -> tqdm:
    """A tqdm bar on stderr, drawn only when ``shown()``; close it (or use it as a context)."""
    # disable=False, not tqdm's None (its own isatty check): shown() has decided already.
    progress = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not shown(),
                    leave=False, dynamic_ncols=True)
    progress.desc = desc  # a disabled tqdm keeps none; the plain lines name the work with it
    return progress


def write(message: str) -> None:
    """A line on stderr that does not tear a bar being drawn."""
    tqdm.write(message, file=sys.stderr)


def watch_trials(run_trial, progress: tqdm, *, fake: bool):
    """Wrap a probe's ``run(n) -> Trial`` so the bar says which micro-batch is tried and how it went."""
    where = "fake tensors" if fake else "real"

    def run(n: int):
        progress.set_postfix_str(f"trying micro-batch {n} ({where})", refresh=True)
        if lines_shown():
            write(f"{progress.desc}: trying micro-batch {n} ({where})")
        trial = run_trial(n)
        verdict = trial.verdict
        progress.set_postfix_str(f"micro-batch {n}: {verdict}, peak {format_bytes(trial.peak_bytes)} "
                                 f"({where})", refresh=False)
        progress.update(1)
        return trial

    return run
