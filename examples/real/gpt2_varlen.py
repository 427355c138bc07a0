"""A tiny GPT-2 on Hugging Face-style examples of different lengths, padded by ``collate_fn``.

Each example is a dict of 1-D tensors, as a tokenizer returns them; ``collate_fn`` pads a list of
them to the longest (labels -100 on the padding, so HF's loss ignores it). The training loop
collates each micro-batch on its own, so it is padded to its own longest example.

    autotune plan examples/real/gpt2_varlen.py --target-batch 32 --memory-limit 64MiB
    autotune train examples/real/gpt2_varlen.py --plan plan.json --steps 4
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, MAX_LEN, MIN_LEN = 256, 64, 4
BASE_LR, BASE_BATCH = 3e-4, 16
DATASET_SIZE = 256
IGNORE = -100


def build_model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def build_dataset():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (DATASET_SIZE,), generator=generator).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in lengths]


def collate_fn(examples):
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.zeros(len(examples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = example["input_ids"]
        attention_mask[row, :n] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_batch(batch_size: int):
    """The largest batches training will see: full-length examples, one a token short (where
    there are several) so the batch is padded, as the training batches are. A padded batch takes
    another attention path: GPT-2 then builds a (batch, 1, length, length) mask, which an all-ones
    mask skips (the plan measured 256 KiB less than the training reached at micro-batch 16)."""
    generator = torch.Generator().manual_seed(batch_size)
    lengths = [MAX_LEN] * batch_size
    if batch_size > 1:
        lengths[-1] = MAX_LEN - 1
    return collate_fn([{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in lengths])
