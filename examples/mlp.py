"""A multi-layer perceptron classifier on random data: the smallest autotune model file.

    autotune probe examples/mlp.py --memory-limit 64MiB
"""

import torch
from torch import nn

IN_FEATURES, HIDDEN, CLASSES = 512, 1024, 10
BASE_LR, BASE_BATCH = 1e-3, 32


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    x = torch.randn(batch_size, IN_FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    return x, y


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build_dataset():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, IN_FEATURES, generator=generator)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=generator)
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(dim=1))


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=BASE_LR)
