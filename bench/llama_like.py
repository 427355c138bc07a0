"""A Llama-shaped decoder (RMSNorm, grouped-query attention, SwiGLU) at the size that
AUTOTUNE_LLAMA names: 1b, 8b (Llama-3-8B: 32 layers, dim 4096, FFN 14336, vocab 128256), 70b or
405b (Llama-3.1-405B: 126 layers, dim 16384, FFN 53248, 128 heads, 8 KV heads). Sequences of
AUTOTUNE_LLAMA_SEQ tokens (default 2048; make_batch(n, seq_len) takes --seq-len), AdamW. Rotary embeddings are left out: they add no parameters and
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
    def __init__(self, dim=DIM, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS):
        super().__init__()
        head_dim = dim // heads
        # What a layout search reads (autotune.workload.model_shape): tensor parallel splits heads.
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim = head_dim
        self.attn_norm = nn.RMSNorm(dim)
        # Separate projections under the names autotune's derived tensor-parallel plan knows
        # (q/k/v/gate/up colwise, o/down rowwise): a fused [k; v] or [gate; up] weight split
        # colwise would hand the first ranks all of k (or gate).
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # Heads counted from the projections' widths (-1): under tensor parallelism each rank
        # holds heads / tp of q and KV heads / tp of k and v, the same grouping.
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaLike(nn.Module):
    """The shape is SHAPES[AUTOTUNE_LLAMA] unless given (tests/sp_decoder_model.py: a tiny one)."""

    def __init__(self, layers=LAYERS, dim=DIM, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, ffn, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

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
    # The vocabulary from the logits: tests/sp_decoder_model.py shares this loss at its own shape.
    return (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"),
            targets.numel())


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=BASE_LR, weight_decay=0.1)
