"""The installed version, read from the package metadata (pyproject.toml is the one source)."""

from importlib import metadata

try:
    __version__ = metadata.version("autotune")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
