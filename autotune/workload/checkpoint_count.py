"""How many repeated blocks to checkpoint: the ``--checkpointing`` value and its resolution.

A value is "auto" (the planner chooses; ``plan`` only), "off", "on" (every block), a count K
("4") or a fraction of the blocks ("1/3", "0.5"). ``resolve_blocks`` turns it into a count once the
model's number of blocks N is known: a fraction rounds up, so "1/3" of 12 blocks is 4 and of 4
blocks is 2.
"""

from __future__ import annotations

import math
from fractions import Fraction

from ..errors import ConfigError

CHECKPOINTING_VALUES = "auto, off, on, a block count K or a fraction such as 1/3"


def parse_checkpointing(value, *, option: str = "--checkpointing", allow_auto: bool = True):
    """"auto", "off", "on", an int K >= 0 or a Fraction in (0, 1]; bools mean on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return _count(value, option, value)
    if isinstance(value, Fraction):
        return _fraction(value, option, value)
    if isinstance(value, float):
        return _fraction(Fraction(value).limit_denominator(1000), option, value)
    text = str(value).strip().lower()
    if text in ("off", "on") or (allow_auto and text == "auto"):
        return text
    try:
        if "/" in text or "." in text:
            number = Fraction(text)
            if not math.isfinite(float(number)):
                raise ValueError(text)
            return _fraction(number, option, value)
        return _count(int(text), option, value)
    except (ValueError, ZeroDivisionError):
        pass
    choices = CHECKPOINTING_VALUES if allow_auto else CHECKPOINTING_VALUES.replace("auto, ", "")
    raise ConfigError(f"{option} {value!r} is not a checkpointing setting; use {choices}")


def _count(number: int, option: str, value) -> int | str:
    if number < 0:
        raise ConfigError(f"{option} {value!r}: a block count must be 0 or more (0 is off)")
    return number


def _fraction(number: Fraction, option: str, value) -> Fraction | str:
    if not 0 <= number <= 1:
        raise ConfigError(f"{option} {value!r}: a fraction of the blocks must be between 0 and 1 "
                          f"(0 is off, 1 is on)")
    return "off" if number == 0 else number


def resolve_blocks(value, total: int, *, option: str = "--checkpointing", source: str = "model") -> int:
    """The number of blocks to checkpoint, of ``total``, for a value other than "auto"."""
    value = parse_checkpointing(value, option=option, allow_auto=False)
    if value == "off":
        return 0
    if value == "on":
        count = total
    elif isinstance(value, Fraction):
        count = math.ceil(value * total)
    else:
        count = value
    if count > total:
        raise ConfigError(f"{option} {count}: {source} has {total} repeated blocks to checkpoint; "
                          f"use a count from 0 to {total}, a fraction, or on")
    if count and not total:
        raise ConfigError(f"{option}: {source} has no repeated blocks (an nn.ModuleList or "
                          f"nn.Sequential of layers) to checkpoint; use off")
    return count


def describe_blocks(blocks: int | None, total: int | None) -> str:
    """"off", "on" (every block) or "K of N blocks" for a resolved count (None: every block)."""
    if blocks == 0:
        return "off"
    if blocks is None or (total is not None and blocks >= total):
        return "on"
    return f"{blocks} of {total} blocks" if total is not None else f"{blocks} blocks"


__all__ = ["CHECKPOINTING_VALUES", "describe_blocks", "parse_checkpointing", "resolve_blocks"]
