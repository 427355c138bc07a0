"""autotune.integrations.transformers: TrainingArguments from a plan, and the first-step check."""

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from autotune.errors import ConfigError  # noqa: E402
from autotune.integrations.transformers import (PlanCallback, check_arguments,  # noqa: E402
                                                first_step_problem, training_arguments)
from autotune.memory.base import DeviceInfo  # noqa: E402
from autotune.workload.checkpoint_count import Checkpointing  # noqa: E402
from plan_helpers import make_plan  # noqa: E402
from real_models import real_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MiB = 1 << 20


def test_bf16_cpu_plan_gives_arguments_trainer_accepts(tmp_path):
    plan = make_plan(128, 32, base_lr=1e-3, base_batch=32, dataset_size=1024, lr_rule="linear")
    plan.precision = "bf16"
    args = training_arguments(plan, output_dir=str(tmp_path), num_train_epochs=2)
    assert args.use_cpu and args.bf16 and args.num_train_epochs == 2
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (32, 4)
    assert args.warmup_steps == 40 and args.learning_rate == pytest.approx(4e-3)


def test_checkpointing_goes_through_the_models_own_switch(tmp_path):
    plan = make_plan(8, 4)
    plan.checkpointing = Checkpointing.every_block()
    args = training_arguments(plan, output_dir=str(tmp_path))
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}


def _train_with_callback(plan, tmp_path, *, max_steps):
    workload = real_model("gpt2_varlen")
    callback = PlanCallback(plan)
    model = workload.model()
    trainer = transformers.Trainer(
        model=model, train_dataset=workload.build_dataset(), data_collator=workload.collate_fn,
        args=training_arguments(plan, output_dir=str(tmp_path), max_steps=max_steps, save_strategy="no",
                                logging_strategy="no", disable_tqdm=True),
        callbacks=[callback])
    trainer.train()
    return trainer, model, callback


def test_trainer_runs_the_plan_and_the_callback_checks_it(tmp_path):
    plan = make_plan(8, 4)  # 4 × 2
    plan.checkpointing = Checkpointing.every_block()
    trainer, model, callback = _train_with_callback(plan, tmp_path, max_steps=2)
    assert trainer.state.global_step == 2
    assert model.is_activation_checkpointing
    assert callback.report.startswith("fits: the first step's peak")  # counted on the CPU


def _first_step_report(tmp_path, budget):
    plan = make_plan(8, 4)  # 4 × 2, made for a CPU of ``budget`` bytes
    plan.device = dataclasses.replace(plan.device, budget_bytes=budget)
    return _train_with_callback(plan, tmp_path, max_steps=1)[2].report


def test_on_the_cpu_the_first_steps_tensors_are_counted_against_the_plans_budget(tmp_path):
    fits = _first_step_report(tmp_path, 1 << 30)
    peak = float(fits.split("peak ")[1].split(" MiB")[0]) * MiB
    assert fits.startswith("fits:") and 0 < peak < 1 << 30
    # The same step, with no room for the headroom: the report rounds the peak to 0.01 MiB (5.5056
    # MiB read as 5.51 MiB would be a budget above the peak), so a budget one rounding step lower.
    tight = _first_step_report(tmp_path, int(peak - 0.01 * MiB))
    assert "passes" in tight and "per_device_train_batch_size=" in tight and "autotune verify" in tight


def test_callback_refuses_arguments_that_are_not_the_plan(tmp_path):
    plan = make_plan(8, 4)
    args = training_arguments(plan, output_dir=str(tmp_path), gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match=r"4 × gradient_accumulation_steps 4 × 1 process\(es\) = 16, "
                                          r"but the plan is 8"):
        check_arguments(plan, args)


def test_first_step_problem_says_what_to_do():
    plan = make_plan(64, 16)  # 16 × 4, headroom 0
    plan = dataclasses.replace(plan, headroom=0.1, predicted_peak_bytes=80 * MiB,
                               device=DeviceInfo(kind="cuda", name="A100", budget_bytes=100 * MiB))
    assert first_step_problem(plan, peak_bytes=85 * MiB, budget_bytes=100 * MiB) is None
    message = first_step_problem(plan, peak_bytes=120 * MiB, budget_bytes=100 * MiB)
    assert "passes 90.00 MiB" in message and "predicted 80.00 MiB on A100" in message
    assert "per_device_train_batch_size=8, gradient_accumulation_steps=8" in message


def test_the_smaller_split_starts_from_the_micro_batch_that_ran():
    # An uneven plan (43 + 43 + 42) runs in Trainer as its even split, 32 × 4: a peak 20% over
    # at 32 suggested a split scaled down from 43 (35, which does not even divide 128 evenly).
    plan = dataclasses.replace(make_plan(128, 50), headroom=0.0)
    assert plan.micro_batches == [43, 43, 42]
    message = first_step_problem(plan, peak_bytes=120 * MiB, budget_bytes=100 * MiB, micro_batch=32)
    assert "per_device_train_batch_size=16, gradient_accumulation_steps=8" in message



def test_fsdp_plans_checkpoint_through_fsdp_config(tmp_path):
    from autotune.distributed.sharding import Sharding

    plan = make_plan(64, 16, world_size=2)
    plan.sharding, plan.shard_group, plan.checkpointing = Sharding.FSDP, 2, Checkpointing.every_block()
    args = training_arguments(plan, output_dir=str(tmp_path))
    assert args.fsdp_config["activation_checkpointing"] is True
    assert not args.activation_checkpointing and not args.activation_checkpointing_kwargs
