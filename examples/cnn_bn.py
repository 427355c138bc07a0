"""A small convolutional classifier with BatchNorm on synthetic images.

The conv blocks live in an nn.Sequential, so activation checkpointing can wrap them. BatchNorm
sees only the micro-batch, which is why the planner warns when that micro-batch is small.

    autotune probe examples/cnn_bn.py --memory-limit 64MiB
"""

import torch
from torch import nn

CHANNELS, SIZE, CLASSES = 3, 32, 10
WIDTHS = (8, 16, 32)
BASE_LR, BASE_BATCH = 0.05, 32
DATASET_SIZE = 1024


def _block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        widths = (CHANNELS,) + WIDTHS
        self.features = nn.Sequential(*(_block(a, b) for a, b in zip(widths, widths[1:])))
        self.head = nn.Linear(WIDTHS[-1], CLASSES)

    def forward(self, images):
        x = self.features(images)
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return SmallCNN()


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    images = torch.randn(batch_size, CHANNELS, SIZE, SIZE, generator=generator)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    return images, labels


def loss_fn(model, batch):
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def build_dataset():
    # Learnable synthetic data: each class is a fixed smooth random pattern (a 4x4 grid of
    # colours, upsampled) plus pixel noise.
    generator = torch.Generator().manual_seed(0)
    coarse = torch.randn(CLASSES, CHANNELS, 4, 4, generator=generator)
    patterns = nn.functional.interpolate(coarse, size=(SIZE, SIZE), mode="nearest")
    labels = torch.randint(0, CLASSES, (DATASET_SIZE,), generator=generator)
    noise = torch.randn(DATASET_SIZE, CHANNELS, SIZE, SIZE, generator=generator)
    return torch.utils.data.TensorDataset(patterns[labels] + 0.5 * noise, labels)


def build_optimizer(params):
    return torch.optim.SGD(params, lr=BASE_LR, momentum=0.9)
