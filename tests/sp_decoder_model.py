"""bench/llama_like.py's decoder (RMSNorm, grouped-query attention, SwiGLU, the projections as
the block's own Linear layers, an untied head) at a tiny shape: autotune derives its TP plan and
runs it with sequence parallel. fp32, SGD (exact comparisons across layouts), a (sum, token
count) loss."""

import importlib.util
from pathlib import Path

import torch

# Loaded by path, not by putting bench/ on sys.path: bench/ and tests/ both have a real_models.py.
_spec = importlib.util.spec_from_file_location(
    "_bench_llama_like", Path(__file__).resolve().parents[1] / "bench" / "llama_like.py")
_llama_like = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_llama_like)
LlamaLike = _llama_like.LlamaLike

LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB, SEQ_LEN = 2, 32, 64, 4, 2, 64, 16


def build_model():
    torch.manual_seed(0)
    return LlamaLike(LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB)


def make_batch(batch_size, seq_len=SEQ_LEN):
    generator = torch.Generator().manual_seed(batch_size * 1000 + seq_len)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


loss_fn = _llama_like.loss_fn  # (sum, token count) of the cross-entropy, any vocabulary


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
