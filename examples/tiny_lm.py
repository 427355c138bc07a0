"""A small GPT-style causal language model on synthetic token sequences.

Repeated transformer blocks live in an nn.ModuleList, so activation checkpointing can wrap them.

    autotune probe examples/tiny_lm.py --memory-limit 256MiB
"""

import torch
from torch import nn

VOCAB, SEQ_LEN, DIM, HEADS, LAYERS = 512, 128, 128, 4, 4
BASE_LR, BASE_BATCH = 3e-4, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model() -> nn.Module:
    return TinyLM()


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=BASE_LR, weight_decay=0.1)
