"""Plan vs trained peak, three optimizer steps of the built-in loop, over a covering matrix
(issue 19): one process, DDP, FSDP and hybrid on 2 and 4 gloo ranks, fsdp-offload; accumulation
1, 2 and uneven; checkpointing off, on and K of N; fp32 and bf16 (rows in tests/window_matrix.py,
whose table is in bench/README.md, "Plan vs trained peak")."""

import pytest

from window_matrix import ROWS, run_matrix, table

pytestmark = pytest.mark.slow


def test_every_trained_peak_is_the_planned_one(tmp_path, capsys):
    records = run_matrix(ROWS, tmp_path)
    with capsys.disabled():
        print("\n" + table(records))
    # Every layout, accumulation 1 / 2 / uneven, each checkpointing and precision is covered.
    rows = [r["row"] for r in records]
    assert {r.layout for r in rows} >= {"one process", "ddp 2", "fsdp 2", "fsdp 4", "fsdp-offload 2",
                                        "hybrid 4 (groups of 2)"}
    assert {"1", "2", "uneven"} <= {("uneven" if len(set(map(int, r["split"].split(" + ")))) > 1
                                     else str(len(r["split"].split(" + ")))) for r in records}
    assert {r.checkpointing for r in rows} == {"off", "on", "2"}
    assert {r.precision for r in rows} == {"fp32", "bf16"}
    for r in records:
        assert abs(r["error"]) <= 0.01, (r["row"].name, r["predicted"], r["trained"])
        assert r["trained"] <= r["budget"], r["row"].name
