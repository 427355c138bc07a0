"""What counts as running out of memory: decided here and nowhere else.

An exception is an out-of-memory error when it is

* ``torch.OutOfMemoryError`` (the same class as ``torch.cuda.OutOfMemoryError``; autotune's CPU
  memory backend raises it too when a trial passes its budget),
* Python's ``MemoryError``,
* a ``RuntimeError`` whose message is one of the allocator failures torch reports as plain
  runtime errors: "CUDA out of memory", "CUDA error: out of memory", "HIP out of memory",
  "MPS backend out of memory", "DefaultCPUAllocator: can't allocate memory",
  "cuDNN error: CUDNN_STATUS_ALLOC_FAILED" (cuDNN failing to get its workspace).

Everything else (a shape error, a typo in the user's model) is *not* out of memory and must
propagate untouched with its original traceback.
"""

from __future__ import annotations

import gc

import torch

_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "HIP out of memory",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` means the step ran out of memory (see the module docstring)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(text in message for text in _OOM_MESSAGES)
    return False


def free_memory() -> None:
    """Return cached memory after an OOM; call it *outside* the ``except`` block.

    Inside ``except`` the traceback still references the failed step's frames and tensors.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
