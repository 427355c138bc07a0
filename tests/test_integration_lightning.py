"""autotune.integrations.lightning: a plan applied to a Trainer, or planned at setup."""

import pytest
import torch

lightning = pytest.importorskip("lightning")

from autotune.errors import ConfigError  # noqa: E402
from autotune.integrations.lightning import AutotuneCallback, trainer_arguments  # noqa: E402
from autotune.workload.checkpoint_count import Checkpointing  # noqa: E402
from plan_helpers import make_plan  # noqa: E402
from real_models import real_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class Module(lightning.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.batch_sizes = []

    def training_step(self, batch, batch_idx):
        self.batch_sizes.append(len(batch["input_ids"]))
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(lightning.LightningDataModule):
    def __init__(self, workload):
        super().__init__()
        self.workload = workload
        self.batch_size = 1

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.workload.build_dataset(), batch_size=self.batch_size,
                                           collate_fn=self.workload.collate_fn)


def _trainer(plan, callback, **overrides):
    arguments = dict(trainer_arguments(plan), max_steps=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
    arguments.update(overrides)
    return lightning.Trainer(**arguments, callbacks=[callback])


def test_callback_applies_the_plan():
    workload = real_model("gpt2_varlen")
    plan = make_plan(8, 4)  # 4 × 2, clip 1.0
    plan.checkpointing = Checkpointing.every_block()
    module, data = Module(workload.model()), Data(workload)
    trainer = _trainer(plan, AutotuneCallback(plan))
    trainer.fit(module, datamodule=data)
    assert data.batch_size == 4 and trainer.accumulate_grad_batches == 2
    assert trainer.gradient_clip_val == 1.0 and trainer.global_step == 2
    assert module.batch_sizes == [4] * 4
    assert module.model.is_activation_checkpointing  # through HF's own switch


def test_callback_refuses_a_trainer_in_another_precision():
    workload = real_model("gpt2_varlen")
    plan = make_plan(8, 4)
    plan.precision = "bf16"
    trainer = _trainer(plan, AutotuneCallback(plan), precision="32-true")
    with pytest.raises(ConfigError, match=r"precision '32-true' and the plan bf16 \('bf16-mixed'\)"):
        trainer.fit(Module(workload.model()), datamodule=Data(workload))


def test_callback_plans_at_setup(examples_dir):
    path = examples_dir / "mlp.py"

    class MLPModule(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters()
            self.hparams.batch_size = 1
            from autotune.workload.contract import load_workload
            self.workload = load_workload(path)
            self.net = self.workload.model()

        def training_step(self, batch, batch_idx):
            return self.workload.loss(self.net, batch)[0]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.workload.build_dataset(),
                                               batch_size=self.hparams.batch_size)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = AutotuneCallback(workload=path, target_batch=12, device="cpu", precision="fp32",
                                memory_limit="64MiB", micro_batch=4, checkpointing="off")
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[callback])
    module = MLPModule()
    trainer.fit(module)
    assert callback.plan.micro_batches == [4, 4, 4]
    assert module.hparams.batch_size == 4 and trainer.accumulate_grad_batches == 3


def test_callback_checkpoints_the_plans_k_of_n_blocks():
    # It checkpointed every block (HF's own switch) for a plan of 1 of 2.
    workload = real_model("gpt2_varlen")
    plan = make_plan(8, 4)
    plan.checkpointing, plan.workload.repeated_blocks = Checkpointing.of(1, 2), 2
    module = Module(workload.model())
    _trainer(plan, AutotuneCallback(plan)).fit(module, datamodule=Data(workload))
    wrapped = [m for m in module.modules() if getattr(m, "_autotune_checkpointed", False)]
    assert len(wrapped) == 1 and wrapped[0] is module.model.transformer.h[0]
    assert not module.model.is_activation_checkpointing
    assert module.model.config.use_cache is False  # recomputation needs the cache off


def test_callback_refuses_k_of_n_on_a_module_with_other_blocks():
    workload = real_model("gpt2_varlen")
    plan = make_plan(8, 4)
    plan.checkpointing, plan.workload.repeated_blocks = Checkpointing.of(1, 3), 3
    with pytest.raises(ConfigError, match="checkpoints 1 of the 3 repeated blocks.*has 2"):
        _trainer(plan, AutotuneCallback(plan)).fit(Module(workload.model()), datamodule=Data(workload))


class ScheduledModule(Module):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("module_type", [Module, ScheduledModule])
def test_callback_trains_at_the_plans_lr(module_type):
    # configure_optimizers' own LR (1e-3, 0.5) was kept whatever the plan said.
    workload = real_model("gpt2_varlen")
    plan = make_plan(8, 4, base_lr=1e-2, base_batch=4)  # linear or sqrt rule: not 1e-3 nor 0.5
    lr = plan.lr.lr
    assert lr is not None and lr not in (1e-3, 0.5)
    module = module_type(workload.model())
    trainer = _trainer(plan, AutotuneCallback(plan))
    trainer.fit(module, datamodule=Data(workload))
    group = trainer.optimizers[0].param_groups[0]
    if module_type is ScheduledModule:
        assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [lr]
        assert group["lr"] == pytest.approx(lr / 3)  # the schedule's factor after 2 steps
    else:
        assert group["lr"] == pytest.approx(lr)


class GroupedModule(Module):
    def configure_optimizers(self):
        params = list(self.parameters())
        optimizer = torch.optim.SGD([{"params": [p for p in params if p.ndim >= 2]},
                                     {"params": [p for p in params if p.ndim < 2], "lr": 0.125}], lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_callback_keeps_each_groups_ratio_to_the_optimizers_lr():
    # A group at a quarter of the optimizer's LR was set to the plan's LR like every other.
    workload = real_model("gpt2_varlen")
    plan = make_plan(8, 4, base_lr=1e-2, base_batch=4)
    lr = plan.lr.lr
    trainer = _trainer(plan, AutotuneCallback(plan))
    trainer.fit(GroupedModule(workload.model()), datamodule=Data(workload))
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == pytest.approx([lr, lr / 4])
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == pytest.approx([lr / 3, lr / 12])
