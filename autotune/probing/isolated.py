"""The fake-tensor estimate of a compiled workload, run in a child process.

Tracing a ``torch.compile``'d graph on fake tensors can kill the process with a segmentation
fault (torch 2.14, tiny_lm compiled in ``build_model``: exit 139, no message). The estimate
runs the eager module with torch.compile disabled (``memory/fake.py``), which avoids it; where
the user asked for compilation (``--compile``) and the model comes from a file, the estimate
also runs in a child process, so a crash there becomes an ``EstimateCrashed`` error naming what
happened instead of the end of ``autotune plan``. The child loads the same file (its sha256
checked), runs ``estimate_seed`` and hands the ``EstimateSeed`` back as JSON.

The child's side is ``autotune/probing/isolated_child.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import errors
from ..errors import EstimateCrashed
from .. import progress
from .result import MemoryModel
from .seed import EstimateSeed

_STDERR_TAIL = 12
"""Lines of the child's stderr quoted when it failed without an autotune error."""


def isolated(workload) -> bool:
    """Whether ``workload``'s estimate runs in a child process: it asked for compilation and
    comes from a model file the child can load again."""
    return workload.compile is not None and workload.file_sha256 is not None


def seed_in_child(workload, backend, *, precision, checkpointing, upper, share=None) -> EstimateSeed:
    """``estimate_seed`` for a model file, run in a child process (see the module's doc)."""
    request = {
        "source": str(Path(workload.source).resolve()), "sha256": workload.file_sha256,
        "budget": backend.info().budget_bytes, "for_cuda": backend.device.type == "cuda",
        "precision": precision.value, "checkpointing": _plain(checkpointing.value),
        "upper": upper, "share": share, "seq_len": workload.seq_len, "lines": progress.lines_shown() or progress.shown(),
    }
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="autotune-estimate-") as folder:
        result_path = Path(folder) / "seed.json"
        child = subprocess.run([sys.executable, "-m", "autotune.probing.isolated_child", str(result_path)],
                               input=json.dumps(request), text=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env=env)
        # The child's progress lines, after the fact: its stderr was a pipe.
        if child.stderr and request["lines"]:
            sys.stderr.write(child.stderr)
        answer = json.loads(result_path.read_text()) if result_path.is_file() else None
    if answer is None or child.returncode != 0:
        raise EstimateCrashed(_crash_message(workload.source, child.returncode, child.stderr))
    if "error" in answer:
        kind = getattr(errors, answer["error"]["type"], errors.AutotuneError)
        raise kind(answer["error"]["message"])
    seed = answer["seed"]
    if seed["model"] is not None:
        seed["model"] = MemoryModel.from_dict(seed["model"])
    return EstimateSeed(**seed)


def _plain(value):
    return value if isinstance(value, (int, str)) else str(value)  # a Fraction as "1/3"


def _crash_message(source: str, returncode: int, stderr: str) -> str:
    if returncode < 0:
        try:
            died = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            died = f"was killed by signal {-returncode}"
    else:
        died = f"exited with status {returncode} without an estimate"
    tail = "\n".join((stderr or "").strip().splitlines()[-_STDERR_TAIL:])
    told = f"; its last output:\n{tail}" if tail else ""
    return (f"{source}: the fake-tensor estimate of the compiled model runs in a child process, "
            f"which {died} (this process is unharmed){told}\nWhat would help: without --compile the "
            f"estimate runs the eager module in this process (a module build_model compiles is "
            f"unwrapped there); from Python, probe(..., use_estimate=False) measures with real "
            f"trials alone.")
