"""autotune.integrations.lightning: a plan applied to a Trainer, or planned at setup."""

import pytest
import torch

lightning = pytest.importorskip("lightning")

from autotune.errors import ConfigError  # noqa: E402
from autotune.integrations.lightning import AutotuneCallback, trainer_arguments  # noqa: E402
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
    plan.checkpointing = True
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
