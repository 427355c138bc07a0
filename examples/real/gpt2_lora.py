"""A tiny GPT-2 (Hugging Face ``GPT2LMHeadModel``) with LoRA adapters (peft): the base is frozen,
only the adapters train, so gradients and AdamW state are the adapters' alone.

    autotune plan examples/real/gpt2_lora.py --target-batch 64 --memory-limit 64MiB

``build_base()`` is the same model without adapters (full fine-tuning), for comparison.
"""

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ_LEN = 4096, 32
BASE_LR, BASE_BATCH = 3e-4, 16


def build_base():
    # No key-value cache: training never reads it back (peft's guides turn it off to fine-tune).
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=256, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        use_cache=False)
    return GPT2LMHeadModel(config)


def build_model():
    # GPT-2's attention and MLP projections are Conv1D layers (weights stored transposed).
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                      target_modules=["c_attn", "c_proj", "c_fc"])
    return get_peft_model(build_base(), lora)


def make_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator)
    return {"input_ids": tokens, "labels": tokens}
