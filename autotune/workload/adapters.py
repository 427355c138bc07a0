"""What kind of peft adapter a model carries, where it limits how the model can be trained."""

from __future__ import annotations

import torch


def peft_adapted(model: torch.nn.Module) -> bool:
    """Whether peft adapts ``model`` (or a module inside it): it carries peft's configs."""
    return any(True for _ in _peft_configs(model))


def prefix_tuned(model: torch.nn.Module) -> bool:
    """Whether peft's prefix tuning adapts ``model`` (or a module inside it): its learned prefix
    reaches every layer through the key-value cache, which each layer extends as it runs, not
    through the hidden state one block hands the next. Read from peft's own configs
    (``peft_config``), without importing peft."""
    return any(str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] == "PREFIX_TUNING"
               for configs in _peft_configs(model) for config in configs.values())


def _peft_configs(model: torch.nn.Module):
    """Each ``peft_config`` dict (adapter name: config) a module of ``model`` carries."""
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            yield configs


__all__ = ["peft_adapted", "prefix_tuned"]
