"""The installed version, read from the package metadata (pyproject.toml is the one source)."""

import re
from importlib import metadata

try:
    __version__ = metadata.version("autotune")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

TORCH_FLOOR = (2, 13)
"""The oldest torch autotune works with; pyproject.toml's "torch>=2.13" says the same (a test checks),
and CI runs the fast suite on it. Older releases lack what it is built on (issue 24): FSDP2
(``fully_shard``, ``FSDPModule``) in ``torch.distributed.fsdp`` and ``nn.utils.get_total_norm``
(before 2.6), fake-tensor implementations of the collectives that sharded estimates trace (before
2.11), FSDP2's ``_fsdp_param_groups`` (2.11), and a sharded estimate that matches the real step
(2.11 and 2.12 differ by 6-9%; on 2.11 the estimate is the lower)."""


def check_torch(version: str | None = None) -> None:
    """Raise ImportError naming the floor when torch (``version``, else the installed one's
    ``torch.__version__``) is older than TORCH_FLOOR, instead of a failure deep inside a command."""
    if version is None:
        import torch

        version = torch.__version__
    release = tuple(int(part) for part in re.findall(r"\d+", str(version).split("+")[0])[:2])
    if release < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"autotune needs torch {floor} or newer, and torch {version} is installed; "
            f"upgrade it: pip install 'torch>={floor}' (CPU-only: add "
            f"--index-url https://download.pytorch.org/whl/cpu)"
        )
