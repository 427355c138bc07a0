"""The Dockerfile parses, installs autotune with the README's own command, defaults to JupyterLab
on CUDA PyTorch new enough for FSDP planning and makes SSH optional. No daemon or network is
needed: the file is parsed and every shell step is syntax-checked with bash -n. The image is built
and run for real by tests/test_container_build.py (slow, needs buildah)."""

import json
import pathlib
import re
import shutil
import subprocess

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse")

ROOT = pathlib.Path(__file__).resolve().parent.parent
KNOWN = {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "EXPOSE", "ENTRYPOINT", "CMD", "LABEL",
         "USER", "SHELL", "HEALTHCHECK", "VOLUME", "ADD", "STOPSIGNAL", "ONBUILD"}


@pytest.fixture(scope="module")
def instructions():
    parser = dockerfile_parse.DockerfileParser(path=str(ROOT / "Dockerfile"))
    return [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def values(instructions, name):
    return [value for instruction, value in instructions if instruction == name]


def readme_install_command() -> str:
    """The README's command that installs autotune itself (not torch, not an extra)."""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        for command in line.split("#")[0].split("&&"):
            if re.fullmatch(r"pip install (-e|--editable) \.", command.strip()):
                return command.strip()
    pytest.fail("README.md shows no `pip install -e .` command")


def test_every_instruction_is_a_dockerfile_instruction(instructions):
    assert instructions and {name for name, _ in instructions} <= KNOWN
    assert [name for name, _ in instructions if name != "ARG"][0] == "FROM"


def test_base_is_cuda_pytorch(instructions):
    args = dict(v.split("=", 1) for v in values(instructions, "ARG") if "=" in v)
    base = values(instructions, "FROM")[0]
    image = args.get(base.strip("${}"), base)
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", image), image


def test_default_base_and_the_build_meet_the_torch_floor(instructions):
    """The image's torch floor is the package's (TORCH_FLOOR): the default base carries it or newer,
    and the build stops on a base below TORCH_MIN."""
    from autotune.version import TORCH_FLOOR

    args = dict(v.split("=", 1) for v in values(instructions, "ARG") if "=" in v)
    version = re.match(r"pytorch/pytorch:(\d+)\.(\d+)", args["BASE_IMAGE"])
    floor = tuple(int(p) for p in args["TORCH_MIN"].split("."))
    assert floor == TORCH_FLOOR and (int(version[1]), int(version[2])) >= floor, (args["BASE_IMAGE"], floor)
    (check,) = [run for run in values(instructions, "RUN") if "$TORCH_MIN" in run]
    assert check.startswith('if ! python3 -c "import torch"') and "sys.exit(" in check


def test_installs_autotune_with_the_readmes_command(instructions):
    command = readme_install_command()
    assert any(command in run for run in values(instructions, "RUN")), command
    # Every install of the project is editable: a plain `pip install ".[plot]"` after it would
    # replace the editable install with a copy in site-packages.
    for run in values(instructions, "RUN"):
        for step in re.findall(r"pip install ([^&;]*)", run):
            words = step.split()
            for i, word in enumerate(words):
                if word.strip("\"'") == "." or word.strip("\"'").startswith(".["):
                    assert i > 0 and words[i - 1] == "-e", step


def test_jupyterlab_is_the_default_command(instructions):
    (cmd,) = values(instructions, "CMD")
    argv = json.loads(cmd)
    assert argv[:2] == ["jupyter", "lab"] and "--port=8888" in argv and "--ip=0.0.0.0" in argv
    assert "8888" in values(instructions, "EXPOSE")[0].split()
    assert any("jupyterlab" in run for run in values(instructions, "RUN"))


def test_ssh_is_optional(instructions):
    assert "WITH_SSH=0" in values(instructions, "ARG")
    (ssh,) = [run for run in values(instructions, "RUN") if "openssh-server" in run]
    assert ssh.startswith('if [ "$WITH_SSH" = "1" ]')
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert 'exec "$@"' in entrypoint and "SSH_PUBLIC_KEY" in entrypoint and "SSH_PORT" in entrypoint


def test_copied_files_exist_and_shell_steps_parse(instructions):
    for copy in values(instructions, "COPY"):
        source = copy.split()[0]
        assert (ROOT / source).exists(), source
    if shutil.which("bash") is None:
        pytest.skip("no bash to syntax-check the RUN steps")
    for script in [*values(instructions, "RUN"), (ROOT / "docker" / "entrypoint.sh").read_text()]:
        checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert checked.returncode == 0, (script, checked.stderr)
