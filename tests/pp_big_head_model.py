"""examples/tiny_lm.py with a large vocabulary: the last pipeline stage (the head, the loss and
its logits) holds more than the first (the embedding and the most micro-batches in flight)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "pp_big_head_tiny_lm", Path(__file__).resolve().parent.parent / "examples" / "tiny_lm.py")
_tiny_lm = importlib.util.module_from_spec(_spec)  # its own copy: examples' tiny_lm is untouched
_spec.loader.exec_module(_tiny_lm)
_tiny_lm.VOCAB = 8192

build_model, make_batch, loss_fn = _tiny_lm.build_model, _tiny_lm.make_batch, _tiny_lm.loss_fn
