"""Exports for other runners; each builds the runner's own config object where it is installed."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from autotune.planning import export
from autotune.errors import ConfigError
from autotune.distributed.sharding import Sharding
from autotune.planning.export import TARGETS, even_split, export_plan
from autotune.workload.checkpoint_count import Checkpointing
from plan_helpers import device, fingerprint, make_plan

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def even():
    return make_plan(128, 32, base_lr=1e-3, base_batch=32)  # 32 × 4


@pytest.fixture
def uneven():
    return make_plan(127, 50)  # 43 + 42 + 42


def test_even_split_of_an_even_plan_is_the_plan(even):
    split = even_split(even)
    assert (split.micro_batch, split.accumulation_steps, split.data_parallel) == (32, 4, 1)


def test_even_split_of_an_uneven_plan_keeps_the_effective_batch():
    plan = make_plan(128, 50)
    assert plan.micro_batches == [43, 43, 42]
    split = even_split(plan)
    assert split.effective_batch == 128
    assert (split.micro_batch, split.accumulation_steps) == (32, 4)


def test_hf(even):
    config = export_plan(even, "hf").config
    assert config["per_device_train_batch_size"] == 32
    assert config["gradient_accumulation_steps"] == 4
    assert config["learning_rate"] == pytest.approx(1e-3 * 2)
    assert config["fp16"] is False and config["bf16"] is False
    assert config["max_grad_norm"] == 1.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_builds_training_arguments(even, tmp_path, checkpointing):
    transformers = pytest.importorskip("transformers")
    even.checkpointing = Checkpointing.parse(checkpointing)
    config = export_plan(even, "hf").config
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated field names
        args = transformers.TrainingArguments(output_dir=str(tmp_path), **config)
    assert args.gradient_accumulation_steps == 4
    field = export._hf_checkpointing_field()
    assert field in config and getattr(args, field) is checkpointing


def test_hf_uses_activation_checkpointing_where_transformers_has_it(even):
    transformers = pytest.importorskip("transformers")
    if "activation_checkpointing" not in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}:
        pytest.skip("this transformers predates activation_checkpointing")
    exported = export_plan(even, "hf")
    assert exported.config["activation_checkpointing"] is False
    assert "gradient_checkpointing" not in exported.config
    assert not any("gradient_checkpointing" in n for n in exported.notes)


def test_hf_uses_gradient_checkpointing_for_older_transformers(even, monkeypatch):
    monkeypatch.setattr(export, "_hf_checkpointing_field", lambda: "gradient_checkpointing")
    even.checkpointing = Checkpointing.every_block()
    exported = export_plan(even, "hf")
    assert exported.config["gradient_checkpointing"] is True
    assert "activation_checkpointing" not in exported.config
    assert not any("gradient_checkpointing" in n for n in exported.notes)


def test_hf_without_transformers_uses_gradient_checkpointing_and_says_why(even, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert export._hf_checkpointing_field() is None
    exported = export_plan(even, "hf")
    assert exported.config["gradient_checkpointing"] is False
    assert "activation_checkpointing" not in exported.config
    assert any("transformers could not be imported" in n and "'gradient_checkpointing'" in n
               and "'activation_checkpointing'" in n for n in exported.notes)


def test_exports_do_not_import_transformers():
    code = ("import sys, autotune, autotune.planning.export, autotune.cli.main; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_deepspeed_batch_rule(even):
    plan = make_plan(256, 32, world_size=2)
    config = export_plan(plan, "deepspeed").config
    assert config["train_batch_size"] == (config["train_micro_batch_size_per_gpu"]
                                          * config["gradient_accumulation_steps"] * 2) == 256
    assert config["bf16"] == {"enabled": False}
    assert config["gradient_clipping"] == 1.0


def test_deepspeed_fp16_section():
    plan = make_plan(64, 64)
    plan.precision = "fp16"
    config = export_plan(plan, "deepspeed").config
    assert config["fp16"]["enabled"] is True and config["bf16"]["enabled"] is False


def test_lightning(even):
    config = export_plan(even, "lightning").config
    assert config["trainer"]["accumulate_grad_batches"] == 4
    assert config["trainer"]["precision"] == "32-true"
    assert config["dataloader"]["batch_size"] == 32


def _lightning():
    try:
        import lightning
        return lightning
    except ImportError:
        return pytest.importorskip("pytorch_lightning")


def test_lightning_builds_a_trainer(even):
    lightning = _lightning()
    trainer = lightning.Trainer(**export_plan(even, "lightning").config["trainer"], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.accumulate_grad_batches == 4


def test_accelerate(even):
    exported = export_plan(even, "accelerate")
    assert exported.config["mixed_precision"] == "no"
    assert exported.config["num_processes"] == 1
    assert exported.script["accelerator"]["gradient_accumulation_steps"] == 4
    assert exported.script["dataloader"]["batch_size"] == 32
    assert exported.script["accelerator"]["cpu"] is True  # a CPU plan
    assert any("Accelerator(gradient_accumulation_steps=4, cpu=True)" in n and "batch_size=32" in n
               for n in exported.notes)


@pytest.mark.parametrize("world_size", [1, 2])
def test_accelerate_launch_loads_the_file_as_written(tmp_path, world_size):
    # The file used to nest the launch config under "config", which `accelerate launch
    # --config_file` refused ("A distributed_type must be specified"). Several CPU processes take
    # the multi-process launcher (MULTI_GPU): MULTI_CPU started one process on one machine.
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    plan = make_plan(128, 32, world_size=world_size)
    plan.precision = "bf16"
    path = tmp_path / "accelerate.json"
    path.write_text(export_plan(plan, "accelerate").render())
    loaded = load_config_from_file(str(path))
    assert loaded.num_processes == world_size and loaded.use_cpu is True
    assert str(getattr(loaded.mixed_precision, "value", loaded.mixed_precision)) == "bf16"
    assert str(getattr(loaded.distributed_type, "value", loaded.distributed_type)) == (
        "NO" if world_size == 1 else "MULTI_GPU")


def test_accelerate_builds_an_accelerator(even):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(**export_plan(even, "accelerate").script["accelerator"])
    assert accelerator.gradient_accumulation_steps == 4


def test_hf_file_of_a_bf16_cpu_plan_builds_training_arguments(tmp_path):
    # TrainingArguments refused bf16 without use_cpu on a machine with no GPU.
    transformers = pytest.importorskip("transformers")
    plan = make_plan(128, 32)
    plan.precision = "bf16"
    path = tmp_path / "hf.json"
    path.write_text(export_plan(plan, "hf").render())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **json.loads(path.read_text()))
    assert args.bf16 and args.use_cpu and args.per_device_train_batch_size == 32


def test_lightning_file_builds_a_trainer(tmp_path):
    lightning = _lightning()
    plan = make_plan(128, 32)
    plan.precision = "bf16"
    path = tmp_path / "lightning.json"
    path.write_text(export_plan(plan, "lightning").render())
    trainer = lightning.Trainer(**json.loads(path.read_text())["trainer"], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.accumulate_grad_batches == 4


def test_known_warmup_is_carried():
    plan = make_plan(128, 32, base_lr=1e-3, base_batch=32, dataset_size=1024, lr_rule="linear")
    assert plan.lr.warmup_steps == 40
    assert export_plan(plan, "hf").config["warmup_steps"] == 40
    scheduler = export_plan(plan, "deepspeed").config["scheduler"]
    assert scheduler["type"] == "WarmupLR" and scheduler["params"]["warmup_num_steps"] == 40
    assert scheduler["params"]["warmup_max_lr"] == pytest.approx(4e-3)
    # From 0, as the loop and the Trainer export warm up (it started at the base LR, 1e-3).
    assert scheduler["params"]["warmup_min_lr"] == 0.0
    for target in ("lightning", "accelerate"):
        assert any("over 40 optimizer steps" in n for n in export_plan(plan, target).notes)


def test_unknown_warmup_is_advised_not_exported_as_zero():
    # Without a dataset size the plan advises ~5 epochs of warmup; the export said warmup_steps: 0.
    plan = make_plan(128, 32, base_lr=1e-3, base_batch=32)
    assert plan.lr.scale > 1 and plan.lr.warmup_steps == 0
    for target in ("hf", "deepspeed", "lightning", "accelerate"):
        exported = export_plan(plan, target)
        assert "warmup" not in json.dumps(exported.config)
        assert any("warm it up linearly over about 5 epochs" in n for n in exported.notes)


def test_torchrun_command(even):
    plan = make_plan(128, 32, world_size=4)
    command = export_plan(plan, "torchrun", plan_path="runs/plan.json").config
    assert command == ("torchrun --standalone --nproc_per_node=4 -m autotune train model.py "
                       "--plan runs/plan.json")


def test_torchrun_takes_uneven_plans_without_a_note(uneven):
    assert not any("uneven" in note for note in export_plan(uneven, "torchrun").notes)


@pytest.mark.parametrize("has_dataset", [True, False])
def test_torchrun_gives_steps_to_a_model_file_without_a_dataset(even, has_dataset):
    # `autotune train` without a dataset refuses to start without --steps: the export failed as
    # written.
    even.workload.has_dataset = has_dataset
    exported = export_plan(even, "torchrun")
    assert exported.config.endswith("--steps 1000") is not has_dataset
    assert any("no build_dataset()" in note for note in exported.notes) is not has_dataset


@pytest.mark.parametrize("target", ["hf", "deepspeed", "lightning", "accelerate"])
def test_uneven_plans_export_the_nearest_even_plan_with_a_note(uneven, target):
    exported = export_plan(uneven, target)
    assert any("uneven (43 + 42 + 42" in n and "1 × 127" in n for n in exported.notes)
    assert any("--target-batch 126" in n and "--even" in n for n in exported.notes)
    assert "127" in json.dumps(exported.config) or target != "deepspeed"


def test_every_target_renders(even):
    for target in TARGETS:
        text = export_plan(even, target).render()
        assert text.endswith("\n") and len(text) > 20


def test_unknown_target():
    with pytest.raises(ConfigError) as info:
        export_plan(make_plan(8, 8), "keras")
    assert "--to 'keras'" in str(info.value)


def test_missing_lr_is_noted():
    plan = make_plan(64, 64)
    plan.workload.optimizer_lr = None
    exported = export_plan(plan, "hf")
    assert "learning_rate" not in exported.config
    assert any("no learning rate is exported" in n for n in exported.notes)


def test_a_plan_that_keeps_the_optimizers_lr_exports_it():
    # Trainer's default (5e-5) would not keep the model file's optimizer LR.
    plan = make_plan(64, 64)
    assert plan.lr.lr is None and plan.workload.optimizer_lr == 1e-3
    assert export_plan(plan, "hf").config["learning_rate"] == 1e-3
    assert export_plan(plan, "deepspeed").config["optimizer"]["params"]["lr"] == 1e-3
    assert any("optimizer LR 0.001 is exported as it is" in n for n in export_plan(plan, "hf").notes)


def _sgd_plan():
    plan = make_plan(128, 32, base_lr=0.1, base_batch=32, lr_rule="auto",
                     workload=fingerprint(optimizer="SGD", optimizer_lr=0.1,
                                          optimizer_settings={"momentum": 0.9, "dampening": 0,
                                                              "nesterov": False, "weight_decay": 5e-4}))
    assert plan.lr.lr == pytest.approx(0.4)  # the linear rule for SGD: 0.1 × 128 / 32
    return plan


def test_hf_trains_the_plans_optimizer_at_its_lr(tmp_path):
    # An SGD plan's linear-rule LR landed in TrainingArguments with Trainer's default AdamW.
    transformers = pytest.importorskip("transformers")
    config = export_plan(_sgd_plan(), "hf").config
    assert config["optim"] == "sgd" and config["learning_rate"] == pytest.approx(0.4)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **config)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.SGD and kwargs["lr"] == pytest.approx(0.4)
    assert kwargs["momentum"] == 0.9 and not kwargs["nesterov"]
    assert args.weight_decay == 5e-4  # Trainer puts it in the parameter groups
    assert args.lr_scheduler_type == "constant"  # not Trainer's linear decay to 0


def test_hf_adamw_takes_the_files_betas_and_decay(tmp_path):
    transformers = pytest.importorskip("transformers")
    plan = make_plan(64, 32, workload=fingerprint(
        optimizer="AdamW", optimizer_settings={"betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **export_plan(plan, "hf").config)
    assert (args.optim, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (
        "adamw_torch", 0.95, 1e-6, 0.1)


def test_deepspeed_has_the_plans_optimizer_block():
    # The DeepSpeed config had no optimizer block: DeepSpeed then needs one from the script.
    optimizer = export_plan(_sgd_plan(), "deepspeed").config["optimizer"]
    assert optimizer == {"type": "SGD", "params": {"lr": pytest.approx(0.4), "momentum": 0.9,
                                                   "dampening": 0, "nesterov": False,
                                                   "weight_decay": 5e-4}}
    getattr(torch.optim, optimizer["type"])([torch.zeros(1, requires_grad=True)], **optimizer["params"])
    adam = export_plan(make_plan(64, 32, workload=fingerprint(optimizer="Adam")), "deepspeed")
    assert adam.config["optimizer"]["params"]["adam_w_mode"] is False  # torch's Adam: L2 decay


def test_lightning_uses_gpu_for_cuda_plans(even):
    even.device = device(kind="cuda")
    assert export_plan(even, "lightning").config["trainer"]["accelerator"] == "gpu"


def _selective(plan, blocks, total):
    plan.checkpointing = Checkpointing.of(blocks, total)
    plan.workload = dataclasses.replace(plan.workload, repeated_blocks=total)
    return plan


@pytest.mark.parametrize("target", ["hf", "deepspeed", "lightning", "accelerate"])
def test_k_of_n_blocks_exports_all_of_them_with_a_note(even, target):
    exported = export_plan(_selective(even, 4, 12), target)
    note = next(n for n in exported.notes if "checkpoints 4 of 12 repeated blocks" in n)
    assert "indices 0, 3, 6, 9" in note and "all 12" in note and "blocks=4" in note
    if target == "hf":
        assert exported.config[export._hf_checkpointing_field() or "gradient_checkpointing"] is True


@pytest.mark.parametrize("blocks", [None, 12])
def test_every_block_checkpointed_needs_no_selective_note(even, blocks):
    exported = export_plan(_selective(even, blocks, 12), "hf")
    assert not any("repeated blocks" in n for n in exported.notes)
@pytest.fixture
def sharded():
    plan = make_plan(256, 32, world_size=8)
    plan.sharding, plan.shard_group = Sharding.FSDP, 8
    return plan


def test_deepspeed_zero3_for_sharded_plans(sharded):
    assert export_plan(sharded, "deepspeed").config["zero_optimization"] == {"stage": 3}
    sharded.sharding = Sharding.FSDP_OFFLOAD
    zero = export_plan(sharded, "deepspeed").config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"}
    assert "zero_optimization" not in export_plan(make_plan(256, 32, world_size=8), "deepspeed").config


def test_accelerate_fsdp2_config_is_read_by_accelerate(sharded, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin

    sharded.device = device(kind="cuda")  # Accelerate runs FSDP on accelerators only

    exported = export_plan(sharded, "accelerate").config
    path = tmp_path / "accelerate.json"
    path.write_text(json.dumps(exported))
    loaded = load_config_from_file(str(path))
    assert str(getattr(loaded.distributed_type, "value", loaded.distributed_type)) == "FSDP"
    fsdp = loaded.fsdp_config
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["fsdp_version"], reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
        cpu_offload=fsdp["fsdp_offload_params"], auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
        state_dict_type=fsdp["fsdp_state_dict_type"])
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True


def test_hf_fsdp_fields_build_training_arguments(sharded, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = export_plan(sharded, "hf").config
    assert config["fsdp"] == "full_shard auto_wrap" and config["fsdp_config"]["version"] == 2
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **{"use_cpu": True, **config})
    assert args.fsdp and args.fsdp_config["version"] == 2


def test_hf_fsdp_checkpointing_goes_in_fsdp_config(sharded, tmp_path):
    # It was the top-level training argument, which transformers refuses together with FSDP's own
    # checkpointing and which costs a redundant all-gather in backward.
    transformers = pytest.importorskip("transformers")
    sharded.checkpointing = Checkpointing.every_block()
    config = export_plan(sharded, "hf").config
    assert config["fsdp_config"]["activation_checkpointing"] is True
    assert config[export._hf_checkpointing_field()] is False
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **{"use_cpu": True, **config})
    assert args.fsdp_config["activation_checkpointing"] is True
    assert not getattr(args, export._hf_checkpointing_field())


def test_lightning_fsdp_strategy_arguments(sharded):
    _lightning()
    from lightning.pytorch.strategies import FSDPStrategy

    sharded.shard_group = 4
    exported = export_plan(sharded, "lightning")
    arguments = exported.config["fsdp_strategy"]
    strategy = FSDPStrategy(**{**arguments, "device_mesh": tuple(arguments["device_mesh"])})
    assert exported.config["fsdp_strategy"]["sharding_strategy"] == "HYBRID_SHARD"
    assert strategy.sharding_strategy.name == "HYBRID_SHARD"
    assert any("hybrid" in note for note in exported.notes)


def test_accelerate_refuses_a_cpu_sharded_plan(sharded):
    # Accelerate never runs FSDP on the CPU: the export trained unsharded replicas.
    with pytest.raises(ConfigError, match=r"Accelerate runs FSDP only on accelerators.*--to torchrun"):
        export_plan(sharded, "accelerate")


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch, target", [(32, 64), (16, 64)])
def test_accelerate_launch_trains_two_cpu_processes_with_the_target_batch(tmp_path, micro_batch,
                                                                          target):
    # Each process ran alone (distributed_type NO), each optimizer step 32 samples for a target
    # of 64. The export, launched as written, trains one group with the target effective batch.
    pytest.importorskip("accelerate")
    plan = make_plan(target, micro_batch, world_size=2)
    exported = export_plan(plan, "accelerate")
    config, script = tmp_path / "accelerate.json", tmp_path / "script.json"
    config.write_text(exported.render())
    script.write_text(json.dumps(exported.script))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(["accelerate", "launch", "--config_file", str(config),
                           str(TESTS / "accelerate_train_script.py"), str(script), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["distributed_type"] == "MULTI_CPU" and report["processes"] == 2
        assert report["samples_per_step"] == [target] * 4
    assert reports[0]["weights"] == reports[1]["weights"]
    # One model trained on 64 samples per step: what one process makes of the same windows.
    from accelerate_train_script import build

    model, data = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x, y = data[step * target:(step + 1) * target]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(torch.tensor(reports[0]["weights"]), reference, rtol=1e-5, atol=1e-6)


TINY_WITHOUT_DATASET = """
import torch
from torch import nn
BASE_LR, BASE_BATCH = 1e-2, 8

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randint(0, 2, (batch_size,))

