import contextlib
import logging
import os
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def examples_dir():
    return EXAMPLES


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny CPU ops run far slower with several OpenMP threads on a
    busy machine, and measured bytes do not depend on the thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@contextlib.contextmanager
def logged(name: str):
    """The messages logger ``name`` records while the block runs (a list, filled as they come),
    whatever its level and handlers (torch's loggers do not propagate to pytest's caplog)."""
    records = []

    class Kept(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(name)
    kept = Kept(level=logging.DEBUG)
    logger.addHandler(kept)
    try:
        yield records
    finally:
        logger.removeHandler(kept)


def rank_env(**extra) -> dict:
    """The environment of a test's ranks, or of its torchrun launcher: one torch thread a rank (the
    ranks share CI's two cores), the checkout and tests/ importable (the tests' scripts and model
    files import their helpers), and ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", **extra,
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))


def torchrun_command(nproc: int, *args) -> list[str]:
    """torchrun ``--standalone`` of ``nproc`` ranks on ``args``, as a user launches autotune."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            *map(str, args)]


def rank_command(nproc: int, script, *args) -> list[str]:
    """The command that runs one of the tests' own scripts on ``nproc`` ranks with torchrun's
    environment, the ranks forked after torch and autotune are imported once (tests/fork_ranks.py).
    Tests of autotune as a user launches it (the CLI, signals to torchrun, restarts) use torchrun."""
    return [sys.executable, str(ROOT / "tests" / "fork_ranks.py"), str(nproc), str(script), *map(str, args)]
