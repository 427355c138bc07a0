"""examples/real/llama.py (a tiny Hugging Face LlamaForCausalLM, its own loss from labels) with
loss parallel: the head's logits reach the loss split by vocabulary over the tp ranks."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_examples_real_llama", Path(__file__).resolve().parents[1] / "examples" / "real" / "llama.py")
_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_llama)
build_model, make_batch, BASE_LR, BASE_BATCH = _llama.build_model, _llama.make_batch, _llama.BASE_LR, _llama.BASE_BATCH

LOSS_PARALLEL = True
