"""A tiny BERT (Hugging Face ``BertForSequenceClassification``) on synthetic sentences.

    autotune plan examples/real/bert.py --target-batch 64 --memory-limit 128MiB
"""

import torch
from transformers import BertConfig, BertForSequenceClassification

VOCAB, SEQ_LEN, CLASSES = 256, 64, 3
BASE_LR, BASE_BATCH = 5e-5, 32


def build_model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=SEQ_LEN, num_labels=CLASSES)
    return BertForSequenceClassification(config)


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    return {
        "input_ids": torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator),
        "labels": torch.randint(0, CLASSES, (batch_size,), generator=generator),
    }
