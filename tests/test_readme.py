"""The README's promises: its Python example runs as written, and every command it shows exists."""

import re
import shlex

import pytest

from autotune.cli.main import cli
from conftest import ROOT

README = (ROOT / "README.md").read_text()


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_every_autotune_command_in_the_readme_exists_with_its_options():
    shown = [line.strip() for block in _blocks("bash") for line in block.replace("\\\n", " ").splitlines()
             if line.strip().startswith(("autotune ", "pip install -e . && autotune "))]
    assert len(shown) >= 10
    for line in shown:
        words = shlex.split(line.split("&&")[-1].split("#")[0])
        command = cli.commands[words[1]]  # KeyError: the README shows a command that does not exist
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        for word in words[2:]:
            if word.startswith("-"):
                assert word.split("=")[0] in options, f"{line!r}: {word} is not an option of {words[1]}"


@pytest.mark.slow
def test_the_python_example_runs_as_written(tmp_path, monkeypatch):
    (code,) = _blocks("python")
    monkeypatch.chdir(tmp_path)
    code = code.replace('"examples/', f'"{ROOT}/examples/')
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "plan.json").is_file()
