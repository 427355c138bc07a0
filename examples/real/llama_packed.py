"""A tiny Llama (Hugging Face ``LlamaForCausalLM``) trained on packed sequences.

Documents of different lengths are packed end to end into rows of exactly ``seq_len`` tokens:
no padding, and ``position_ids`` restart at 0 at each document, which transformers reads as
document boundaries (attention stays within a document under sdpa, eager and flash attention).
The first token of each document has no label (-100): it is not predicted from the previous
document. ``loss_fn`` returns ``(loss_sum, real_tokens)``, so accumulation weighs each
micro-batch by the tokens it really predicts.

    autotune probe examples/real/llama_packed.py --max-seq-len --memory-limit 8MiB
    autotune plan examples/real/llama_packed.py --target-tokens 4096 --seq-len 256 --memory-limit 16MiB
"""

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, MAX_POSITIONS, SEQ_LEN = 256, 4096, 256
DOCUMENT_LENGTHS = (16, 200)
"""Shortest and longest document, in tokens."""
BASE_LR, BASE_BATCH = 3e-4, 16


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITIONS)
    return LlamaForCausalLM(config)


def make_batch(batch_size, seq_len=SEQ_LEN):
    """``batch_size`` rows of ``seq_len`` tokens, each packed from whole documents (the last
    one cut at the row's end)."""
    generator = torch.Generator().manual_seed(batch_size * 100_003 + seq_len)
    # Document lengths from Python's RNG, not torch's: the batch is also made on fake tensors
    # (autotune's estimate), whose values cannot be read.
    lengths = random.Random(batch_size * 100_003 + seq_len)
    tokens = torch.randint(1, VOCAB, (batch_size, seq_len), generator=generator)
    positions = torch.empty(batch_size, seq_len, dtype=torch.long)
    labels = tokens.clone()
    for row in range(batch_size):
        start = 0
        while start < seq_len:
            length = lengths.randint(*DOCUMENT_LENGTHS)
            stop = min(start + length, seq_len)
            positions[row, start:stop] = torch.arange(stop - start)
            labels[row, start] = -100  # a document's first token is not predicted from the last one
            start = stop
    return {"input_ids": tokens, "position_ids": positions, "labels": labels}


def loss_fn(model, batch):
    """(summed next-token loss, tokens predicted): the real tokens, whatever the packing."""
    # No KV cache: transformers reads position_ids as document boundaries only without one.
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                                 targets.reshape(-1), ignore_index=-100,
                                                 reduction="sum")
    return loss_sum, (targets != -100).sum()
