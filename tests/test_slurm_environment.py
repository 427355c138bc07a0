"""The launch environment (issue 23): torchrun's variables, else SLURM's task variables (an srun step
without torchrun), else one process; and two srun-style tasks with only SLURM's environment train
a world-size-2 plan to the parameters of one process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotune.distributed.environment import Launch, adopt_slurm, first_host, launch_environment
from autotune.errors import ConfigError
from autotune.planning.planfile import save_plan
from autotune.training import train
from train_helpers import make_plan

TESTS = Path(__file__).resolve().parent
MODEL = TESTS / "cluster_model.py"

SRUN_TASK = {"SLURM_JOB_ID": "12345", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
             "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
             "SLURM_JOB_NODELIST": "gpu[007-008]"}


def test_torchrun_environment():
    launch = launch_environment({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1",
                                 "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", **SRUN_TASK})
    assert launch == Launch("torchrun", world_size=8, rank=5, local_rank=1, per_node=4, nodes=2)
    assert launch.describe() == "8 processes (2 nodes × 4 per node, started by torchrun)"
    assert launch_environment({}) == Launch("none", 1, 0, 0, 1, 1)


def test_slurm_task_environment_where_torchruns_is_absent():
    env = dict(SRUN_TASK)
    assert launch_environment(env) == Launch("slurm", world_size=4, rank=3, local_rank=1, per_node=2, nodes=2)
    adopted = adopt_slurm(env)
    assert adopted.describe() == "4 processes (2 nodes × 2 per node, started by slurm)"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu007", "MASTER_PORT": str(10000 + 12345 % 20000)}
    # torchrun's variables win: srun torchrun (the sbatch export) is left alone
    env = {**SRUN_TASK, "WORLD_SIZE": "8", "RANK": "0"}
    assert adopt_slurm(env) is None and "MASTER_ADDR" not in env
    # a batch script's own shell is no task: SLURM_NTASKS alone does not make a world
    env = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1"}
    assert adopt_slurm(env) is None and launch_environment(env).launcher == "none"
    env = {**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}
    adopt_slurm(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "4000")  # given ones kept


@pytest.mark.parametrize("nodelist, first", [("gpu[07-09,12],cpu3", "gpu07"), ("node1,node2", "node1"),
                                             ("a-b[001-002]", "a-b001"), ("solo", "solo")])
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    assert first_host(nodelist) == first


def test_bad_values_name_the_variable():
    with pytest.raises(ConfigError, match=r"SLURM_PROCID='x' is not a count"):
        launch_environment({**SRUN_TASK, "SLURM_PROCID": "x"})
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='0' is not a positive count"):
        launch_environment({"WORLD_SIZE": "0"})


@pytest.mark.slow
def test_two_srun_tasks_train_from_slurms_environment_alone(tmp_path):
    plan_file = save_plan(make_plan([2, 2], world_size=2, lr=1e-2, clip=1.0), tmp_path / "plan.json")
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
            ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR")}
    tasks = []
    for rank in range(2):
        env = dict(base, OMP_NUM_THREADS="1", MASTER_PORT=str(port), SLURM_JOB_ID="77",
                   SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                   SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost")
        command = [sys.executable, "-m", "autotune", "train", str(MODEL), "--plan", str(plan_file),
                   "--steps", "6", "-q", "--save", str(tmp_path / "srun.pt")]
        tasks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [task.communicate(timeout=100)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    single = train(make_plan([4, 4], lr=1e-2, clip=1.0), str(MODEL), steps=6, progress=False)
    trained = torch.load(tmp_path / "srun.pt", weights_only=True)["model"]
    difference = max(float((trained[k] - v).abs().max()) for k, v in single.model.state_dict().items())
    assert difference <= 1e-6
