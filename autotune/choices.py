"""String choices (precision, sharding): enums equal to, hashed and printed as their values."""

from __future__ import annotations

import enum

from .errors import ConfigError, given


class Choice(str, enum.Enum):
    """Subclasses name a setting (the class name, lower-cased, is its option and noun)."""

    def __str__(self) -> str:
        return self.value

    # Equal to its value as a string, so it must hash like one (dict keys, sets, Optuna params).
    __hash__ = str.__hash__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value, *, option: str | None = None):
        """``value`` (a member or its value, any case) as a member; a ConfigError naming the
        option and the choices otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            noun = cls.__name__.lower()
            choices = ", ".join(member.value for member in cls)
            said = f"{option} {value!r}" if option else given(noun, value)
            raise ConfigError(f"{said} is not a {noun}; use one of "
                              f"{choices}") from None


__all__ = ["Choice"]
