"""A model file: the tiny GPT-2 of examples/real/gpt2_lora.py with DoRA adapters (weight-decomposed
LoRA, ``LoraConfig(use_dora=True)``)."""

from peft import LoraConfig, get_peft_model

from gpt2_lora import BASE_BATCH, BASE_LR, build_base, make_batch  # noqa: F401 - the file's contract


def build_model():
    dora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True, use_dora=True,
                      target_modules=["c_attn", "c_proj", "c_fc"])
    return get_peft_model(build_base(), dora)
