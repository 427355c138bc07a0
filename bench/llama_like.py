"""A Llama-shaped decoder (RMSNorm, grouped-query attention, SwiGLU) at the size that
AUTOTUNE_LLAMA names: 1b, 8b (Llama-3-8B: 32 layers, dim 4096, FFN 14336, vocab 128256), 70b or
405b (Llama-3.1-405B: 126 layers, dim 16384, FFN 53248, 128 heads, 8 KV heads). Sequences of
AUTOTUNE_LLAMA_SEQ tokens (default 2048), AdamW. Rotary embeddings are left out: they add no parameters and
little memory. Used by bench/fsdp_plan_rss.py and
bench/reserved_memory.py; far too large to build for real on this machine.
"""

import os

import torch
from torch import nn
from torch.nn import functional as F

SHAPES = {  # layers, dim, ffn, heads, kv_heads
    "1b": (16, 2048, 8192, 32, 8),
    "8b": (32, 4096, 14336, 32, 8),
    "70b": (80, 8192, 28672, 64, 8),
    "405b": (126, 16384, 53248, 128, 8),
}
LAYERS, DIM, FFN, HEADS, KV_HEADS = SHAPES[os.environ.get("AUTOTUNE_LLAMA", "8b")]
VOCAB, SEQ_LEN = 128256, int(os.environ.get("AUTOTUNE_LLAMA_SEQ", 2048))
BASE_LR, BASE_BATCH = 3e-4, 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        head_dim = DIM // HEADS
        self.attn_norm = nn.RMSNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * head_dim, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = nn.RMSNorm(DIM)
        self.gate_up = nn.Linear(DIM, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, DIM))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model():
    return LlamaLike()


def make_batch(batch_size, seq_len=SEQ_LEN):
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    # Shifted here, not in the loss: context parallelism shards inputs and targets alike.
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    # (sum, tokens): under context parallelism each rank holds part of every sequence.
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"), targets.numel()


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=BASE_LR, weight_decay=0.1)
