"""Byte quantities as users write them ("8GiB", "512MiB", "1.5GB", "1000000") and as we print them."""

import math
import re

from .errors import ConfigError, given

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, *, option=None) -> int:
    """Parse an int or a string with an optional SI/IEC unit into a positive number of bytes
    (``option``: the option named in errors, memory_limit by default)."""
    said = given(option or "memory_limit", value)
    if isinstance(value, bool):
        raise ConfigError(f"{said} is not a size; write e.g. 8GiB, 512MiB or 1000000")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _PATTERN.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{said} is not a size; write e.g. 8GiB, 512MiB, 1.5GB or 1000000 (bytes)"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(number * _UNITS[unit]):
        raise ConfigError(f"{said} is not a finite size; write e.g. 8GiB or 512MiB")
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise ConfigError(f"{said} must be more than 0 bytes; write e.g. 512MiB")
    return result


def option_bytes(n: int) -> str:
    """``n`` bytes as an option would be typed (``parse_bytes`` reads it back): "64MiB", "123B"."""
    return f"{n // 2**20}MiB" if n % 2**20 == 0 else f"{n}B"


def format_bytes(n: int | float | None) -> str:
    """Human-readable IEC size, e.g. 1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
