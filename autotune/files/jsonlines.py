"""Reading JSON Lines files (``autotune train --metrics``) without trusting their size or depth.

A metrics record is a few hundred bytes of flat JSON. A line past ``MAX_LINE_BYTES`` (or a file
such as ``/dev/zero`` with no line ends at all) is refused once that much is read, rather than
read until memory runs out; JSON nested deeper than Python's recursion limit is a ``ValueError``
like any other malformed line, not a ``RecursionError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

MAX_LINE_BYTES = 1024 * 1024


class LineTooLong(ValueError):
    """A line longer than ``MAX_LINE_BYTES``: not a metrics record."""

    def __init__(self, number: int):
        super().__init__(f"line {number} is longer than {MAX_LINE_BYTES // 1024} KiB")
        self.number = number


def read_lines(path) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` for each line of ``path`` (1-based, line ends removed); raises
    ``LineTooLong``, ``OSError`` or ``UnicodeDecodeError``."""
    with open(Path(path), "rb") as handle:
        number = 0
        while True:
            line = handle.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise LineTooLong(number)
            yield number, line.decode("utf-8").rstrip("\r\n")


def loads(text: str):
    """``json.loads``; JSON nested too deep for Python is a ``json.JSONDecodeError`` too."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text[:0], 0) from None
