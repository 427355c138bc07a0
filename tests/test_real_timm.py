"""timm's ViT, as a user's model file builds it (timm needs torchvision: install the torchvision
that matches this torch, e.g. torch 2.14.1 with torchvision 0.29.1). Its constructor calls .item(),
which neither fake nor meta tensors can answer: the model is built for real on the CPU and copied
onto fake tensors, with one warning naming timm's line, and the estimate and probe run as for any
model (issue 20; they used to fall back to real trials)."""

import textwrap

import pytest

timm = pytest.importorskip("timm")

import autotune  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL_FILE = textwrap.dedent('''
    import timm
    import torch

    def build_model():
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                 num_classes=10, drop_path_rate=0.1)

    def make_batch(n):
        return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
''')


@pytest.fixture
def vit_file(tmp_path):
    path = tmp_path / "vit.py"
    path.write_text(MODEL_FILE)
    return path


def test_vit_is_built_for_real_and_estimated_with_one_warning_naming_timm(vit_file):
    with pytest.warns(autotune.AutotuneWarning) as said:
        estimated = autotune.estimate_peak(vit_file, 2)
    (message,) = [str(w.message) for w in said if issubclass(w.category, autotune.AutotuneWarning)]
    assert "built it for real on the CPU" in message and "timm" in message and "\n" not in message
    real = autotune.probe(vit_file, device="cpu", memory_limit="512MiB", max_micro_batch=2)
    assert abs(estimated - next(t.peak_bytes for t in real.trials if t.micro_batch == 2)) <= 0.01 * estimated


def test_vit_probe_finds_its_answer(vit_file):
    result = autotune.probe(vit_file, device="cpu", memory_limit="512MiB", max_micro_batch=4)
    assert result.max_micro_batch == 4
