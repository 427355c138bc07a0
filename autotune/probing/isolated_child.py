"""The child process of ``isolated.py``: the fake-tensor estimate of a compiled model file.

    python -m autotune.probing.isolated_child RESULT.json < REQUEST.json

Reads the request (the model file, its sha256, the budget and the setting) as JSON on stdin,
runs ``estimate_seed`` and writes ``{"seed": ...}`` (or ``{"error": ...}`` for an autotune
error) to RESULT.json. Dying on the way (a signal) leaves no result: the parent reports it.
Not imported by the package, so ``-m`` runs it fresh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import errors, progress
from ..memory.fake import EstimateMemoryBackend
from ..precision import Precision
from ..workload.contract import load_workload
from .seed import estimate_seed


def _child(result_path: str) -> int:
    request = json.load(sys.stdin)

    def same_file(source: str, sha256: str) -> None:
        if sha256 != request["sha256"]:
            raise errors.WorkloadError(f"{source} changed while autotune was planning it (its "
                                       f"sha256 is now {sha256[:12]}…); run the command again")

    try:
        with progress.quiet(not request["lines"]):
            workload = load_workload(request["source"], check_sha256=same_file)
            if request["seq_len"] is not None:  # the parent's workload.at_seq_len
                workload = workload.at_seq_len(request["seq_len"])
            backend = EstimateMemoryBackend(request["budget"], for_cuda=request["for_cuda"])
            seed = estimate_seed(workload, backend, precision=Precision.parse(request["precision"]),
                                 checkpointing=request["checkpointing"], upper=request["upper"],
                                 share=request["share"])
        answer = {"seed": {"answer": seed.answer, "steps": seed.steps, "seconds": seed.seconds,
                           "model": seed.model.to_dict() if seed.model is not None else None,
                           "unavailable": seed.unavailable, "share_fits": seed.share_fits,
                           "curve": seed.curve}}
    except errors.AutotuneError as exc:
        answer = {"error": {"type": type(exc).__name__, "message": str(exc)}}
    Path(result_path).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
