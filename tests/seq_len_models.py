"""Tiny Hugging Face GPT-2 and Llama (2 layers) whose make_batch takes the sequence length: the
sequence-length probe's and the token plan's test models (see tests/test_seq_len.py)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, POSITIONS = 128, 1024


def build_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


def build_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=POSITIONS))


def make_batch(batch_size, seq_len=64):
    generator = torch.Generator().manual_seed(batch_size * 7919 + seq_len)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)
    return {"input_ids": tokens, "labels": tokens}
