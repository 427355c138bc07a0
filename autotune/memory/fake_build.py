"""A model file's model, built on fake tensors whatever its library does while building it.

``build_model()`` first runs under the fake mode in force, so every parameter is a fake CPU
tensor from the start. Some libraries cannot build there: peft moves each adapter onto its base
layer's device with ``Module.to()``, and torch refuses to swap a fake parameter that the fake
mode holds weak references to (``_apply(): Couldn't swap Linear.weight``). Such a model is built
on the meta device instead (shapes and dtypes, nothing allocated) and each of its tensors
replaced by a fake CPU tensor of the same shape, strides, dtype and ``requires_grad``; where even
that fails (code that reads values while building), it is built for real on the CPU (counted, and
refused past half the RAM available) and copied onto fake tensors as a model instance is, its
bitsandbytes 4-bit layers replaced by stand-ins of the same storage (``memory.quantized``; the
estimate is then unverified, ``estimate_caveat``); a model no way builds on fake tensors (other
quantized tensor subclasses) is measured with real trials only (``EstimateUnavailable``). Each fallback is said once per model factory (an
``AutotuneWarning``), and later builds take the way that worked without trying the others.
A build that fails for real too is the model file's own error and propagates untouched.
"""

from __future__ import annotations

import copy
import gc
import os
import traceback
import warnings
import weakref

import torch
from torch._subclasses import fake_tensor

from ..errors import AutotuneError, AutotuneWarning, EstimateUnavailable, UserCodeError
from ..units import format_bytes
from .cpu import CPUMemoryBackend
from .oom import is_oom_error
from .quantized import QuantizedLinear, replace_quantized

_FAKE, _META, _REAL, _NONE = "fake", "meta", "real", "none"
# How each model factory was last built, and why not on fake tensors (weak keys: a factory that
# goes away takes its entry).
_WAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Factories whose meta build, or its cut, failed: their cut builds are made on fake tensors.
_NO_META_CUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Why a factory's estimate is unverified (quantized layers run as stand-ins).
_CAVEATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def build_fake_model(workload, cut=None) -> torch.nn.Module:
    """``workload``'s model on fake CPU tensors; called inside a ``FakeTensorMode``.

    An instance is copied (the user's module and its real tensors stay untouched); a factory is
    built as the module docstring says.

    ``cut(model)``, where given, edits the built model in place (a few-block build drops blocks)
    and is applied to the model returned. A factory that builds on fake tensors is then built on
    the meta device, cut there, and only what is left made fake: a 70B model's 80 blocks cost
    their fake tensors' making (a third of a second each build), of which a few-block build
    keeps three. Where the meta build or the cut fails there, the model is built as without
    ``cut`` and cut afterwards.
    """
    if workload.model_is_instance:
        model = fake_copy(workload.model, workload.source)
        if cut is not None:
            cut(model)
        return model
    if cut is not None:
        model = _cut_on_meta(workload, cut)
        if model is not None:
            return model
        model = build_fake_model(workload)
        cut(model)
        return model
    way, why = _way(workload.model)
    if way == _FAKE:
        try:
            return _remember(workload.model, _FAKE, workload.new_model())
        except Exception as exc:  # noqa: BLE001 - a real build below re-raises a genuine bug
            if not may_build_elsewhere(exc):
                raise
            why = _reason(exc)
        # The failed build's fake tensors, counted by the tracker, sit in reference cycles (the
        # traceback's frames hold the half-built model): gone before the next build counts.
        gc.collect()
    if way in (_FAKE, _META):
        try:
            model = _remember(workload.model, _META, _fake_from_meta(_meta_build(workload)))
        except Exception as exc:  # noqa: BLE001 - as above
            if not may_build_elsewhere(exc):
                raise
        else:
            if way == _FAKE:
                _say(f"{workload.source}: build_model() cannot run on fake tensors ({why}); built it "
                     f"on the meta device instead and counted its tensors as fake CPU tensors")
            return model
    if way == _NONE:
        raise EstimateUnavailable(why)
    try:
        real = _real_build(workload, why)
        model = _copied(real, workload.source, why)
    except EstimateUnavailable as exc:
        # No later build tries again: each would fail the same way, a real build at a time.
        _remember(workload.model, _NONE, None, why=str(exc))
        raise
    stand_ins = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    if stand_ins:
        _CAVEATS[workload.model] = (
            f"the memory estimate of {workload.source} is unverified: {stand_ins} bitsandbytes "
            f"4-bit layers cannot run on fake tensors, so they were counted by dtype (packed "
            f"weights and quantization state, as built) and run with a dequantized stand-in weight "
            f"(bitsandbytes' MatMul4Bit dequantizes in forward and backward; a fused kernel may "
            f"use less); measure on the device (autotune probe, autotune verify) to confirm it")
    if way != _REAL:
        size = sum(t.untyped_storage().nbytes() for t in _tensors(real))
        _say(f"{workload.source}: build_model() cannot run on fake tensors nor on the meta device "
             f"({why}); built it for real on the CPU ({format_bytes(size)} of tensors, freed once "
             f"copied) and copied it onto fake tensors" + (f"; {_CAVEATS[workload.model]}"
                                                            if stand_ins else ""))
    return _remember(workload.model, _REAL, model)


