"""tests/cp_models.py's hf_llama with 4 layers: interleaved 1F1B over pp 2 needs 4 stages (one block each)."""

from cp_models import build_hf_llama, make_hf_batch as make_batch, build_sgd as build_optimizer  # noqa: F401


def build_model():
    return build_hf_llama(layers=4)
