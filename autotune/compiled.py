"""torch.compile in the training step: the setting, the compiled module, and its compilations.

A workload trains compiled when it asks (``Workload.compile``: ``--compile`` / ``compile=``) or
when ``build_model()`` returns a compiled module (``torch.compile(model)``, an
``OptimizedModule``). The probe's real trials and the loop then run the compiled step; the
fake-tensor estimate runs the eager module under it (``eager_module``), since a compiled graph
cannot be traced on fake tensors (that can crash the process: see ``probing/isolated.py``).

Trials run at many micro-batches: the module is compiled with ``dynamic=True`` and each batch
tensor's first dimension is marked dynamic, so a new micro-batch does not compile a new graph
(torch specialises size 1, so a search that tries 1 compiles twice in all).
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import ConfigError, given

DEFAULT_BACKEND = "inductor"


def is_compiled(model) -> bool:
    """Whether ``model`` is a module ``torch.compile`` returned."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def eager_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a compiled one wraps (its parameters, blocks and state dict keys); any other
    module itself."""
    return model._orig_mod if is_compiled(model) else model


def compile_backend(value, *, name: str = "compile") -> str | None:
    """``compile=``/``--compile-backend`` as a backend name: False/None (eager) -> None, True ->
    inductor, a name -> that name where torch knows it."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_BACKEND
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(value, str) or value not in known:
        raise ConfigError(f"{given(name, value)} is not a torch.compile backend; use one of "
                          f"{', '.join(known)} (True: {DEFAULT_BACKEND})")
    return value


def with_compile(workload, compile):
    """``workload`` with ``compile`` (see ``compile_backend``) as its ``compile``; None keeps the
    workload's own."""
    if compile is None:
        return workload
    return dataclasses.replace(workload, compile=compile_backend(compile))


def compiled_note(workload, graphs: int, trials: int, *, estimated: bool) -> str:
    """What a probe of a compiled step says about it (``ProbeResult.notes``, the plan's reason)."""
    how = (f"torch.compile backend {workload.compile}, batch sizes dynamic" if workload.compile
           else "build_model() returns a torch.compile'd module")
    seed = ("; the estimate ran the eager step on fake tensors (a compiled graph cannot run "
            "there) and only chose where the real, compiled trials start" if estimated else "")
    return (f"the real trials ran the compiled training step ({how}): {graphs} graph(s) compiled "
            f"over {trials} trial(s){seed}")


def compiled_step_module(model: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    """What a training step calls: ``model`` compiled with ``backend`` (batch sizes dynamic), a
    module the user compiled as it is, or ``model`` itself without a backend."""
    if backend is None or is_compiled(model):
        return model
    return torch.compile(model, backend=backend, dynamic=True)


def mark_batch_dynamic(batch) -> None:
    """Marks the first (batch) dimension of every tensor in ``batch`` dynamic, so a compiled
    module that the user compiled without ``dynamic=True`` does not compile a graph per size."""
    tensors = batch.values() if isinstance(batch, dict) else (
        batch if isinstance(batch, (tuple, list)) else [batch])
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        elif isinstance(tensor, (tuple, list, dict)):
            mark_batch_dynamic(tensor)


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (each recompilation adds one;
    so does each graph break)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


__all__ = ["DEFAULT_BACKEND", "compile_backend", "compiled_note", "compiled_step_module", "eager_module",
           "graphs_compiled", "is_compiled", "mark_batch_dynamic", "with_compile"]
