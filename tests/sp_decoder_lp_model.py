"""tests/sp_decoder_model.py with loss parallel: the head's logits reach the loss split by
vocabulary over the tp ranks."""

from sp_decoder_model import *  # noqa: F401,F403

LOSS_PARALLEL = True
