"""hf_llama (tests/cp_models.py) as a model file."""

from cp_models import build_hf_llama as build_model, make_hf_batch as make_batch, build_sgd as build_optimizer  # noqa: F401