def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
"""


@pytest.mark.slow
def test_torchrun_export_of_a_file_without_a_dataset_runs_as_written(tmp_path):
    # It omitted --steps, and `autotune train` refused to start ("give --steps N").
    from autotune import plan as make_real_plan
    from autotune.planning.planfile import save_plan

    (tmp_path / "tiny.py").write_text(TINY_WITHOUT_DATASET)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    planned = make_real_plan(str(tmp_path / "tiny.py"), target_batch=16, world_size=2,
                             memory_limit="64MiB", precision="fp32", checkpointing="off")
    assert planned.workload.has_dataset is False
    save_plan(planned, tmp_path / "plan.json")
    script = tmp_path / "run.sh"
    script.write_text(export_plan(planned, "torchrun", plan_path=str(tmp_path / "plan.json")).render())
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "trained 1000 optimizer steps" in done.stdout + done.stderr


def test_the_plan_records_the_optimizers_hyperparameters(examples_dir):
    from autotune.orchestration.planner import fingerprint_workload
    from autotune.planning.planfile import plan_from_json, plan_to_json
    from autotune.workload.contract import load_workload

    recorded = fingerprint_workload(load_workload(examples_dir / "mlp.py"))
    assert recorded.optimizer == "AdamW"
    assert recorded.optimizer_settings["betas"] == [0.9, 0.999]
    assert recorded.optimizer_settings["weight_decay"] == 0.01
    plan = make_plan(64, 32, workload=recorded)
    assert plan_from_json(plan_to_json(plan)).workload.optimizer_settings == recorded.optimizer_settings
