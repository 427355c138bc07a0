"""A tiny Hugging Face Llama with twelve identical decoder layers and make_batch(n, seq_len), for
the few-block estimates of tensor/context-parallel layouts (tests/test_affine_layouts.py)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"  # context parallelism rings SDPA's attention
    return LlamaForCausalLM(config)


def make_batch(batch_size, seq_len=16):
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": tokens, "labels": tokens}
