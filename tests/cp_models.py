"""Model files for context-parallel tests (tests/test_context_parallel.py).

- ``causal_lm``: a tiny causal LM on ``F.scaled_dot_product_attention(is_causal=True)``, with
  learned positions looked up from the batch's ``positions`` (sharded with the tokens), targets
  shifted in make_batch and a (sum, token count) loss: the generic path.
- ``hf_llama`` / ``hf_gpt2``: Hugging Face models with SDPA and no dropout (the CPU's flash kernel,
  the one that rings, takes none): input_ids and labels, the model shifting its own labels.
"""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HEADS, LAYERS, MAX_LEN = 64, 32, 4, 2, 64
SEQ_LEN = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(x)


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions):
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_causal_lm():
    torch.manual_seed(0)
    return CausalLM()


def make_causal_lm_batch(batch_size, seq_len=SEQ_LEN):
    generator = torch.Generator().manual_seed(batch_size * 1000 + seq_len)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=generator)
    positions = torch.arange(seq_len).expand(batch_size, seq_len)
    return {"tokens": tokens[:, :-1], "positions": positions, "targets": tokens[:, 1:]}


def causal_lm_loss(model, batch):
    logits = model(batch["tokens"], batch["positions"])
    targets = batch["targets"]
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"), targets.numel()


def build_hf_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def build_hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def make_hf_batch(batch_size, seq_len=SEQ_LEN):
    generator = torch.Generator().manual_seed(batch_size * 1000 + seq_len)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)
    return {"input_ids": tokens, "labels": tokens}


class MaskedBlock(Block):
    """Attention through nn.MultiheadAttention with an explicit causal mask (as examples/tiny_lm.py)."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm(x)
        return x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]


def build_masked_lm():
    torch.manual_seed(0)
    model = CausalLM()
    model.blocks = nn.ModuleList(MaskedBlock() for _ in range(LAYERS))
    return model


def build_attentionless_lm():
    """No attention at all: each position sees only itself."""
    torch.manual_seed(0)
    model = CausalLM()
    model.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM)) for _ in range(LAYERS))
    return model


def build_eager_llama():
    model = build_hf_llama()
    model.config._attn_implementation = "eager"
    return model


def causal_lm_mean_loss(model, batch):
    loss_sum, count = causal_lm_loss(model, batch)
    return loss_sum / count


def build_sgd(params):
    """Plain SGD for the equivalence runs: Adam turns a zero gradient's rounding noise (attention's
    key bias gets none) into whole steps of ±lr, which no reordering of fp32 sums survives."""
    return torch.optim.SGD(params, lr=0.1)
