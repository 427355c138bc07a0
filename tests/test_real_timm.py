"""timm's ViT (where timm imports: it needs torchvision, which PyPI's wheels may not import beside
a CPU-only torch): its constructor calls .item(), so the estimate says where and probe falls back."""

import pytest
import torch

timm = pytest.importorskip("timm")

import autotune  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _vit_workload():
    def build():
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                 num_classes=10, drop_path_rate=0.1)

    return autotune.Workload(
        model=build, make_batch=lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
        source="timm-vit")


def test_vit_estimate_names_the_phase_and_the_library_line():
    with pytest.raises(autotune.EstimateUnavailable, match=r"while building the model.*via .*timm"):
        autotune.estimate_peak(_vit_workload(), 2)


def test_vit_probe_falls_back_to_real_trials():
    result = autotune.probe(_vit_workload(), device="cpu", memory_limit="64MiB", max_micro_batch=4)
    assert result.max_micro_batch == 4
    assert any("real trials only" in n for n in result.notes)
