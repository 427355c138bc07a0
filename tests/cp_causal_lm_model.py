"""causal_lm (tests/cp_models.py) as a model file."""

from cp_models import build_causal_lm as build_model, make_causal_lm_batch as make_batch, causal_lm_loss as loss_fn, build_sgd as build_optimizer  # noqa: F401
