"""bench/llama_like.py's decoder, twelve blocks of dim 1024 (AUTOTUNE_TRACE_SHAPE:
"layers,dim,ffn,heads,kv_heads,vocab"), sequences of 256 tokens: large enough that its
parameters, shards and activations take the caching allocator's large pool (tests/test_trace_synthesis.py)."""

import os
import pathlib
import runpy

import torch

_LLAMA = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "llama_like.py"))
LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB = (int(v) for v in os.environ.get(
    "AUTOTUNE_TRACE_SHAPE", "12,1024,2816,8,4,32000").split(","))
SEQ_LEN = int(os.environ.get("AUTOTUNE_TRACE_SEQ", 256))
BASE_LR, BASE_BATCH = 3e-4, 256


def build_model():
    return _LLAMA["LlamaLike"](LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB)


def make_batch(batch_size, seq_len=SEQ_LEN):
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


loss_fn = _LLAMA["loss_fn"]  # (sum, token count) of the cross-entropy, any vocabulary


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=BASE_LR, weight_decay=0.1)
