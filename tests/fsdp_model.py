"""A model file for the FSDP2 checkpoint tests: dropout (the RNG must be restored) and AdamW
(optimizer state must be restored), 40 samples."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _data(n):
    generator = torch.Generator().manual_seed(n)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def make_batch(batch_size):
    return _data(batch_size)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build_dataset():
    return torch.utils.data.TensorDataset(*_data(40))


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)
