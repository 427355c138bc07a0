"""timm's ViT, as a user's model file builds it (timm needs torchvision: install the torchvision
that matches this torch, e.g. torch 2.14.1 with torchvision 0.29.1). Its constructor calls .item(),
so the estimate names the phase, the model file's line and the library line, and probe falls back
to real trials."""

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


def test_vit_estimate_names_the_phase_the_model_files_line_and_the_library_line(vit_file):
    with pytest.raises(autotune.EstimateUnavailable) as info:
        autotune.estimate_peak(vit_file, 2)
    message = str(info.value)
    assert "while building the model" in message and "vit.py:6" in message and "timm" in message


def test_vit_probe_falls_back_to_real_trials(vit_file):
    result = autotune.probe(vit_file, device="cpu", memory_limit="512MiB", max_micro_batch=4)
    assert result.max_micro_batch == 4
    assert any("real trials" in n for n in result.notes)
