"""The container, built and run for real with buildah (no Docker daemon): the project's Dockerfile is
built on a local Debian base with the CPU torch wheel, and inside the image `autotune --version` and
the README's quickstart plan run, JupyterLab answers on /api with the token it prints, the example
notebook runs top to bottom, and, built with WITH_SSH=1, the entrypoint's sshd lets a generated key
log in and run autotune.

The base is made once with debootstrap (Debian bookworm and its Python 3.11) and kept under
~/.cache/autotune-container/ and in buildah's image store; AUTOTUNE_CONTAINER_BASE names another
base instead (any image with python3 and pip, e.g. python:3.12-slim where a registry is reachable).
Builds use buildah's layer cache, so a rerun rebuilds only from the project's files on. Needs root
(debootstrap, chroot isolation) and network access (Debian mirror, PyPI, download.pytorch.org).
Build and run times are written to the terminal; bench/README.md ("Container") records them."""

import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What is built: this checkout as it is, or another tree (`git archive HEAD | tar -x -C DIR` builds
# the last commit without uncommitted edits).
CONTEXT = pathlib.Path(os.environ.get("AUTOTUNE_CONTAINER_CONTEXT", ROOT)).resolve()
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "autotune-container"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
BASE_PACKAGES = ["python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates"]
BASE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
IMAGE = "localhost/autotune-container-test"


def _why_not() -> str | None:
    if shutil.which("buildah") is None:
        return "buildah is not installed (apt-get install buildah podman debootstrap): the image is not built"
    if os.geteuid() != 0:
        return "buildah's chroot isolation and debootstrap need root here"
    if not os.environ.get("AUTOTUNE_CONTAINER_BASE"):
        missing = [tool for tool in ("debootstrap", "podman") if shutil.which(tool) is None]
        if missing:
            return f"{' and '.join(missing)} not installed: no local Debian base (or set AUTOTUNE_CONTAINER_BASE)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")]


TIMES: list[str] = []


def say(request, message: str) -> None:
    """A line on the terminal whether or not pytest captures output (and in the summary at the end)."""
    TIMES.append(message)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        print(f"[container] {message}")
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(f"[container] {message}")


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    yield
    if TIMES:
        say(request, "summary:\n    " + "\n    ".join(TIMES))


def run(*argv, timeout=1800, check=True, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], text=True, capture_output=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {done.returncode}\n"
                             f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-6000:]}")
    return done


