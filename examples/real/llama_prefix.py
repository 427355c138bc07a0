"""A model file: the tiny Llama of examples/real/llama_lora.py with prefix tuning (peft's
``PrefixTuningConfig``: learned key-value prefixes for every layer, the base frozen)."""

from peft import PrefixTuningConfig, TaskType, get_peft_model

from llama_lora import BASE_BATCH, BASE_LR, build_base, make_batch  # noqa: F401 - the file's contract


def build_model():
    prefix = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8)
    return get_peft_model(build_base(), prefix)
