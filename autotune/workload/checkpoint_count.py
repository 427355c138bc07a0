"""Activation checkpointing as one value: ``Checkpointing`` (off, every block, or K of N blocks).

The user's ``--checkpointing`` (``checkpointing=`` from Python) is parsed once, where it enters,
into a ``CheckpointingRequest``: "auto" (the planner chooses; ``plan`` only), "off", "on" (every
block), a count K ("4") or a fraction of the blocks ("1/3", "0.5"); bools mean on/off. Once the
model's number of repeated blocks N is known, ``request.resolve(N)`` gives the ``Checkpointing``
that probing, planning, tuning, training, reports and exports all use: a fraction rounds up, so
"1/3" of 12 blocks is 4 and of 4 blocks is 2.

A ``Checkpointing`` is truthy when any block is checkpointed, equal to another that checkpoints the
same blocks ("on" of an unknown count equals every one of N), and labelled "off", "on" or
"K of N blocks" in every report. In plan files (schema 3) it is ``{"blocks": K, "total": N}``
(``blocks`` null: every block of a count not recorded); older files' pair ``checkpointing`` (a
bool) and ``checkpointed_blocks`` is read by ``Checkpointing.from_file``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ..errors import ConfigError, given
from ..errors import option as _caller_words

CHECKPOINTING_VALUES = "auto, off, on, a block count K or a fraction such as 1/3"

AUTO = "auto"


@dataclass(frozen=True, eq=False)
class Checkpointing:
    """Which of the model's repeated blocks are checkpointed: none, every one, or K of N (spread
    evenly from the first)."""

    blocks: int | None = 0
    """Checkpointed blocks: 0 for off, None for every block of a count not known."""
    total: int | None = None
    """The model's repeated blocks (None: not known, or not recorded in older files)."""

    def __post_init__(self):
        for name in ("blocks", "total"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"checkpointing {name} {value!r} must be a block count, 0 or more")
        if self.blocks is not None and self.total is not None and self.blocks > self.total:
            raise ConfigError(f"checkpointing {self.blocks} blocks: the model has {self.total}")
        if self.blocks is None and self.total is not None:
            object.__setattr__(self, "blocks", self.total)

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def off(cls, total: int | None = None) -> "Checkpointing":
        return cls(blocks=0, total=total)

    @classmethod
    def every_block(cls, total: int | None = None) -> "Checkpointing":
        """Every repeated block ("on"); of ``total`` blocks where known."""
        return cls(blocks=total, total=total)

    @classmethod
    def of(cls, blocks: int | None, total: int | None = None) -> "Checkpointing":
        """``blocks`` of ``total`` (0: off; None: every block)."""
        return cls(blocks=total if blocks is None else blocks, total=total)

    @classmethod
    def parse(cls, value, *, total: int | None = None, option: str = "checkpointing",
              source: str = "model") -> "Checkpointing":
        """A user's value other than "auto" (see ``CheckpointingRequest.parse``), resolved on
        ``total`` blocks where known (a fraction needs them)."""
        if isinstance(value, Checkpointing):
            return value if total is None or value.total == total else value.resolve_on(total, option, source)
        return CheckpointingRequest.parse(value, option=option, allow_auto=False).resolve(
            total, option=option, source=source)

    def resolve_on(self, total: int, option: str = "checkpointing",
                   source: str = "model") -> "Checkpointing":
        """This setting on a model of ``total`` blocks (every block stays every block)."""
        return CheckpointingRequest.parse(self, option=option).resolve(total, option=option, source=source)

    # --- what it says ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether any block is checkpointed."""
        return self.blocks != 0

    def __bool__(self) -> bool:
        return self.enabled

    @property
    def all_blocks(self) -> bool:
        """Every repeated block (what "on" means)."""
        return self.enabled and (self.blocks is None or self.blocks == self.total)

    @property
    def count(self) -> int | None:
        """Checkpointed blocks: 0 when off, None for every block of a count not known."""
        return self.blocks

    @property
    def label(self) -> str:
        """"off", "on" (every block) or "K of N blocks"."""
        return describe_blocks(self.blocks, self.total)

    @property
    def setting(self) -> str | int:
        """"off", "on" or the count K, as a user would write it."""
        if not self.enabled:
            return "off"
        return "on" if self.all_blocks else self.blocks

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"Checkpointing({self.label})"

    def _key(self):
        return (("off",) if not self.enabled else ("on",) if self.all_blocks
                else ("blocks", self.blocks, self.total))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Checkpointing):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    # --- plan files -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "total": self.total}

    @classmethod
    def from_dict(cls, data: dict) -> "Checkpointing":
        return cls(blocks=data["blocks"], total=data.get("total"))

    @classmethod
    def from_file(cls, value, blocks: int | None = None, total: int | None = None) -> "Checkpointing":
        """A plan file's value: ``{"blocks", "total"}`` (schema 3), or the bool and
        ``checkpointed_blocks`` of schema 1 and 2 (None blocks: every block), of ``total``."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, bool):
            if not value:
                return cls.off(total)
            if blocks is not None and total is not None and blocks > total:
                total = None  # a count the file did not pair with the model's: keep the count
            return cls.of(blocks, total)
        return cls.parse(value, total=total)


@dataclass(frozen=True)
class CheckpointingRequest:
    """What the user asked for: "auto", "off", "on", a count K or a fraction of the blocks, as
    parsed from any accepted form (``parse``); ``resolve`` turns it into a ``Checkpointing``."""

    value: str | int | Fraction
    """"auto", "off", "on", an int K >= 0 or a Fraction in (0, 1]."""

    @classmethod
    def parse(cls, value, *, option: str = "checkpointing", allow_auto: bool = True) -> "CheckpointingRequest":
        """"auto", "off", "on", an int K >= 0, a Fraction or float in [0, 1], their strings
        ("4", "1/3", "0.5"); bools mean on/off; a ``Checkpointing`` asks for itself. Anything else
        is a ConfigError naming ``option`` and the values it takes."""
        if isinstance(value, CheckpointingRequest):
            if value.auto and not allow_auto:
                value = value.value
            else:
                return value
        if isinstance(value, Checkpointing):
            return cls(value.setting)
        if isinstance(value, bool):
            return cls("on" if value else "off")
        if isinstance(value, int):
            return cls(_count(value, option, value))
        if isinstance(value, Fraction):
            return cls(_fraction(value, option, value))
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(_not_a_setting(option, value, allow_auto))
            return cls(_fraction(Fraction(value).limit_denominator(1000), option, value))
        text = str(value).strip().lower()
        if text in ("off", "on") or (allow_auto and text == AUTO):
            return cls(text)
        try:
            if "/" in text or "." in text:
                number = Fraction(text)
                if not math.isfinite(float(number)):
                    raise ValueError(text)
                return cls(_fraction(number, option, value))
            return cls(_count(int(text), option, value))
        except (ValueError, ZeroDivisionError):
            pass
        raise ConfigError(_not_a_setting(option, value, allow_auto))

    @property
    def auto(self) -> bool:
        """The planner chooses (``plan`` only)."""
        return self.value == AUTO

    @property
    def fraction(self) -> Fraction | None:
        return self.value if isinstance(self.value, Fraction) else None

    def __str__(self) -> str:
        return str(self.value)

    @property
    def label(self) -> str:
        """"auto", "off", "on", "K blocks" or the fraction, for messages before the model's
        block count is known."""
        return describe_blocks(self.value, None) if isinstance(self.value, int) else str(self.value)

    def resolve(self, total: int | None, *, option: str = "checkpointing",
                source: str = "model") -> Checkpointing:
        """The ``Checkpointing`` this asks for on a model of ``total`` repeated blocks (None: not
        known yet, which only "off", "on" and counts can do without)."""
        if self.auto:
            raise ConfigError(f"{given(option, 'auto')}: only plan chooses the checkpointing; use off, on, a "
                              f"block count K or a fraction such as 1/3")
        value = self.value
        if value == "off":
            return Checkpointing.off(total)
        if total is None:
            if value == "on":
                return Checkpointing.every_block()
            if isinstance(value, Fraction):
                raise ConfigError(f"{given(option, str(value))}: a fraction of the blocks needs the model's "
                                  f"block count; give a count K, on or off")
            return Checkpointing.of(value)
        count = resolve_blocks(self, total, option=option, source=source)
        return Checkpointing.of(count, total)


def _not_a_setting(option: str, value, allow_auto: bool) -> str:
    choices = CHECKPOINTING_VALUES if allow_auto else CHECKPOINTING_VALUES.replace("auto, ", "")
    return f"{given(option, value)} is not a checkpointing setting; use {choices}"


def _count(number: int, option: str, value) -> int | str:
    if number < 0:
        raise ConfigError(f"{given(option, value)}: a block count must be 0 or more (0 is off)")
    return number


def _fraction(number: Fraction, option: str, value) -> Fraction | str:
    if not 0 <= number <= 1:
        raise ConfigError(f"{given(option, value)}: a fraction of the blocks must be between 0 and 1 "
                          f"(0 is off, 1 is on)")
    return "off" if number == 0 else number


def resolve_blocks(value, total: int, *, option: str = "checkpointing", source: str = "model") -> int:
    """The number of blocks to checkpoint, of ``total``, for a value other than "auto"."""
    value = CheckpointingRequest.parse(value, option=option, allow_auto=False).value
    if value == "off":
        return 0
    if value == "on":
        count = total
    elif isinstance(value, Fraction):
        count = math.ceil(value * total)
    else:
        count = value
    if count > total:
        raise ConfigError(f"{given(option, count)}: {source} has {total} repeated blocks to checkpoint; "
                          f"use a count from 0 to {total}, a fraction, or on")
    if count and not total:
        raise ConfigError(f"{_caller_words(option)}: {source} has no repeated blocks (an nn.ModuleList or "
                          f"nn.Sequential of layers) to checkpoint; use off")
    return count


def describe_blocks(blocks: int | None, total: int | None) -> str:
    """"off", "on" (every block) or "K of N blocks" for a resolved count (None: every block)."""
    if blocks == 0:
        return "off"
    if blocks is None or (total is not None and blocks >= total):
        return "on"
    return f"{blocks} of {total} blocks" if total is not None else f"{blocks} blocks"


__all__ = ["AUTO", "CHECKPOINTING_VALUES", "Checkpointing", "CheckpointingRequest", "describe_blocks",
           "resolve_blocks"]
