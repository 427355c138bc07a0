"""Checkpointing on real library models: HF's own switch with the cache off, BatchNorm once."""

import dataclasses

import pytest
import torch

from autotune import probe
from autotune.probing.estimate import estimate_peak
from autotune.training.api import train
from autotune.workload.activation_checkpointing import disable_checkpointing, enable_checkpointing
from autotune.workload.checkpoint_count import Checkpointing

from real_models import real_model
from train_helpers import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def test_t5_trains_a_checkpointed_step():
    # Wrapping T5's blocks by hand with use_cache on failed recomputation with torch's
    # CheckpointError ("a different number of tensors was saved").
    workload = real_model("t5")
    model = workload.model()
    assert enable_checkpointing(model) == 4
    model(**workload.make_batch(2)).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_t5_trains_k_of_n_checkpointed_blocks_with_every_cache_off(blocks):
    # K of N blocks are wrapped by hand; T5's decoder keeps its own config with use_cache=True,
    # and recomputation then saved 57 tensors against 53 in forward (CheckpointError).
    workload = real_model("t5")
    model = workload.model()
    assert model.decoder.config.use_cache is True
    assert enable_checkpointing(model, blocks=blocks) == blocks
    model(**workload.make_batch(2)).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    disable_checkpointing(model)
    assert model.decoder.config.use_cache is True and model.config.use_cache is True
    assert model.encoder.config.use_cache is False  # T5 keeps the encoder's cache off itself


@pytest.mark.slow
def test_t5_probes_with_checkpointing():
    result = probe(real_model("t5"), checkpointing=True, memory_limit="64MiB", max_micro_batch=4)
    assert result.max_micro_batch == 4
    assert result.checkpointing


def test_gpt2_checkpointed_estimate_is_what_hf_trainer_runs():
    # HF Trainer switches checkpointing with the model's own switch, which turns the cache off;
    # autotune's checkpointed step must measure exactly that step (it was 13% higher with the cache).
    workload = real_model("gpt2")

    def hf_checkpointed():
        model = workload.model()
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model

    ours = estimate_peak(workload, 8, checkpointing=True)
    theirs = estimate_peak(dataclasses.replace(workload, model=hf_checkpointed), 8)
    assert ours == theirs


def test_hf_switch_is_restored_on_an_instance():
    model = real_model("gpt2").model()
    assert model.config.use_cache is True
    assert enable_checkpointing(model) == 2
    assert enable_checkpointing(model) == 2  # idempotent
    assert model.is_activation_checkpointing and model.config.use_cache is False
    disable_checkpointing(model)
    assert not model.is_activation_checkpointing and model.config.use_cache is True


def _bn_state(model):
    return {name: buffer.clone() for name, buffer in model.named_buffers()
            if "running" in name or "num_batches" in name}


@pytest.mark.parametrize("name", ["resnet"])
def test_batchnorm_statistics_are_updated_once_per_forward(name):
    # Recomputation in backward ran BatchNorm's forward again: num_batches_tracked was 4 after
    # 2 steps in the checkpointed blocks, 2 in the unwrapped stem.
    workload = real_model(name)
    states = []
    for checkpointing in (False, True):
        model = workload.model()
        if checkpointing:
            assert enable_checkpointing(model) >= 2
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(2):
            model(**workload.make_batch(4)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(_bn_state(model))
    plain, checkpointed = states
    assert {int(v) for k, v in checkpointed.items() if k.endswith("num_batches_tracked")} == {2}
    for name_, value in plain.items():
        torch.testing.assert_close(checkpointed[name_], value, msg=name_)


def test_torchvision_resnet18_updates_batchnorm_statistics_once_per_forward():
    models = pytest.importorskip("torchvision.models")
    states = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = models.resnet18(num_classes=10)
        if checkpointing:
            assert enable_checkpointing(model) >= 2  # the blocks of layer1..layer4
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        torch.manual_seed(1)
        for _ in range(2):
            images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(_bn_state(model))
    plain, checkpointed = states
    assert int(checkpointed["layer1.0.bn1.num_batches_tracked"]) == 2  # was 4 before the fix
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, msg=name)


def test_training_a_checkpointed_batchnorm_plan_tracks_each_batch_once(examples_dir):
    plan = make_plan([4, 4])
    plan.checkpointing = Checkpointing.every_block()
    result = train(plan, str(examples_dir / "cnn_bn.py"), steps=2, progress=False,
                   measure_noise_scale=False)
    tracked = {int(v) for k, v in result.model.state_dict().items() if k.endswith("num_batches_tracked")}
    assert tracked == {4}  # 2 steps × 2 micro-batches, each forward counted once


def test_hf_model_inside_another_module_is_switched_with_its_own_switch():
    # A LightningModule (or any wrapper) holding an HF model: its blocks wrapped by hand with the
    # cache on broke GPT-2's attention shapes in recomputation.
    workload = real_model("gpt2")

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = workload.model()
            self.head = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))

    wrapper = Wrapper()
    assert enable_checkpointing(wrapper) == 2 + 2  # GPT-2's 2 layers by its switch, 2 by hand
    assert wrapper.model.is_activation_checkpointing and wrapper.model.config.use_cache is False
    wrapper.model(**workload.make_batch(2)).loss.backward()
    disable_checkpointing(wrapper)
    assert not wrapper.model.is_activation_checkpointing and wrapper.model.config.use_cache is True
    assert not any(hasattr(m, "_autotune_checkpointed") for m in wrapper.modules())


def test_t5_probes_k_of_n_blocks():
    # `autotune plan examples/real/t5.py --checkpointing 2` ended in the CheckpointError traceback.
    result = probe(real_model("t5"), checkpointing=2, memory_limit="64MiB", max_micro_batch=4)
    assert result.max_micro_batch == 4 and result.checkpointed_blocks == 2