def estimate_caveat(workload) -> str | None:
    """Why the estimate of ``workload``'s model is unverified (quantized stand-ins), or None;
    known once a build on fake tensors ran."""
    if workload.model_is_instance:
        return None
    try:
        return _CAVEATS.get(workload.model)
    except TypeError:
        return None


def fake_copy(model: torch.nn.Module, source: str) -> torch.nn.Module:
    """A deep copy of ``model`` made inside a fake mode: fake tensors of its real ones."""
    try:
        return copy.deepcopy(model, _plain_tensors_made_fake(model))
    except (TypeError, RuntimeError, copy.Error) as exc:
        raise EstimateUnavailable(
            f"{source}: the model instance cannot be copied onto fake tensors "
            f"({type(exc).__name__}: {exc}); pass the model file (a build_model() factory) or "
            f"measure with real trials (autotune probe)"
        ) from exc


def _plain_tensors_made_fake(model: torch.nn.Module) -> dict:
    """A ``deepcopy`` memo of each buffer and tensor attribute that is not a parameter: a fake
    tensor of its layout, made in the fake mode in force (which counts it). ``Tensor.__deepcopy__``
    copies such a tensor through its storage, which a fake mode refuses (Llama's rotary
    frequencies, bitsandbytes' quantization state); a parameter copies through ``clone()``."""
    memo = {}
    for module in model.modules():
        tensors = [*module._buffers.values(), *(v for v in vars(module).values()
                                                if isinstance(v, torch.Tensor))]
        for t in tensors:
            if (t is not None and not isinstance(t, (torch.nn.Parameter, fake_tensor.FakeTensor))
                    and type(t) is torch.Tensor and id(t) not in memo):
                memo[id(t)] = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
    return memo


def may_build_elsewhere(exc: Exception) -> bool:
    """Whether a failed build may succeed another way: not out of memory (the trial's answer) nor
    autotune's own refusal; an error of the model file's code (``UserCodeError``) may be one that
    fake or meta tensors caused, and a real build raises it again where it is not."""
    if is_oom_error(exc):
        return False
    return isinstance(exc, UserCodeError) or not isinstance(exc, AutotuneError)


def _way(factory) -> tuple[str, str]:
    try:
        return _WAYS.get(factory, (_FAKE, ""))
    except TypeError:  # an unhashable or un-weakreferenceable callable: tried from the start
        return _FAKE, ""


def _remember(factory, way: str, model, *, why: str = "as an earlier build found"):
    try:
        _WAYS[factory] = (way, why)
    except TypeError:
        pass
    return model


def _say(message: str) -> None:
    warnings.warn(message, AutotuneWarning, stacklevel=3)


def _reason(exc: BaseException) -> str:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    # Torch's "_apply(): Couldn't swap" names the parameter; its cause says why.
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        detail = f"{detail}: {str(cause).strip().splitlines()[0]}"
    frame = _library_frame(exc)
    return f"{type(exc).__name__}: {detail}" + (f", in {frame}" if frame else "")


