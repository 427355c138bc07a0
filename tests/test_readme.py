"""The README's promises: its commands run as written, in order, in a fresh clone; every file a
command reads was there or written by an earlier command; the quickstart prints what the README
shows; its Python example runs; every command and option it shows exists; the CI's test command
and the CPU-only torch install are there.

README blocks fenced as ```bash run in order; blocks fenced as ```bash norun need hardware a CPU
machine does not have (several GPUs, Docker) and are only checked for their commands and options.
Install and test-suite lines (`pip install ...`, `python -m pytest ...`) are never run here."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from autotune.cli.main import cli
from conftest import ROOT

README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.S | re.M)
# what a user types before the suite: never run by this test (no recursion, no installs)
SKIPPED = ("pip install", "python -m pytest")
# options whose value is a file or folder the command writes
OUTPUT_OPTIONS = {"-o", "--output", "--save", "--metrics", "--plot", "--checkpoint-dir"}
FILE = re.compile(r"^[\w./-]+\.(py|json|jsonl|pt|svg|png|html|ipynb|db)$")


def _blocks(info):
    return [body for fence_info, body in FENCE.findall(README) if fence_info.strip() == info]


def _runnable(block):
    """The block with install and test-suite lines left out (heredoc bodies kept as they are)."""
    return "\n".join(line for line in block.splitlines() if not line.startswith(SKIPPED))


def _commands(block):
    """One string per shell command: continuation lines joined, heredoc bodies and comments
    dropped, `a && b` split."""
    lines, heredoc_end = [], None
    for line in block.replace("\\\n", " ").splitlines():
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        match = re.search(r"<<-?\s*'?(\w+)'?", line)
        if match:
            heredoc_end = match.group(1)
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            lines.extend(part.strip() for part in line.split("&&"))
    return lines


def _autotune_words(command):
    """The autotune command's words (`autotune plan ...` or `torchrun ... -m autotune plan ...`),
    or None for another program."""
    words = shlex.split(command)
    if words[0] == "autotune":
        return words
    if words[0] == "torchrun" and "-m" in words:
        at = words.index("-m")
        return words[at + 1:] if words[at + 1] == "autotune" else None
    return None


def test_the_ci_test_command_and_the_cpu_torch_install_are_there():
    # .ci/run runs the first line like this as CI's fast suite: it must install and run pytest
    ci = [line for line in README.splitlines() if re.match(r'^pip install -e "\.\[test\]"', line)]
    assert ci and ci[0] == 'pip install -e ".[test]" && python -m pytest -q -m "not slow" -n 2'
    install = "\n".join(_blocks("bash"))
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
    from autotune.version import TORCH_FLOOR

    assert f"torch >= {'.'.join(map(str, TORCH_FLOOR))}" in README  # the floor import autotune enforces
    # the quickstart: the main job on a bundled example
    assert re.search(r"^autotune plan examples/\S+\.py --target-batch \d+", install, flags=re.M)


def test_every_autotune_command_in_the_readme_exists_with_its_options():
    shown = [words for info in ("bash", "bash norun") for block in _blocks(info)
             for command in _commands(block) if (words := _autotune_words(command))]
    assert len(shown) >= 20
    listed = set(cli.commands)
    assert listed <= {words[1] for words in shown}, "one example per command"
    for words in shown:
        command = cli.commands[words[1]]  # KeyError: the README shows a command that does not exist
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        for word in words[2:]:
            if word.startswith("-"):
                assert word.split("=")[0] in options, f"{' '.join(words)}: {word} is not an option of {words[1]}"


def test_every_file_a_readme_command_reads_exists_or_was_written_before():
    there = {str(path.relative_to(ROOT)) for path in (ROOT / "examples").rglob("*") if path.is_file()}
    for block in _blocks("bash"):
        for command in _commands(_runnable(block)):
            words = shlex.split(command)
            if words[:2] == ["cat", ">"]:
                there.add(words[2])
                continue
            written = {words[at + 1] for at, word in enumerate(words[:-1]) if word in OUTPUT_OPTIONS}
            written |= {word.removeprefix("sqlite:///") for word in words if word.startswith("sqlite:///")}
            if words[:2] == ["autotune", "plan"] and not {"-o", "--output"} & set(words):
                written.add("plan.json")
            for word in words:
                if FILE.match(word) and word not in written and not word.startswith("-"):
                    assert word in there, f"{command!r} reads {word}, which nothing before it wrote"
            there |= written


def test_the_readme_blocks_are_marked():
    infos = {fence_info.strip() for fence_info, _ in FENCE.findall(README)}
    assert infos <= {"bash", "bash norun", "python", "text", ""}, infos
    for block in _blocks("bash norun"):
        assert not any(line.startswith(SKIPPED) for line in block.splitlines())


@pytest.mark.slow
def test_the_readme_commands_run_in_order_in_a_fresh_clone(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples",
                    ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT),
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("MPLBACKEND", None)
    assert shutil.which("autotune", path=env["PATH"]) and shutil.which("torchrun", path=env["PATH"])
    quickstart = None
    for block in _blocks("bash"):
        script = _runnable(block)
        if not script.strip():
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README block failed (exit {done.returncode}):\n{script}\n" \
                                     f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        if quickstart is None and script.startswith("autotune plan examples/"):
            quickstart = done.stdout
    assert quickstart is not None
    # The quickstart's output as the README shows it (shortened at "…"; the CPU line differs).
    (shown,) = [body for body in _blocks("text") if "plan written to plan.json" in body]
    printed = [line.rstrip() for line in quickstart.splitlines()]
    for line in shown.splitlines():
        line = line.rstrip()
        if line.startswith("device:"):
            continue
        if "…" in line:
            head = line.split("…")[0].rstrip()
            assert any(out.startswith(head) for out in printed), f"the quickstart no longer prints {head!r}"
        else:
            assert line in printed, f"the quickstart no longer prints {line!r}:\n{quickstart}"
    for output in ("plan.json", "model-plan.json", "ds_config.json", "final.pt", "metrics.jsonl",
                   "loss.svg", "memory.svg", "report.html"):
        assert (tmp_path / output).is_file(), output


@pytest.mark.slow
def test_the_python_example_runs_as_written(tmp_path, monkeypatch):
    (code,) = _blocks("python")
    monkeypatch.chdir(tmp_path)
    code = code.replace('"examples/', f'"{ROOT}/examples/')
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "plan.json").is_file()
