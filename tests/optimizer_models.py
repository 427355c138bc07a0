"""A tiny causal LM and the optimizers tests/test_optimizers.py and bench/optimizers.py run it with.

Every weight matrix has at least 4096 elements, a multiple of 256: bitsandbytes and torchao
quantize those (smaller tensors keep fp32 state), so their 8-bit and 4-bit paths are the ones
measured.
"""

import importlib

import torch
from torch import nn

from autotune import Workload

VOCAB, SEQ_LEN, DIM, LAYERS = 256, 32, 64, 2


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_batch(n):
    return torch.randint(0, VOCAB, (n, SEQ_LEN + 1), generator=torch.Generator().manual_seed(n))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def decay_groups(params):
    """No weight decay on biases and norm weights (the 1-D parameters), a lower LR for them."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 1e-4}]


def _bnb(name):
    return lambda params: getattr(importlib.import_module("bitsandbytes").optim, name)(params, lr=1e-3)


def _torchao(name):
    return lambda params: getattr(importlib.import_module("torchao.optim"), name)(params, lr=1e-3)


def _hf_adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False)


OPTIMIZERS = {
    "adamw-groups": (None, lambda params: torch.optim.AdamW(decay_groups(params), lr=1e-3)),
    "bnb-AdamW8bit": ("bitsandbytes", _bnb("AdamW8bit")),
    "bnb-PagedAdamW8bit": ("bitsandbytes", _bnb("PagedAdamW8bit")),
    "bnb-PagedAdamW": ("bitsandbytes", _bnb("PagedAdamW")),
    "torchao-AdamW8bit": ("torchao.optim", _torchao("AdamW8bit")),
    "torchao-AdamW4bit": ("torchao.optim", _torchao("AdamW4bit")),
    "hf-Adafactor": ("transformers", _hf_adafactor),
    "torch-Adafactor": (None, lambda params: torch.optim.Adafactor(params, lr=1e-2)),
}
"""name: (the package it needs, or None; build_optimizer)."""


def workload(optimizer: str) -> Workload:
    return Workload(model=TinyLM, make_batch=make_batch, loss_fn=loss_fn,
                    build_optimizer=OPTIMIZERS[optimizer][1], source=f"tiny LM with {optimizer}")


def build_model():
    """As a model file: the tiny LM with torch's default AdamW."""
    return TinyLM()


class NormScaledSGD(torch.optim.SGD):
    """Reads a gradient norm into Python in its step: fake tensors cannot answer that."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / max(1.0, p.grad.norm().item()))


OPTIMIZERS["reads-values"] = (None, lambda params: NormScaledSGD(params, lr=0.1))
