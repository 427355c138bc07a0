"""What ``import autotune`` costs and needs: no optuna and no NVML bindings of its own, and a torch
older than the floor named in one clear ImportError."""

import os
import re
import subprocess
import sys

import pytest

from autotune.version import TORCH_FLOOR, check_torch

from conftest import ROOT


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_import_autotune_loads_neither_optuna_nor_nvml():
    # torch itself imports pynvml (torch/cuda/__init__.py) where nvidia-ml-py is installed, so
    # pynvml is taken out after torch, and any later request for it, or for optuna, is recorded.
    code = (
        "import sys, torch\n"
        "sys.modules.pop('pynvml', None)\n"
        "asked = []\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('optuna', 'pynvml', 'sqlalchemy'):\n"
        "            asked.append(name)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import autotune\n"
        "print('optuna' in sys.modules, 'pynvml' in sys.modules, sorted(set(asked)))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "[]"], result.stdout


def test_import_autotune_leaves_optuna_out_of_sys_modules():
    result = _run("import autotune, sys; print('optuna' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_cli_loads_no_distributed_checkpoint_dtensor_nor_sympy_until_a_step_needs_them():
    # About 1.8 CPU s of every process's start (each CLI call, each DDP rank) before they were
    # left to the sharded checkpoint's save and load.
    result = _run("import sys, autotune.cli.main\n"
                  "print(sorted(m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', "
                  "'sympy') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_search_still_finds_optuna_when_it_runs():
    from autotune.tuning import search

    assert search.optuna.TrialPruned.__module__.startswith("optuna")
    assert search.optuna.logging.get_verbosity() >= 0


@pytest.mark.parametrize("version", ["2.4.0", "2.5.1+cu121", "2.10.0+cpu", "2.11.0", "2.12.1+cu128", "1.13.1",
                                     "2.12.0a0+gitabc"])
def test_an_older_torch_is_one_clear_error_naming_the_floor(version):
    floor = ".".join(map(str, TORCH_FLOOR))
    with pytest.raises(ImportError, match=rf"autotune needs torch {re.escape(floor)} or newer, "
                                          rf"and torch {re.escape(version)} is installed"):
        check_torch(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.0a0+git123", "2.14.1+cu130", "3.0.0"])
def test_the_floor_and_newer_pass(version):
    check_torch(version)


def test_import_autotune_on_an_older_torch_says_so_before_anything_fails():
    result = _run("import torch; torch.__version__ = '2.5.1'\nimport autotune")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: autotune needs torch") and "2.5.1" in last, result.stderr


def test_the_floor_is_the_one_pyproject_declares():
    text = (ROOT / "pyproject.toml").read_text()
    (declared,) = re.findall(r'"torch>=([0-9.]+)"', text)
    assert tuple(int(x) for x in declared.split(".")) == TORCH_FLOOR
    check_torch()  # the torch this suite runs on meets it (CI runs the fast suite on the floor too)
