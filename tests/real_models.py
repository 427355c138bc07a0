"""Loading the real-model example files (tiny configs of Hugging Face models) for the tests."""

from __future__ import annotations

import pathlib

import pytest

from autotune.workload.contract import load_workload

REAL = pathlib.Path(__file__).resolve().parent.parent / "examples" / "real"


def real_model(name: str):
    """The workload of ``examples/real/<name>.py`` (skipped when its library is not installed)."""
    pytest.importorskip("transformers")
    return load_workload(REAL / f"{name}.py")


def real_path(name: str) -> str:
    pytest.importorskip("transformers")
    return str(REAL / f"{name}.py")
