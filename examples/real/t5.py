"""A tiny T5 (Hugging Face ``T5ForConditionalGeneration``) on synthetic sequence-to-sequence data.

No pretrained weights: a small ``T5Config``. The model returns its own loss, so no loss_fn.

    autotune plan examples/real/t5.py --target-batch 64 --memory-limit 128MiB
"""

import torch
from transformers import T5Config, T5ForConditionalGeneration

VOCAB, SOURCE_LEN, TARGET_LEN = 256, 32, 16
BASE_LR, BASE_BATCH = 3e-4, 16


def build_model():
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_decoder_layers=2, num_heads=4, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    return {
        "input_ids": torch.randint(1, VOCAB, (batch_size, SOURCE_LEN), generator=generator),
        "labels": torch.randint(1, VOCAB, (batch_size, TARGET_LEN), generator=generator),
    }
