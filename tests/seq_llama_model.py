"""A tiny Llama with make_batch(batch_size, seq_len) (tests/seq_len_models.py)."""

from seq_len_models import build_llama as build_model, make_batch  # noqa: F401
