"""A tiny GPT-2 (Hugging Face ``GPT2LMHeadModel``) on synthetic token sequences.

    autotune plan examples/real/gpt2.py --target-batch 64 --memory-limit 128MiB
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ_LEN = 256, 64
BASE_LR, BASE_BATCH = 3e-4, 16


def build_model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator)
    return {"input_ids": tokens, "labels": tokens}
