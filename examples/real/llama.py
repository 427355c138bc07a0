"""A tiny Llama (Hugging Face ``LlamaForCausalLM``) on synthetic token sequences.

    autotune plan examples/real/llama.py --target-batch 64 --memory-limit 128MiB
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ_LEN = 256, 64
BASE_LR, BASE_BATCH = 3e-4, 16


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    return LlamaForCausalLM(config)


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator)
    return {"input_ids": tokens, "labels": tokens}
