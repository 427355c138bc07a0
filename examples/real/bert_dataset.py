"""A tiny BERT classifier on tokenizer-style examples of different lengths, with no make_batch:
the probe batches the dataset's largest examples, padded by ``collate_fn``.

    autotune plan examples/real/bert_dataset.py --target-batch 32 --memory-limit 64MiB
"""

import torch
from transformers import BertConfig, BertForSequenceClassification

VOCAB, MAX_LEN, MIN_LEN, CLASSES = 256, 64, 4, 3
BASE_LR, BASE_BATCH = 5e-5, 32
DATASET_SIZE = 256


def build_model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=MAX_LEN, num_labels=CLASSES)
    return BertForSequenceClassification(config)


def build_dataset():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (DATASET_SIZE,), generator=generator).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist(),
             "label": int(torch.randint(0, CLASSES, (1,), generator=generator))} for n in lengths]


def collate_fn(examples):
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.zeros(len(examples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = torch.tensor(example["input_ids"])
        attention_mask[row, :n] = 1
    labels = torch.tensor([e["label"] for e in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
