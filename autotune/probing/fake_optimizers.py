"""Optimizers that need help to step on fake tensors, and the help they get.

Each fallback changes no byte the estimate counts:

- bitsandbytes' 8-bit optimizers (``AdamW8bit``, ``PagedAdamW8bit``, ``Adam8bit``, ...) build
  their quantile maps (2 × 256 floats, shared by every parameter) with ``.tolist()``, which fake
  tensors cannot answer, when the optimizer is built: the maps are built on real tensors and
  handed to the fake mode, so the state init and the update (bitsandbytes registers fake
  kernels for it) run as they are. torchao's low-bit AdamW builds its maps the same way at its
  first step: they are built on real tensors first (plain Python floats, cached by torchao).
- torch's ``Adafactor`` reads scalars in its update (the step count and two norms, for the
  step size): under fake tensors those reads answer 1.0. They steer the arithmetic, never an
  allocation. Only optimizers listed here get that; any other value read keeps the estimate
  unavailable (the probe then measures with real trials, and says so).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS_STEER_NO_ALLOCATION = tuple(
    cls for cls in (getattr(torch.optim, "Adafactor", None),) if cls is not None)
"""Optimizers whose step reads tensor values only into Python scalars of the update's math."""


def build_with_real_constants(build, fake_mode):
    """``build()`` (the optimizer) with bitsandbytes' maps made real (``_real_constants``); built
    again once where ``build`` imported bitsandbytes itself and failed on them."""
    imported = _BNB_FUNCTIONAL in sys.modules
    try:
        with _real_constants(fake_mode):
            return build()
    except DataDependentOutputException:
        if imported or _BNB_FUNCTIONAL not in sys.modules:
            raise
    with _real_constants(fake_mode):
        return build()


_BNB_FUNCTIONAL = "bitsandbytes.functional"


@contextlib.contextmanager
def _real_constants(fake_mode):
    """While the optimizer is built: bitsandbytes' quantile maps are computed on real tensors
    and handed to the fake mode (see the module docstring). bitsandbytes is never imported here."""
    functional = sys.modules.get(_BNB_FUNCTIONAL)
    original = getattr(functional, "create_dynamic_map", None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def create_dynamic_map(*args, **kwargs):
        with unset_fake_temporarily():
            qmap = original(*args, **kwargs)
        return fake_mode.from_tensor(qmap)

    functional.create_dynamic_map = create_dynamic_map
    try:
        yield
    finally:
        functional.create_dynamic_map = original


def fake_step(optimizer: torch.optim.Optimizer):
    """Around a step on fake tensors (the first allocates the state): torchao's quantile maps
    are made on real tensors, scalar reads answer 1.0 for optimizers whose reads steer no
    allocation (see the module docstring); otherwise nothing changes."""
    if type(optimizer).__module__.startswith("torchao."):
        _warm_torchao_qmaps()
    if isinstance(optimizer, _SCALAR_READS_STEER_NO_ALLOCATION):
        return _ScalarReadsAsOne()
    return contextlib.nullcontext()


_TORCHAO_STATES = ("torchao.optim.subclass_8bit", "torchao.optim.subclass_4bit")


def _warm_torchao_qmaps() -> None:
    # Their state init reads the maps from lru_cache'd tuples of Python floats, built with
    # .tolist() on first use: built here on real tensors, they are plain constants after.
    with unset_fake_temporarily():
        for name in _TORCHAO_STATES:
            module = sys.modules.get(name)
            for getter in ("get_qmap_signed", "get_qmap_unsigned"):
                if callable(getattr(module, getter, None)):
                    getattr(module, getter)()


class _ScalarReadsAsOne(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        return func(*args, **(kwargs or {}))


__all__ = ["build_with_real_constants", "fake_step"]
