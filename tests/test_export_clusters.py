"""Cluster exports (issue 23): the sbatch script runs under stub srun/sbatch/scontrol and launches
the plan's world; the Kubeflow manifests validate against the operators' own CRD schemas
(tests/data/kubeflow, versions in its README); each export names what the user fills in, and
nothing else."""

import json
import os
import py_compile
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.errors import ConfigError
from autotune.planning import clusters
from autotune.planning.export import CLUSTER_TARGETS, TARGETS, export_plan
from autotune.planning.planfile import save_plan
from autotune.training.checkpoint import CHECKPOINT_NAME
from autotune.training.sharded_checkpoint import POINTER_NAME
from plan_helpers import device, fingerprint, make_plan

TESTS = Path(__file__).resolve().parent
SCHEMAS = TESTS / "data" / "kubeflow"
CLUSTER = ("slurm", "submitit", "kubernetes", "kubernetes-trainjob", "ray")


def _plan(world_size=16, kind="cuda", has_dataset=True):
    plan = make_plan(16 * world_size, 64, world_size=world_size,
                     workload=fingerprint(has_dataset=has_dataset, source="models/lm.py"))
    plan.device = device(kind=kind)
    return plan


def test_cluster_targets_are_export_targets():
    assert set(CLUSTER) <= set(TARGETS) and set(CLUSTER_TARGETS) <= set(TARGETS)
    assert set(clusters.CHECKPOINT_FILES) == {CHECKPOINT_NAME, POINTER_NAME}  # what the loop writes


@pytest.mark.parametrize("target", CLUSTER)
@pytest.mark.parametrize("has_dataset", [True, False])
def test_notes_name_every_placeholder_and_nothing_else(target, has_dataset):
    exported = export_plan(_plan(has_dataset=has_dataset), target)
    text = exported.render()
    named = {note.split(":")[0] for note in exported.notes}
    assert named == clusters.placeholders(text)  # each note is one FILL_IN_..., each one noted
    assert all(note.split(":")[0].startswith(clusters.PLACEHOLDER) for note in exported.notes)
    assert ("FILL_IN_steps" in named) is (not has_dataset)
    for note in exported.notes:  # and the file says so too
        assert f"# {note}" in text


# -- SLURM ----------------------------------------------------------------------------------------
_STUB = """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_LOG/{name}.$$.args"
env | grep -E '^SLURM_' > "$STUB_LOG/{name}.$$.env" || true
{body}
"""
_SBATCH = """# run the script as slurmd would: the #SBATCH lines give the allocation
nodes=$(sed -n 's/^#SBATCH --nodes=//p' "$1")
export SLURM_JOB_ID=4242 SLURM_JOB_NUM_NODES=$nodes SLURM_NNODES=$nodes
export SLURM_JOB_NODELIST="gpu[07-$(printf %02d $((6 + nodes)))]"
cd "$(dirname "$1")" && bash "$1"
"""
_SCONTROL = """[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] || exit 3
printf 'gpu07\\ngpu08\\n'
"""


def _stubs(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in (("sbatch", _SBATCH), ("srun", ""), ("scontrol", _SCONTROL)):
        path = bin_dir / name
        path.write_text(_STUB.format(name=name, body=body))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(log))
    return env, log


def _recorded(log, name):
    return [path.read_text().splitlines() for path in sorted(log.glob(f"{name}.*.args"))]


