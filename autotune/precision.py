"""Training precisions: fp32, bf16 autocast, fp16 autocast with a GradScaler, on any device."""

from __future__ import annotations

import contextlib
import enum

import torch

from .errors import ConfigError


class Precision(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    def __str__(self) -> str:
        return self.value

    # Equal to its value as a string, so it must hash like one (dict keys, sets, Optuna params).
    __hash__ = str.__hash__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value, *, option="--precision") -> "Precision":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ConfigError(f"{option} {value!r} is not a precision; use one of {choices}") from None

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]

    @property
    def uses_grad_scaler(self) -> bool:
        return self is Precision.FP16


def autocast(precision: Precision, device: torch.device):
    """The forward-pass context for ``precision`` (a no-op for fp32)."""
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.dtype)


def grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (a disabled one passes calls through)."""
    return torch.amp.GradScaler(device.type, enabled=precision.uses_grad_scaler)


def supports_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            return bool(torch.cuda.is_bf16_supported())
        except (RuntimeError, AssertionError):
            return False
    return device.type == "cpu"
