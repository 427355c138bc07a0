"""A tiny ResNet (Hugging Face ``ResNetForImageClassification``, BatchNorm throughout) on
synthetic images.

    autotune plan examples/real/resnet.py --target-batch 64 --memory-limit 64MiB
"""

import torch
from transformers import ResNetConfig, ResNetForImageClassification

CHANNELS, SIZE, CLASSES = 3, 32, 10
BASE_LR, BASE_BATCH = 0.05, 32


def build_model():
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=CHANNELS, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=CLASSES)
    return ResNetForImageClassification(config)


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    return {
        "pixel_values": torch.randn(batch_size, CHANNELS, SIZE, SIZE, generator=generator),
        "labels": torch.randint(0, CLASSES, (batch_size,), generator=generator),
    }
