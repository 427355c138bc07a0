"""A model file around a tiny Hugging Face GPT-2 (tied embeddings, dropout off so that ranks and
one process draw no random numbers): the real-library model of the FSDP2 tests."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, LENGTH = 64, 16


def build_model():
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _tokens(n, seed):
    return torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


def make_batch(batch_size):
    return (_tokens(batch_size, batch_size),)


def loss_fn(model, batch):
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens).loss


def build_dataset():
    return torch.utils.data.TensorDataset(_tokens(96, 0))


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
