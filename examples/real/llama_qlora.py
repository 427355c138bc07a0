"""QLoRA: the tiny Llama of ``llama_lora.py`` with its attention and MLP projections quantized to
4-bit NF4 (bitsandbytes ``Linear4bit``, which runs on the CPU) and LoRA adapters on top of them.

    autotune plan examples/real/llama_qlora.py --target-batch 64 --memory-limit 64MiB

The frozen base's projections are stored in 4 bits (uint8 pairs plus per-block scales); the
embeddings, norms and head stay fp32, and only the adapters train.
"""

import bitsandbytes as bnb
import torch
from llama_lora import BASE_BATCH, BASE_LR, PROJECTIONS, build_base, make_batch  # noqa: F401 - the contract
from peft import LoraConfig, get_peft_model


def quantized(linear: torch.nn.Linear) -> bnb.nn.Linear4bit:
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
    return layer.to("cpu")  # bitsandbytes quantizes as it moves the weight to its device


def build_model():
    base = build_base()
    for block in base.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name in PROJECTIONS:
                    setattr(parent, name, quantized(child))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS)
    return get_peft_model(base, lora)
