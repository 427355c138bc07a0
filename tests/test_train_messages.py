"""What `autotune train` says about its run: warmup it cannot count, and the noise scale under
FSDP."""

import dataclasses

import pytest

from autotune.planning.types import LRDecision
from autotune.training import train
from autotune.training.noise_scale import unavailable_reason
from autotune.training.schedule import describe_warmup

from train_helpers import make_plan, mlp_workload

pytestmark = pytest.mark.usefixtures("one_thread")


def _advised_but_uncounted(plan):
    # The LR grows ×4 and the plan advises ~5 epochs of warmup, but knew no dataset size.
    plan.lr = LRDecision(rule="linear", base_lr=0.1, base_batch=2, scale=4.0, lr=0.4, warmup_steps=0)
    return plan


def test_an_advised_warmup_without_a_step_count_is_said_not_run_as_0_steps(capsys):
    # The run's first line said "warmup 0 steps".
    plan = _advised_but_uncounted(make_plan([4, 4]))
    train(plan, mlp_workload(), steps=1, progress=True, measure_noise_scale=False)
    err = capsys.readouterr().err
    assert "warmup 0 steps" not in err
    assert "no warmup: the plan advises warming the ×4 LR up over about 5 epochs" in err
    assert "define build_dataset() and re-plan" in err


def test_warmup_descriptions():
    workload = mlp_workload()
    plan = make_plan([4], lr=0.1, warmup=12)
    assert describe_warmup(plan, workload) == "warmup 12 steps"
    assert describe_warmup(make_plan([4], lr=0.1), workload) == "no warmup"
    own = dataclasses.replace(workload, build_scheduler=lambda optimizer, plan: None)
    assert describe_warmup(_advised_but_uncounted(make_plan([4])), own) == "the model file's build_scheduler"


def test_the_noise_scale_message_under_fsdp_speaks_of_fsdp():
    # It spoke of DDP all-reducing under FSDP.
    fsdp = unavailable_reason(micro_steps=1, world_size=2, sharded=True)
    assert "FSDP reduce-scatters" in fsdp and "DDP" not in fsdp
    assert "DDP all-reduces" in unavailable_reason(micro_steps=1, world_size=2)


def test_save_writes_what_its_help_says(tmp_path):
    # The help described a bare state dict; the file holds {"model": ..., "steps": n}.
    import torch
    from click.testing import CliRunner

    from autotune.cli.main import cli

    help_text = " ".join(CliRunner().invoke(cli, ["train", "--help"]).output.split())
    assert '--save FILE Write {"model": state_dict, "steps": n} here' in help_text
    path = tmp_path / "final.pt"
    train(make_plan([4]), mlp_workload(), steps=2, progress=False, save_path=path,
          measure_noise_scale=False)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == {"model", "steps"} and saved["steps"] == 2
