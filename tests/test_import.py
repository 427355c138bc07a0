"""What ``import autotune`` costs: no optuna and no NVML bindings of its own."""

import os
import subprocess
import sys

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


def test_the_search_still_finds_optuna_when_it_runs():
    from autotune.tuning import search

    assert search.optuna.TrialPruned.__module__.startswith("optuna")
    assert search.optuna.logging.get_verbosity() >= 0
