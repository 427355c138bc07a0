"""The training loop's own error kind (``autotune.errors`` is shared; this subclass lives here)."""

from ..errors import AutotuneError


class TrainError(AutotuneError):
    """Training cannot start or continue (resume mismatch, out of memory at micro-batch 1, ...)."""
