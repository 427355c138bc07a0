"""What kind of peft adapter a model carries, where it limits how the model can be trained."""

from __future__ import annotations

import torch


def peft_adapted(model: torch.nn.Module) -> bool:
    """Whether peft adapts ``model`` (or a module inside it): it carries peft's configs."""
    return any(isinstance(getattr(module, "peft_config", None), dict) for module in model.modules())


def prefix_tuned(model: torch.nn.Module) -> bool:
    """Whether peft's prefix tuning adapts ``model`` (or a module inside it): its learned prefix
    reaches every layer through the key-value cache, which each layer extends as it runs, not
    through the hidden state one block hands the next. Read from peft's own configs
    (``peft_config``), without importing peft."""
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and any(
                str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] == "PREFIX_TUNING"
                for config in configs.values()):
            return True
    return False


__all__ = ["peft_adapted", "prefix_tuned"]
