"""Twelve wide residual MLP blocks: large enough that an H100 plan shards and accumulates
(tests/test_layout_search.py: the chosen layout planned in detail after the search)."""

import torch
from torch import nn

DIM, SEQ = 16384, 2048


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(12))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Wide()


def make_batch(batch_size):
    return torch.randn(batch_size, SEQ, DIM), torch.randn(batch_size, SEQ, 1)


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
