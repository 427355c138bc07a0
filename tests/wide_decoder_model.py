"""bench/llama_like.py's decoder with two blocks at Llama-3.2-1B's width (dim 2048, FFN 8192, 32
heads, 8 KV heads, vocab 128256) and sequences of 4096: each matmul's FLOPs outweigh a kernel
launch on an H100 profile, as at full size, while a fake step stays two blocks long. AdamW, the
(sum, token count) loss."""

import importlib.util
from pathlib import Path

import torch

# Loaded by path, not by putting bench/ on sys.path: bench/ and tests/ both have a real_models.py.
_spec = importlib.util.spec_from_file_location(
    "_bench_llama_like", Path(__file__).resolve().parents[1] / "bench" / "llama_like.py")
_llama_like = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_llama_like)

LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB, SEQ_LEN = 2, 2048, 8192, 32, 8, 128256, 4096


def build_model():
    torch.manual_seed(0)
    return _llama_like.LlamaLike(LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB)


def make_batch(batch_size, seq_len=SEQ_LEN):
    generator = torch.Generator().manual_seed(batch_size * 1000 + seq_len)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


loss_fn = _llama_like.loss_fn
build_optimizer = _llama_like.build_optimizer
