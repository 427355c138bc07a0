"""A tiny GPT-2 with make_batch(batch_size, seq_len) (tests/seq_len_models.py)."""

from seq_len_models import build_gpt2 as build_model, make_batch  # noqa: F401