def image_exists(name: str) -> bool:
    return run("buildah", "inspect", "--type", "image", name, check=False).returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def base_image(request) -> str:
    """A Debian bookworm image with Python, made with debootstrap once and cached."""
    if os.environ.get("AUTOTUNE_CONTAINER_BASE"):
        return os.environ["AUTOTUNE_CONTAINER_BASE"]
    key = hashlib.sha256(json.dumps([SUITE, MIRROR, BASE_PACKAGES, BASE_ENV]).encode()).hexdigest()[:12]
    name = f"localhost/debian-python:{SUITE}-{key}"
    if image_exists(name):
        say(request, f"base {name}: cached in buildah's store")
        return name
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / f"debian-{SUITE}-python-{key}.tar"
    start = time.monotonic()
    if not tarball.exists():
        rootfs = pathlib.Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
        try:
            run("debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, rootfs, MIRROR)
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (rootfs / leftover).glob("*"):
                    if path.is_file():
                        path.unlink()
            partial = tarball.with_suffix(".partial")
            run("tar", "-C", rootfs, "--numeric-owner", "-cf", partial, ".")
            partial.rename(tarball)
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
        say(request, f"base rootfs: debootstrap {SUITE} + python3 in {time.monotonic() - start:.0f} s")
    changes = [arg for env in BASE_ENV for arg in ("--change", f"ENV={env}")]
    run("podman", "import", *changes, "--change", "CMD=/bin/bash", tarball, name)
    say(request, f"base {name}: ready in {time.monotonic() - start:.0f} s")
    return name


def cpu_torch() -> list[str]:
    """Build arguments that give the image the CPU torch wheel: a wheel file named by
    AUTOTUNE_CONTAINER_TORCH_WHEEL, else a CPU wheel for the Debian base's Python 3.11 in pip's
    find-links folders (PIP_FIND_LINKS), mounted into the build; else the wheel from
    AUTOTUNE_CONTAINER_TORCH_INDEX or download.pytorch.org's CPU index. (PyPI's Linux torch is the
    CUDA build, with gigabytes of CUDA libraries.)"""
    wheel = os.environ.get("AUTOTUNE_CONTAINER_TORCH_WHEEL")
    if not wheel and not os.environ.get("AUTOTUNE_CONTAINER_BASE"):
        folders = [pathlib.Path(f) for f in os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()]
        found = sorted(w for f in folders if f.is_dir() for w in f.glob("torch-*+cpu-cp311-cp311-*linux*_x86_64.whl"))
        wheel = str(found[-1]) if found else None
    if wheel:
        wheel = pathlib.Path(wheel).resolve()
        return ["--volume", f"{wheel.parent}:/torch-wheel:ro", "--build-arg", f"TORCH_SPEC=/torch-wheel/{wheel.name}"]
    return ["--build-arg", f"TORCH_INDEX_URL={os.environ.get('AUTOTUNE_CONTAINER_TORCH_INDEX', CPU_INDEX)}"]


def host_certificates() -> list[str]:
    """The host's CA bundle over the image's during the build (not kept in the image): where a
    proxy re-signs HTTPS (as on this machine), pip in the build trusts what the host trusts."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and pathlib.Path(candidate).is_file():
            return ["--volume", f"{pathlib.Path(candidate).resolve()}:/etc/ssl/certs/ca-certificates.crt:ro"]
    return []


def build(request, base: str, tag: str, *args: str) -> str:
    name = f"{IMAGE}:{tag}"
    old = run("buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name, check=False)
    old_id = old.stdout.strip() if old.returncode == 0 else ""
    start = time.monotonic()
    torch_args = cpu_torch()
    run("buildah", "bud", "--isolation", "chroot", "--layers", "--rm", "--force-rm",
        "--build-arg", f"BASE_IMAGE={base}", *torch_args, *host_certificates(),
        *args, "-f", CONTEXT / "Dockerfile", "-t", name, CONTEXT, timeout=3600, env=environment())
    say(request, f"build {tag} ({' '.join([*torch_args, *args])}): {time.monotonic() - start:.0f} s")
    new = run("buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name).stdout.strip()
    if old_id and old_id != new:
        # The image this tag named before, now untagged: removed unless a layer cache still uses it.
        run("buildah", "rmi", old_id, check=False)
    return name


class Container:
    """A working container of an image, run with chroot isolation (the host's network)."""

    def __init__(self, image: str):
        self.image = image
        self.name = f"autotune-test-{uuid.uuid4().hex[:8]}"
        config = json.loads(run("buildah", "inspect", "--type", "image", image).stdout)["OCIv1"]["config"]
        self.entrypoint, self.cmd = config.get("Entrypoint") or [], config.get("Cmd") or []
        self.env = config.get("Env") or []
        self.processes: list[subprocess.Popen] = []
        run("buildah", "from", "--name", self.name, image)

    def argv(self, command, env=(), volumes=(), workdir=None) -> list[str]:
        argv = ["buildah", "run", "--isolation", "chroot", "--env", "OMP_NUM_THREADS=1"]
        for item in env:
            argv += ["--env", item]
        for volume in volumes:
            argv += ["--volume", volume]
        if workdir:
            argv += ["--workingdir", workdir]
        return [*argv, self.name, "--", *map(str, command)]

    def run(self, *command, env=(), volumes=(), workdir=None, timeout=1800, check=True):
        return run(*self.argv(command, env, volumes, workdir), timeout=timeout, check=check)

    def start(self, *command, env=(), log: pathlib.Path) -> subprocess.Popen:
        with open(log, "w") as out:
            process = subprocess.Popen(self.argv(command, env), stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        import psutil
        for process in self.processes:
            try:
                family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                family = []
            for member in family:
                try:
                    member.terminate()
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(family, timeout=20)
            for member in alive:
                member.kill()
            process.wait(timeout=30)
        self.processes.clear()

    def remove(self) -> None:
        self.stop()
        run("buildah", "rm", self.name, check=False)


def kill_listeners(port: int) -> None:
    """sshd detaches from the entrypoint: it is found by its port and ended."""
    import psutil
    pids = {c.pid for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}
    for pid in pids:
        try:
            psutil.Process(pid).terminate()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)


def wait_for(log: pathlib.Path, pattern: str, process: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        match = re.search(pattern, text)
        if match:
            return match
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before printing {pattern!r}:\n{text[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}")


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def with_port(cmd: list[str], port: int) -> list[str]:
    """The default command on a free port, and on the host's loopback only (chroot isolation
    shares the host's network)."""
    assert "--port=8888" in cmd and "--ip=0.0.0.0" in cmd, cmd
    replaced = {"--port=8888": f"--port={port}", "--ip=0.0.0.0": "--ip=127.0.0.1"}
    return [replaced.get(arg, arg) for arg in cmd]


def readme_quickstart() -> list[str]:
    """The README's first `autotune plan` command (its quickstart), on a line of its own or after
    `pip install -e . &&`."""
    for line in (CONTEXT / "README.md").read_text(encoding="utf-8").splitlines():
        for command in line.split("#")[0].split("&&"):
            if command.strip().startswith("autotune plan ") and not command.strip().endswith("\\"):
                return command.split()
    pytest.fail("README.md shows no `autotune plan` command")


@pytest.fixture(scope="module")
def cpu_image(request, base_image) -> str:
    return build(request, base_image, "cpu")


@pytest.fixture(scope="module")
def ssh_image(request, base_image) -> str:
    return build(request, base_image, "cpu-ssh", "--build-arg", "WITH_SSH=1")


@pytest.fixture
def container(request, cpu_image):
    box = Container(cpu_image)
    yield box
    box.remove()


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (CONTEXT / "pyproject.toml").read_text(), re.M).group(1)


def test_autotune_runs_and_plans_the_quickstart_in_a_mounted_work_folder(request, container, tmp_path):
    start = time.monotonic()
    version = container.run("autotune", "--version").stdout
    assert project_version() in version, version
    torch_version = container.run("python3", "-c", "import torch; print(torch.__version__)").stdout.strip()
    assert tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2]) >= (2, 11), torch_version
    say(request, f"autotune --version in the image: {version.strip()} (torch {torch_version}), "
                 f"{time.monotonic() - start:.1f} s")
    where = container.run("python3", "-c", "import autotune; print(autotune.__file__)").stdout.strip()
    assert where.startswith("/opt/autotune/"), f"autotune is not the editable install of /opt/autotune: {where}"
    # The package data (GPU profiles, plan schema) came along with the editable install.
    profiles = container.run("autotune", "profiles").stdout
    assert "a100-40gb" in profiles and "h100-80gb" in profiles, profiles
    # The user's folder on /work, as docs/container.md mounts it: the plan lands there, on the host.
    (tmp_path / "examples").mkdir()
    shutil.copy(CONTEXT / "examples" / "tiny_lm.py", tmp_path / "examples")
    command = readme_quickstart()
    start = time.monotonic()
    planned = container.run(*command, "--quiet", volumes=[f"{tmp_path}:/work"], workdir="/work")
    say(request, f"README quickstart `{' '.join(command)}` in the image: {time.monotonic() - start:.0f} s")
    assert "plan written to plan.json" in planned.stdout, planned.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["target_batch"] == 128 and plan["world_size"] == 1
    assert sum(plan["micro_batches"]) * plan["world_size"] == 128
    assert plan["device"]["kind"] == "cpu" and plan["device"]["budget_bytes"] == 128 * 2**20
    assert plan["predicted_peak_bytes"] <= plan["device"]["budget_bytes"]
    assert plan["versions"]["torch"] == torch_version


def test_jupyterlab_is_the_default_command_and_answers_with_its_token(request, container, tmp_path):
    port = free_port()
    log = tmp_path / "jupyter.log"
    start = time.monotonic()
    jupyter = container.start(*container.entrypoint, *with_port(container.cmd, port), log=log)
    try:
        token = wait_for(log, rf"http://127\.0\.0\.1:{port}/lab\?token=([0-9a-f]+)", jupyter, 180).group(1)
        status, body = http_get(f"http://127.0.0.1:{port}/api?token={token}")
        say(request, f"JupyterLab (the default command) printed its token after {time.monotonic() - start:.1f} s")
        assert status == 200 and "version" in json.loads(body), (status, body)
        assert http_get(f"http://127.0.0.1:{port}/api/status")[0] == 403
        status, body = http_get(f"http://127.0.0.1:{port}/api/status?token={token}")
        assert status == 200, (status, body)
        status, body = http_get(f"http://127.0.0.1:{port}/api/contents/examples?token={token}")
        assert status == 200 and "notebook.ipynb" in {c["name"] for c in json.loads(body)["content"]}
    finally:
        container.stop()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "JupyterLab still listens after it was stopped"


NOTEBOOK_RUNNER = """
import nbclient, nbformat, shutil
for name in ("notebook.ipynb", "tiny_lm.py"):
    shutil.copy("/opt/autotune/examples/" + name, name)
notebook = nbformat.read("notebook.ipynb", as_version=4)
nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": "."}}).execute()
nbformat.write(notebook, "executed.ipynb")
"""


def test_example_notebook_runs_inside_the_image(request, container, tmp_path):
    start = time.monotonic()
    container.run("python3", "-c", NOTEBOOK_RUNNER, volumes=[f"{tmp_path}:/work"], workdir="/work")
    say(request, f"examples/notebook.ipynb executed in the image (nbclient): {time.monotonic() - start:.0f} s")
    cells = [c for c in json.loads((tmp_path / "executed.ipynb").read_text())["cells"] if c["cell_type"] == "code"]

    def outputs(cell, kind):
        return "".join("".join(o.get("data", {}).get(kind, "")) + ("".join(o.get("text", "")) if kind == "text/plain" else "")
                       for o in cell["outputs"])

    assert not [o for c in cells for o in c["outputs"] if o.get("output_type") == "error"]
    probe, plan, memory, train, loss = cells[1:]
    assert "ProbeResult(max_micro_batch=" in outputs(probe, "text/plain")
    assert "Plan(" in outputs(plan, "text/plain") and "= 16" in outputs(plan, "text/plain")
    assert 'id="planned"' in outputs(memory, "image/svg+xml")
    assert "TrainResult(steps=3" in outputs(train, "text/plain")
    assert 'id="loss-0"' in outputs(loss, "image/svg+xml")
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_ssh_build_logs_in_with_a_generated_key_and_runs_autotune(request, ssh_image, tmp_path):
    key = tmp_path / "id_ed25519"
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
    ssh_port, jupyter_port = free_port(), free_port()
    box = Container(ssh_image)
    log = tmp_path / "entrypoint.log"
    start = time.monotonic()
    try:
        entry = box.start(*box.entrypoint, *with_port(box.cmd, jupyter_port), log=log,
                          env=[f"SSH_PUBLIC_KEY={(tmp_path / 'id_ed25519.pub').read_text().strip()}",
                               f"SSH_PORT={ssh_port}"])
        wait_for(log, rf"sshd listening on port {ssh_port}", entry, 120)
        wait_for(log, rf"http://127\.0\.0\.1:{jupyter_port}/lab\?token=", entry, 180)
        ssh = ["ssh", "-i", key, "-p", ssh_port, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
               "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "root@127.0.0.1"]
        logged_in = run(*ssh, "autotune", "--version", timeout=120)
        say(request, f"ssh -p {ssh_port} root@127.0.0.1 autotune --version: {logged_in.stdout.strip()} "
                     f"({time.monotonic() - start:.1f} s from the entrypoint's start)")
        assert project_version() in logged_in.stdout
        image_path = next(e.split("=", 1)[1] for e in box.env if e.startswith("PATH="))
        assert run(*ssh, "printenv", "PATH", timeout=60).stdout.strip() == image_path
        # Password logins are off: without the key, the login fails.
        refused = run("ssh", "-p", ssh_port, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                      "-o", "UserKnownHostsFile=/dev/null", "-o", "PubkeyAuthentication=no",
                      "root@127.0.0.1", "true", timeout=60, check=False)
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr
    finally:
        kill_listeners(ssh_port)
        box.remove()
    for port in (ssh_port, jupyter_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"


def test_an_image_without_sshd_refuses_a_key(cpu_image, tmp_path):
    box = Container(cpu_image)
    try:
        # The message goes to a file in the mounted folder: buildah once dropped a short-lived
        # command's stderr here (exit status kept, output gone; not seen again in 12 tries).
        refused = box.run("sh", "-c", 'exec "$@" 2>/work/stderr.txt', "sh", *box.entrypoint, "true",
                          env=["SSH_PUBLIC_KEY=ssh-ed25519 AAAA test"], volumes=[f"{tmp_path}:/work"], check=False)
    finally:
        box.remove()
    assert refused.returncode == 1, refused
    assert "WITH_SSH=1" in (tmp_path / "stderr.txt").read_text()
