"""The example notebook runs top to bottom in a real Jupyter kernel and shows what it promises."""

import os
import pathlib
import shutil

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def outputs(cell, kind):
    return "".join(str(o.get("data", {}).get(kind, "")) + (o.get("text", "") if kind == "text/plain" else "")
                   for o in cell.outputs)


@pytest.mark.slow
def test_example_notebook_probes_plans_plots_and_trains(tmp_path, monkeypatch):
    for name in ("notebook.ipynb", "tiny_lm.py"):
        shutil.copy(ROOT / "examples" / name, tmp_path / name)
    # The kernel imports this tree's autotune, whatever is installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(tmp_path / "notebook.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    probe, plan, memory, train, loss = code[1:]
    assert "ProbeResult(max_micro_batch=" in outputs(probe, "text/plain")
    assert 'id="trials"' in outputs(probe, "text/html") and "<svg" in outputs(probe, "text/html")
    assert "Plan(" in outputs(plan, "text/plain") and "= 16" in outputs(plan, "text/plain")
    assert 'id="settings"' in outputs(plan, "text/html") and 'id="budget"' in outputs(plan, "text/html")
    assert 'id="planned"' in outputs(memory, "image/svg+xml")
    assert "TrainResult(steps=3" in outputs(train, "text/plain")
    assert 'id="loss-0"' in outputs(loss, "image/svg+xml")
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3