def _library_frame(exc: BaseException) -> str:
    """"peft/tuners/lora/layer.py:314": the innermost frame outside torch and autotune."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    autotune_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if not path.startswith((torch_dir, autotune_dir)) and "<frozen" not in path:
            parts = path.split(os.sep)
            site = next((i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")), None)
            shown = os.sep.join(parts[site + 1:]) if site is not None else path
            return f"{shown}:{frame.lineno}"
    return ""


def _cut_on_meta(workload, cut) -> torch.nn.Module | None:
    """The model built on the meta device, ``cut``, and made fake; None where it builds another
    way or the meta build or cut fails (not an error of the build itself: the caller's build
    raises that again)."""
    if _way(workload.model)[0] != _FAKE or _remembered(_NO_META_CUT, workload.model):
        return None
    try:
        model = _meta_build(workload)
        with fake_tensor.unset_fake_temporarily():
            cut(model)
    except Exception as exc:  # noqa: BLE001 - the build that follows re-raises a genuine bug
        if not may_build_elsewhere(exc):
            raise
        _remember_in(_NO_META_CUT, workload.model)
        gc.collect()
        return None
    return _fake_from_meta(model)


def _remembered(table, factory) -> bool:
    try:
        return factory in table
    except TypeError:
        return True


def _remember_in(table, factory) -> None:
    try:
        table[factory] = True
    except TypeError:
        pass


def _meta_build(workload) -> torch.nn.Module:
    with fake_tensor.unset_fake_temporarily(), torch.device("meta"):
        return workload.new_model()


def _real_build(workload, why: str) -> torch.nn.Module:
    # Counted as the CPU backend counts a trial, against half the RAM available now: a model too
    # large for this host is refused before its weights are allocated, not built until it swaps.
    host = CPUMemoryBackend()
    with fake_tensor.unset_fake_temporarily():
        try:
            with host.tracking():
                return workload.new_model()
        except Exception as exc:  # noqa: BLE001 - re-raised untouched unless out of memory
            if not is_oom_error(exc):
                raise
    raise EstimateUnavailable(
        f"{workload.source}: the model cannot be built on fake tensors nor on the meta device "
        f"({why}), and built for real it passes {format_bytes(host.info().budget_bytes)} "
        f"({host.info().budget_source}), so its memory is measured with real trials only")


def _copied(real: torch.nn.Module, source: str, why: str) -> torch.nn.Module:
    # bitsandbytes' 4-bit layers, which no fake copy can make, become stand-ins that hold their
    # storage by dtype (memory.quantized); the estimate is then unverified for this model.
    with fake_tensor.unset_fake_temporarily():
        replace_quantized(real)
    try:
        return fake_copy(real, source)
    except EstimateUnavailable as exc:
        # Quantized weights (bitsandbytes' Params4bit) are tensor subclasses a fake copy cannot make.
        raise EstimateUnavailable(
            f"{source}: the model cannot be built on fake tensors nor on the meta device ({why}), "
            f"and the one built for real cannot be copied onto them ({exc.__cause__}), so its "
            f"memory is measured with real trials only") from exc


def _tensors(model: torch.nn.Module):
    return [*model.parameters(), *model.buffers()]


def _fake_from_meta(model: torch.nn.Module) -> torch.nn.Module:
    """Every tensor of ``model`` that is not fake (parameters, buffers, plain tensor attributes
    such as rotary embeddings' saved frequencies) replaced by a fake CPU tensor of the same shape,
    strides, dtype and ``requires_grad``, made under the fake mode in force (so its tracker counts
    it); a tensor shared by several modules (tied embeddings) stays shared."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, fake_tensor.FakeTensor):
            return t
        if id(t) not in made:
            new = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    keep = []  # the meta tensors, alive until done so that no id is reused
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    keep.append(t)
                    table[name] = fake(t)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                keep.append(value)
                object.__setattr__(module, name, fake(value))
    return model


__all__ = ["build_fake_model", "estimate_caveat", "fake_copy", "may_build_elsewhere"]
