"""A tiny Llama (Hugging Face ``LlamaForCausalLM``) with LoRA adapters (peft) on its attention and
MLP projections, on the token batches of ``gpt2_lora.py``: the base is frozen, only the adapters
train.

    autotune plan examples/real/llama_lora.py --target-batch 64 --memory-limit 64MiB

``build_base()`` is the same model without adapters (full fine-tuning), for comparison.
"""

from gpt2_lora import BASE_BATCH, BASE_LR, SEQ_LEN, VOCAB, make_batch  # noqa: F401 - the file's contract
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
import torch

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_base():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                         use_cache=False)  # as gpt2_lora.py: training never reads the cache back
    return LlamaForCausalLM(config)


def build_model():
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS)
    return get_peft_model(build_base(), lora)