def test_slurm_script_passes_bash_n_and_launches_the_plans_world(tmp_path):
    plan = _plan(world_size=16)
    script = tmp_path / "job.sh"
    script.write_text(export_plan(plan, "slurm", plan_path="runs/plan.json", nproc_per_node=8).render())
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=FILL_IN_time", "#SBATCH --partition=FILL_IN_partition",
                 "#SBATCH --account=FILL_IN_account"):
        assert line + "\n" in text
    env, log = _stubs(tmp_path)
    for expect_resume in (False, True):
        done = subprocess.run(["sbatch", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        (args,) = _recorded(log, "srun")
        for path in log.glob("srun.*"):
            path.unlink()
        assert args[:3] == ["--kill-on-bad-exit=1", "torchrun", "--nnodes=2"]
        options = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
        assert int(options["--nnodes"]) * int(options["--nproc-per-node"]) == plan.world_size == 16
        assert options["--rdzv-backend"] == "c10d"
        assert options["--rdzv-endpoint"] == f"gpu07:{20000 + 4242}"  # the allocation's first node
        assert options["--rdzv-id"] == "4242"
        train = args[args.index("-m"):]
        assert train[:5] == ["-m", "autotune", "train", "models/lm.py", "--plan"]
        assert ("--resume" in train) is expect_resume
        assert train[train.index("--checkpoint-dir") + 1] == clusters.SLURM_CHECKPOINT_DIR
        # the second submission finds a checkpoint: a resubmitted job resumes
        (tmp_path / clusters.SLURM_CHECKPOINT_DIR).mkdir(exist_ok=True)
        (tmp_path / clusters.SLURM_CHECKPOINT_DIR / CHECKPOINT_NAME).write_bytes(b"")
    assert _recorded(log, "scontrol")[0] == ["show", "hostnames", "gpu[07-08]"]


def test_slurm_cpu_plan_asks_for_cpus_not_gpus():
    text = export_plan(_plan(world_size=4, kind="cpu"), "slurm").render()
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --cpus-per-task=4\n" in text
    assert "gpus" not in text and "--nproc-per-node=4" in text


def test_the_world_must_split_into_whole_nodes():
    with pytest.raises(ConfigError, match=r"nproc_per_node=6 does not divide the plan's world size 16 "
                                          r"into whole nodes .* use one of 1, 2, 4, 8, 16"):
        export_plan(_plan(), "slurm", nproc_per_node=6)
    with pytest.raises(ConfigError, match=r"nproc_per_node=8 lays the world out .* --to hf takes"):
        export_plan(_plan(), "hf", nproc_per_node=8)
    assert clusters.layout(_plan(world_size=12)) == clusters.Layout(nodes=2, per_node=6)
    assert clusters.layout(_plan(world_size=3, kind="cpu")) == clusters.Layout(nodes=1, per_node=3)


def test_cli_export_names_the_option(tmp_path):
    path = save_plan(_plan(), tmp_path / "plan.json")
    result = CliRunner().invoke(cli, ["export", str(path), "--to", "slurm", "--nproc-per-node", "6"])
    assert result.exit_code == 2 and "--nproc-per-node 6 does not divide" in result.output
    result = CliRunner().invoke(cli, ["export", str(path), "--to", "slurm", "--nproc-per-node", "4"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --nodes=4" in result.stdout and "note: FILL_IN_partition" in result.stderr


def test_submitit_launcher_compiles_and_uses_slurm_tasks(tmp_path):
    path = tmp_path / "submit.py"
    path.write_text(export_plan(_plan(), "submitit", nproc_per_node=8).render())
    py_compile.compile(str(path), doraise=True)
    text = path.read_text()
    assert "nodes=2, tasks_per_node=8, gpus_per_node=8" in text


def test_torchrun_across_nodes(tmp_path):
    single = export_plan(_plan(world_size=4, kind="cpu"), "torchrun").config
    assert single.startswith("torchrun --standalone --nproc_per_node=4 ")  # one node: as before
    exported = export_plan(_plan(world_size=4, kind="cpu"), "torchrun", nproc_per_node=2)
    script = tmp_path / "run.sh"
    script.write_text(exported.render())
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    words = shlex.split(exported.config)
    assert words[:3] == ["torchrun", "--nnodes=2", "--nproc-per-node=2"]
    assert "--rdzv-backend=c10d" in words and "--max-restarts=3" in words
    env = {k: v for k, v in os.environ.items() if k != "HEAD_NODE"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "set HEAD_NODE to the address of the first node" in done.stderr


def test_torchrun_lays_a_cuda_plan_out_as_the_cluster_exports_do():
    # Nodes of up to 8 GPUs by default (docs/clusters.md), as --to slurm: a 16-GPU plan was one
    # --standalone node of 16 processes.
    words = shlex.split(export_plan(_plan(world_size=16), "torchrun").config)
    assert words[:3] == ["torchrun", "--nnodes=2", "--nproc-per-node=8"]
    assert export_plan(_plan(world_size=8), "torchrun").config.startswith(
        "torchrun --standalone --nproc_per_node=8 ")


def test_an_export_run_elsewhere_names_the_model_file_as_that_folder_reaches_it(tmp_path, monkeypatch):
    # The plan names models/lm.py from where it was planned: exported from another folder, the
    # command named it as it was, which does not exist from there.
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "lm.py").write_text("# a model file\n")
    import hashlib

    plan = _plan(world_size=2, kind="cpu")
    plan.workload.file_sha256 = hashlib.sha256((project / "models" / "lm.py").read_bytes()).hexdigest()
    save_plan(plan, project / "plan.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for target in ("torchrun", "slurm"):
        result = CliRunner().invoke(cli, ["export", str(project / "plan.json"), "--to", target])
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.replace("\\\n", " ").split())  # the script's continued lines
        assert f"train {project / 'models' / 'lm.py'} --plan {project / 'plan.json'}" in text, (target, text)


# -- Kubernetes -----------------------------------------------------------------------------------
def _schema(name):
    return json.loads((SCHEMAS / name).read_text())


def _unknown_fields(value, schema, where="") -> list[str]:
    """Fields the schema does not declare: the API server prunes them without a word, so a
    misspelt field validates and is lost."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string"):
        return []
    if where == ".metadata":  # ObjectMeta: the API server's own schema, not the CRD's
        return []
    found = []
    if isinstance(value, dict):
        properties, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                found += _unknown_fields(item, properties[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                found += _unknown_fields(item, extra, f"{where}.{key}")
            else:
                found.append(f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += _unknown_fields(item, schema["items"], f"{where}[{index}]")
    return found


@pytest.mark.parametrize("target, kind, schema", [
    ("kubernetes", "PyTorchJob", "pytorchjob-v1.9.0.schema.json"),
    ("kubernetes-trainjob", "TrainJob", "trainjob-v2.3.0.schema.json"),
])
@pytest.mark.parametrize("nproc_per_node, nodes", [(8, 2), (16, 1), (4, 4)])
def test_kubeflow_manifests_validate_against_the_crd_schemas(target, kind, schema, nproc_per_node, nodes):
    jsonschema = pytest.importorskip("jsonschema")
    yaml = pytest.importorskip("yaml")
    plan = _plan(world_size=16)
    text = export_plan(plan, target, nproc_per_node=nproc_per_node).render()
    claim, job = list(yaml.safe_load_all(text))
    assert job == export_plan(plan, target, nproc_per_node=nproc_per_node).config["documents"][1]
    crd = _schema(schema)
    jsonschema.validate(job, crd, cls=jsonschema.Draft7Validator)
    assert _unknown_fields(job, crd) == []
    # The CRDs' CEL rule (x-kubernetes-validations), which jsonschema does not run:
    assert len(job["metadata"]["name"]) <= 63
    assert job["kind"] == kind
    import re
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    if kind == "PyTorchJob":
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert sum(r["replicas"] for r in replicas.values()) == nodes
        assert int(job["spec"]["nprocPerNode"]) == nproc_per_node
        pods = [r["template"]["spec"] for r in replicas.values()]
        container = pods[0]["containers"][0]
        assert container["name"] == "pytorch"
        volumes = pods[0]["volumes"]
    else:
        trainer = job["spec"]["trainer"]
        assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, nproc_per_node)
        container = trainer
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        volumes = pod["volumes"]
        assert pod["containers"][0]["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/checkpoints"}]
    resources = container.get("resources") or container["resourcesPerNode"]
    assert resources["limits"]["nvidia.com/gpu"] == nproc_per_node
    assert container["image"] == "FILL_IN_image"
    assert volumes == [{"name": "checkpoints",
                        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}]
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"]["storageClassName"] == "FILL_IN_storage_class"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany" if nodes > 1 else "ReadWriteOnce"]


def test_the_schema_check_catches_wrong_fields():
    jsonschema = pytest.importorskip("jsonschema")
    job = export_plan(_plan(), "kubernetes-trainjob").config["documents"][1]
    crd = _schema("trainjob-v2.3.0.schema.json")
    job["spec"]["trainer"]["numProcPerNode"] = "8"  # TrainJob v2.3 takes an integer
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd, cls=jsonschema.Draft7Validator)
    job["spec"]["trainer"]["numProcPerNode"] = 8
    job["spec"]["trainer"]["nprocPerNode"] = 8
    assert _unknown_fields(job, crd) == [".spec.trainer.nprocPerNode"]


def test_the_container_command_resumes_when_the_volume_holds_a_checkpoint(tmp_path):
    job = export_plan(_plan(), "kubernetes", nproc_per_node=8).config["documents"][1]
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    env, log = _stubs(tmp_path)
    stub = tmp_path / "bin" / "torchrun"
    stub.write_text(_STUB.format(name="torchrun", body=""))
    stub.chmod(0o755)
    volume = tmp_path / "volume"
    volume.mkdir()
    script = command[2].replace(clusters.K8S_CHECKPOINT_DIR, str(volume))
    for resume in (False, True):
        assert subprocess.run(["sh", "-c", script], env=env, timeout=30).returncode == 0
        (args,) = _recorded(log, "torchrun")
        for path in log.glob("torchrun.*"):
            path.unlink()
        assert args[:2] == ["--nnodes=2", "--nproc-per-node=8"]
        assert ("--resume" in args) is resume
        (volume / POINTER_NAME).write_text("{}")


def test_kubernetes_cpu_plan_requests_cpus():
    job = export_plan(_plan(world_size=2, kind="cpu"), "kubernetes").config["documents"][1]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "2"}}
    assert "Worker" not in job["spec"]["pytorchReplicaSpecs"]


# -- Ray ------------------------------------------------------------------------------------------
def test_ray_driver_compiles_and_scales_from_the_plan(tmp_path):
    path = tmp_path / "train_ray.py"
    path.write_text(export_plan(_plan(world_size=4, kind="cpu"), "ray", plan_path="plan.json").render())
    py_compile.compile(str(path), doraise=True)
    assert "trainer('plan.json', 'models/lm.py', storage_path='FILL_IN_storage_path'" in path.read_text()
    # importing autotune does not import ray: the helper imports it when called
    probe = subprocess.run([sys.executable, "-c", "import sys, autotune, autotune.integrations.ray; "
                            "print('ray' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


_SRUN_NODES = """# srun --ntasks-per-node=1 on the allocation: the command once per node, here all on this machine
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$STUB_LOG/node$node.out" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_and_a_resubmission_resumes(tmp_path):
    """The exported script as sbatch would run it, srun starting its torchrun on two "nodes" of
    this machine (the stub's allocation is localhost twice): 2 × 2 gloo ranks train the plan."""
    import dataclasses
    import hashlib
    import socket

    from train_helpers import make_plan as loop_plan

    plan = loop_plan([2, 2], world_size=4, lr=1e-2, clip=1.0)
    plan = dataclasses.replace(plan, workload=dataclasses.replace(
        plan.workload, source=str(TESTS / "cluster_model.py"), has_dataset=True,
        file_sha256=hashlib.sha256((TESTS / "cluster_model.py").read_bytes()).hexdigest()))
    plan_file = save_plan(plan, tmp_path / "plan.json")
    script = tmp_path / "job.sh"
    script.write_text(export_plan(plan, "slurm", plan_path=str(plan_file), nproc_per_node=2).render())
    env, log = _stubs(tmp_path)
    (tmp_path / "bin" / "srun").write_text(_STUB.format(name="srun", body=_SRUN_NODES))
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/bash\nprintf 'localhost\\nlocalhost\\n'\n")
    for job_id in range(4242, 24242, 97):  # the script's rendezvous port: 20000 + job id % 20000
        with socket.socket() as sock:
            try:
                sock.bind(("localhost", 20000 + job_id % 20000))
                break
            except OSError:
                continue
    sbatch = _SBATCH.replace("SLURM_JOB_ID=4242", f"SLURM_JOB_ID={job_id}").replace(
        '"gpu[07-$(printf %02d $((6 + nodes)))]"', "localhost,localhost")
    (tmp_path / "bin" / "sbatch").write_text(_STUB.format(name="sbatch", body=sbatch))
    env["OMP_NUM_THREADS"] = "1"
    for run, expected in ((1, "trained 3 optimizer steps"), (2, "trained 0 optimizer steps (the checkpoint is at step 3)")):
        done = subprocess.run(["sbatch", str(script)], env=env, capture_output=True, text=True, timeout=100)
        output = "\n".join(p.read_text() for p in sorted(log.glob("node*.out")))
        assert done.returncode == 0, output[-6000:]
        assert expected in output
        assert ("--resume" in _recorded(log, "srun")[-1]) is (run == 2)
        for path in log.glob("srun.*"):
            path.unlink()
    assert (tmp_path / clusters.SLURM_CHECKPOINT_DIR / CHECKPOINT_NAME).exists()
