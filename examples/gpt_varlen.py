"""A small GPT-style language model on variable-length sequences, with a token-level loss.

``loss_fn`` returns ``(loss_sum, token_count)``: micro-batches hold different numbers of real
tokens (the rest is padding), so the training loop must weight each micro-batch by its tokens,
not by 1/accumulation_steps, to get the large-batch gradient.

    autotune probe examples/gpt_varlen.py --memory-limit 64MiB
"""

import torch
from torch import nn

VOCAB, MAX_LEN, MIN_LEN, DIM, HEADS, LAYERS = 64, 32, 4, 32, 2, 2
IGNORE = -100
BASE_LR, BASE_BATCH = 3e-3, 16
DATASET_SIZE = 512


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, length, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        # Right padding + a causal mask: real tokens never attend to the padding after them.
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, length, DIM))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model() -> nn.Module:
    return GPT()


def _sequences(count: int, lengths: torch.Tensor, generator: torch.Generator):
    """Arithmetic progressions mod VOCAB (learnable), right-padded; targets ignore the padding."""
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    sequence = (start + stride * torch.arange(MAX_LEN + 1)) % VOCAB
    inputs, targets = sequence[:, :-1].clone(), sequence[:, 1:].clone()
    padding = torch.arange(MAX_LEN) >= lengths[:, None]
    inputs[padding] = 0
    targets[padding] = IGNORE
    return inputs, targets


def make_batch(batch_size: int):
    """Full-length sequences: the largest shapes training will see."""
    generator = torch.Generator().manual_seed(batch_size)
    return _sequences(batch_size, torch.full((batch_size,), MAX_LEN), generator)


def loss_fn(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    loss_sum = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1),
                                           ignore_index=IGNORE, reduction="sum")
    return loss_sum, (targets != IGNORE).sum()


def build_dataset():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (DATASET_SIZE,), generator=generator)
    return torch.utils.data.TensorDataset(*_sequences(DATASET_SIZE, lengths, generator))


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=BASE_LR, weight_decay=0.01)
