"""Training precisions: fp32, bf16 autocast, fp16 autocast with a GradScaler, on any device."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from .choices import Choice
from .errors import ConfigError


class Precision(Choice):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradScalerSettings:
    """``torch.amp.GradScaler``'s knobs for fp16 training; the defaults are torch's."""

    init_scale: float = 2.0 ** 16
    """The loss scale to start from."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after ``growth_interval`` steps without inf/NaN."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this when a step finds inf/NaN (and that step is skipped)."""
    growth_interval: int = 2000
    """Steps without inf/NaN before the scale grows."""

    def __post_init__(self):
        checks = (
            ("init_scale", self.init_scale, lambda v: v > 0, "a positive number such as 65536"),
            ("growth_factor", self.growth_factor, lambda v: v > 1, "a number above 1 such as 2"),
            ("backoff_factor", self.backoff_factor, lambda v: 0 < v < 1,
             "a number between 0 and 1 such as 0.5"),
        )
        for name, value, valid, want in checks:
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or not valid(value)):
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} must be {want}")
        if (isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int)
                or self.growth_interval < 1):
            raise ConfigError(f"--growth-interval {self.growth_interval!r} must be a whole number of "
                              f"steps, at least 1, such as 2000")

    def with_overrides(self, **overrides) -> "GradScalerSettings":
        """These settings with every override that is not None applied."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GradScalerSettings":
        return cls(**data)


def scaler_settings(value, base: GradScalerSettings | None = None) -> GradScalerSettings:
    """``value`` (None, a dict of overrides, or GradScalerSettings) applied over ``base``."""
    base = base or GradScalerSettings()
    if value is None:
        return base
    if isinstance(value, GradScalerSettings):
        return value
    if not isinstance(value, dict) or set(value) - set(GradScalerSettings.__dataclass_fields__):
        raise ConfigError(f"grad_scaler {value!r} must be a GradScalerSettings or a dict of "
                          f"{', '.join(GradScalerSettings.__dataclass_fields__)}")
    return base.with_overrides(**value)


def grad_scaler(precision: Precision, device: torch.device,
                settings: GradScalerSettings | None = None) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (a disabled one passes calls through)."""
    knobs = (settings or GradScalerSettings()).to_dict()
    return torch.amp.GradScaler(device.type, enabled=precision.uses_grad_scaler, **knobs)


def supports_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            return bool(torch.cuda.is_bf16_supported())
        except (RuntimeError, AssertionError):
            return False
    return device.type == "cpu"
