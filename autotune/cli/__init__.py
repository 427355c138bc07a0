"""The ``autotune`` command: ``main`` parses and calls the public API; ``format`` renders text."""

from .main import cli, main

__all__ = ["cli", "main"]
