"""examples/tiny_lm.py with twelve blocks (AUTOTUNE_BLOCKS_DIFFER=1: the last one's MLP twice as
wide), for the estimates from few identical blocks (tests/test_affine_blocks.py)."""

import os
import pathlib
import runpy

from torch import nn

_TINY = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "tiny_lm.py"))
BASE_LR, BASE_BATCH, DIM = _TINY["BASE_LR"], _TINY["BASE_BATCH"], _TINY["DIM"]
make_batch, loss_fn = _TINY["make_batch"], _TINY["loss_fn"]


def build_model() -> nn.Module:
    model = _TINY["TinyLM"]()
    model.blocks = nn.ModuleList(_TINY["Block"]() for _ in range(12))
    if os.environ.get("AUTOTUNE_BLOCKS_DIFFER") == "1":
        model.blocks[-1].mlp = nn.Sequential(nn.Linear(DIM, 8 * DIM), nn.GELU(), nn.Linear(8 * DIM, DIM))
    return model
