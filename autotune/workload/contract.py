"""The model-file contract: load a user's ``model.py`` (or objects) into a checked ``Workload``.

A model file defines ``build_model()`` and ``make_batch(batch_size)`` (or, instead of
``make_batch``, ``build_dataset()``: the probe then batches its largest examples).
``make_batch(batch_size, seq_len)`` (the second parameter named ``seq_len``, optionally with a
default) makes the sequence length a planned dimension: ``autotune probe --max-seq-len`` and
``autotune plan --seq-len/--target-tokens`` call it with the length to measure or train, and
every batch then holds ``seq_len`` positions per sample (the second dimension). Optionally
``loss_fn(model, batch)``, ``build_optimizer(params)``, ``build_dataset()``,
``collate_fn(examples)`` (how a list of the dataset's examples becomes a batch, e.g. padding
variable-length sequences; default: torch's default_collate), ``build_scheduler(optimizer,
plan)`` and the constants ``BASE_LR`` / ``BASE_BATCH``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import sysconfig
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import AutotuneError, UserCodeError, WorkloadError
from ..memory.oom import is_oom_error
from .dataset_batch import LargestExamples

REQUIRED = ("build_model",)
OPTIONAL = ("loss_fn", "build_optimizer", "build_dataset", "build_scheduler", "collate_fn")


@dataclass(kw_only=True)
class Workload:
    """Everything autotune needs to run a training step of the user's model.

    ``model`` is either a factory returning a fresh ``nn.Module`` (what a model file's
    ``build_model`` is) or a module instance; an instance is probed in place and restored.
    """

    model: Callable[[], torch.nn.Module] | torch.nn.Module
    make_batch: Callable[[int], Any] | None = None
    """None: batches of ``build_dataset()``'s largest examples (``collate_fn`` applied)."""
    loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None
    build_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    build_dataset: Callable[[], Any] | None = None
    build_scheduler: Callable[..., Any] | None = None
    collate_fn: Callable[[list], Any] | None = None
    """Turns a list of ``build_dataset()`` examples into a batch (None: default_collate)."""
    base_lr: float | None = None
    base_batch: int | None = None
    source: str = "<python objects>"
    file_sha256: str | None = None
    namespace: dict = field(default_factory=dict, repr=False)
    seq_len: int | None = None
    """The sequence length every batch is made at (``make_batch(n, seq_len)``); None: the
    model file's own (``make_batch(n)``). Set with ``at_seq_len``, as a plan with ``seq_len``
    does for ``train`` and ``verify``."""
    compile: str | None = None
    """The torch.compile backend the training step runs under (``--compile``; None: the model
    as ``build_model()`` returns it, compiled or not). See ``autotune/compiled.py``."""

    def __post_init__(self):
        if not (isinstance(self.model, torch.nn.Module) or callable(self.model)):
            raise WorkloadError(
                f"{self.source}: model must be an nn.Module or a build_model() callable, "
                f"got {type(self.model).__name__}"
            )
        for name in ("make_batch",) + OPTIONAL:
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise WorkloadError(f"{self.source}: {name} must be callable, got {type(value).__name__}")
        if self.make_batch is None:
            if self.build_dataset is None:
                raise WorkloadError(
                    f"{self.source}: define make_batch(batch_size) -> batch, or build_dataset() "
                    f"(with collate_fn(examples) where examples need padding) to batch its largest "
                    f"examples")
            self.make_batch = LargestExamples(self.build_dataset, self.collate_fn, source=self.source)

    @property
    def model_is_instance(self) -> bool:
        return isinstance(self.model, torch.nn.Module)

    def new_model(self) -> torch.nn.Module:
        """A model to train: the instance itself, or a fresh one from the factory."""
        if self.model_is_instance:
            return self.model
        model = self.model()
        if not isinstance(model, torch.nn.Module):
            raise WorkloadError(
                f"{self.source}: build_model() must return a torch.nn.Module, got {type(model).__name__}"
            )
        return model

    def new_optimizer(self, params) -> torch.optim.Optimizer:
        params = list(params)
        if self.build_optimizer is None:
            return torch.optim.AdamW(params)
        optimizer = self.build_optimizer(params)
        if isinstance(optimizer, (list, tuple)) and all(
                isinstance(o, torch.optim.Optimizer) for o in optimizer):
            # The probe's step, the plan's LR and the loop's step, checkpoint and recovery each
            # act on one optimizer.
            names = ", ".join(type(o).__name__ for o in optimizer)
            raise WorkloadError(
                f"{self.source}: build_optimizer(params) returned {len(optimizer)} optimizers "
                f"({names}); autotune probes and trains one optimizer. Return one optimizer with "
                f"a parameter group per part instead, e.g. torch.optim.AdamW([{{'params': "
                f"decay, 'weight_decay': 0.1}}, {{'params': no_decay, 'weight_decay': 0.0, "
                f"'lr': 1e-4}}]) (each group keeps its own lr and settings); models that need two "
                f"optimizers stepped apart (GANs, Muon with AdamW) are not supported"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise WorkloadError(
                f"{self.source}: build_optimizer(params) must return a torch.optim.Optimizer, "
                f"got {type(optimizer).__name__}"
            )
        return optimizer

    def batch(self, batch_size: int, seq_len: int | None = None):
        """``make_batch(batch_size)``, checked to hold exactly ``batch_size`` samples; with a
        ``seq_len`` (or the workload's ``seq_len``) ``make_batch(batch_size, seq_len)``, checked
        to hold ``seq_len`` positions per sample."""
        seq_len = seq_len if seq_len is not None else self.seq_len
        if seq_len is None:
            batch = self.make_batch(batch_size)
        else:
            self.check_takes_seq_len()
            batch = self.make_batch(batch_size, seq_len)
        found = count_samples(batch, source=self.source)
        call = f"make_batch({batch_size}{'' if seq_len is None else f', {seq_len}'})"
        if found != batch_size:
            raise WorkloadError(
                f"{self.source}: {call} returned {found} samples; it must return "
                f"exactly batch_size samples (the first dimension of every tensor)"
            )
        if seq_len is not None:
            check_seq_len(batch, seq_len, call=call, source=self.source)
        return batch

    @functools.cached_property
    def takes_seq_len(self) -> bool:
        """Whether ``make_batch`` has the two-argument form ``make_batch(batch_size, seq_len)``
        (read once from its signature)."""
        return takes_seq_len(self.make_batch)

    def check_takes_seq_len(self) -> None:
        """Raises a ``WorkloadError`` naming the two-argument form where ``make_batch`` lacks it."""
        if self.takes_seq_len:
            return
        if isinstance(self.make_batch, LargestExamples):
            raise WorkloadError(
                f"{self.source}: the sequence length cannot be planned for a model file without "
                f"make_batch: the probe batches build_dataset()'s largest examples as they are, "
                f"and the training loop would batch the dataset's own lengths; define "
                f"make_batch(batch_size, seq_len) -> a batch of seq_len positions per sample "
                f"(e.g. packing or truncating the dataset's sequences), or plan without a "
                f"sequence length")
        raise WorkloadError(
            f"{self.source}: make_batch takes no sequence length; define the two-argument form "
            f"make_batch(batch_size, seq_len) (the second parameter named seq_len) returning "
            f"seq_len positions per sample, to probe or plan the sequence length")

    def at_seq_len(self, seq_len: int) -> "Workload":
        """This workload with every batch made at ``seq_len`` (``make_batch(n, seq_len)``)."""
        self.check_takes_seq_len()
        return dataclasses.replace(self, seq_len=seq_len)

    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor | int | None]:
        """The loss to differentiate and, for ``(loss_sum, item_count)`` losses, the item count.

        Returns ``(loss, count)``: ``count`` is None for a mean loss; for a ``(loss_sum, count)``
        loss, ``loss`` is the *sum* and callers normalise it.
        """
        if self.loss_fn is not None:
            out = self.loss_fn(model, batch)
        else:
            with user_code("the model's forward", self.source):
                out = call_model(model, batch)
            out = _loss_from_output(out, self.source)
        if isinstance(out, (tuple, list)):
            if len(out) != 2 or not isinstance(out[0], torch.Tensor):
                raise WorkloadError(
                    f"{self.source}: loss_fn must return a scalar tensor or (loss_sum, item_count), "
                    f"got a {type(out).__name__} of length {len(out)}"
                )
            loss, count = out
            _check_count(count, self.source)
        else:
            loss, count = out, None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise WorkloadError(f"{self.source}: the loss must be a scalar tensor, got {shape}")
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise WorkloadError(
                f"{self.source}: the loss{' from loss_fn' if self.loss_fn is not None else ''} does "
                f"not require grad (it was detached, computed under torch.no_grad(), or the model "
                f"has no trainable parameters); return the loss the parameters produced")
        return loss.reshape(()), count


def takes_seq_len(make_batch) -> bool:
    """``make_batch(batch_size, seq_len)``: a parameter named ``seq_len`` that can be passed
    second, by position (a default is allowed: the one-argument calls still work)."""
    if make_batch is None or isinstance(make_batch, LargestExamples):
        return False
    try:
        signature = inspect.signature(make_batch)
    except (TypeError, ValueError):  # builtins and C callables without a signature
        return False
    names = list(signature.parameters)
    parameter = signature.parameters.get("seq_len")
    return (parameter is not None and names.index("seq_len") == 1
            and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD))


def check_seq_len(batch, seq_len: int, *, call: str, source: str) -> None:
    """A batch made at ``seq_len`` holds it as the second dimension of one of its tensors at
    least (token ids, labels, position_ids); one that ignored it would make any length "fit"."""
    shapes = [tuple(t.shape) for t in _leaves(batch) if isinstance(t, torch.Tensor)]
    if not any(len(shape) >= 2 and shape[1] == seq_len for shape in shapes):
        raise WorkloadError(
            f"{source}: {call} returned tensors of shapes {shapes[:6]}, none with {seq_len} "
            f"positions as its second dimension; make_batch(batch_size, seq_len) must return "
            f"seq_len positions per sample (batch first, then the sequence)")


def check_within_seq_len(batch, seq_len: int, *, source: str) -> None:
    """A training batch of a plan made at ``seq_len`` (from ``build_dataset()``, whose lengths the
    plan did not choose) holds no sequence longer than it: a longer one would pass the peak the
    plan measured."""
    longest = max((t.shape[1] for t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 2),
                  default=0)
    if longest > seq_len:
        raise WorkloadError(
            f"{source}: a training batch holds sequences of {longest} positions, but the plan was "
            f"probed at seq_len {seq_len} (make_batch(batch_size, {seq_len})); truncate or pack "
            f"build_dataset()'s sequences to at most {seq_len} (in the dataset or collate_fn), or "
            f"plan at a --seq-len that covers them")


def _check_count(count, source: str) -> None:
    """A ``(loss_sum, item_count)`` count: a non-negative int or a one-element real tensor.
    (A tensor's sign is checked per window, where its value is read anyway.)"""
    if isinstance(count, torch.Tensor):
        if count.numel() == 1 and not count.is_complex() and count.dtype != torch.bool:
            return
        problem = f"a {count.dtype} tensor of shape {tuple(count.shape)}"
    elif isinstance(count, (int, float)) and not isinstance(count, bool):
        if math.isfinite(count) and count >= 0:
            return
        problem = f"{count}"
    else:
        problem = f"a {type(count).__name__} ({count!r:.40})"
    raise WorkloadError(
        f"{source}: loss_fn returned (loss_sum, item_count) with item_count {problem}; the count "
        f"must be a non-negative number or a one-element tensor (the tokens or samples summed)")


def call_model(model, batch):
    """Call the model the way a batch's structure suggests: tensor, *tuple or **dict."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss_from_output(out, source):
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    kind = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    raise WorkloadError(
        f"{source}: the model returned {kind}, not a scalar loss or an object with .loss; "
        f"define loss_fn(model, batch) -> scalar tensor in the model file"
    )


def count_samples(batch, *, source="<batch>") -> int:
    """The number of samples in a batch: the shared first dimension of its tensors."""
    tensors = [t for t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise WorkloadError(
            f"{source}: make_batch must return a tensor, a tuple/list or a dict of tensors "
            f"with the batch as the first dimension, got {type(batch).__name__}"
        )
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) != 1:
        raise WorkloadError(
            f"{source}: make_batch returned tensors with different first dimensions {sorted(sizes)}; "
            f"every tensor must have the batch as its first dimension"
        )
    return sizes.pop()


def _leaves(batch):
    if isinstance(batch, dict):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from _leaves(value)
    else:
        yield batch


def move_batch(batch, device):
    """The batch with every tensor moved to ``device`` (structure kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_batch(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch


def load_workload(spec, *, check_sha256: Callable[[str, str], None] | None = None) -> Workload:
    """A ``Workload`` from a path to a model file, or the ``Workload`` itself.

    ``check_sha256(source, sha256)`` is called with the file's hash before any of it runs (it
    raises to refuse the file); the bytes hashed are the bytes executed.
    """
    if isinstance(spec, Workload):
        return spec
    if isinstance(spec, (str, Path)):
        return _load_file(Path(spec), check_sha256)
    raise WorkloadError(
        f"workload must be a path to a model file or an autotune.Workload, got {type(spec).__name__}"
    )


class _EnumConstantNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


@contextlib.contextmanager
def _no_enum_constant_notes():
    """Without torch's note, on importing torchao (peft imports it), that registering an Enum as a
    pytree constant is deprecated: two log lines on every rank for every model file with peft,
    addressed to torchao's developers, not to the user."""
    logger = logging.getLogger("torch.utils._pytree")
    note = _EnumConstantNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def _load_file(path: Path, check_sha256=None) -> Workload:
    source = str(path)
    if not path.is_file():
        raise WorkloadError(f"model file {source} does not exist (or is not a file)")
    data = path.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    if check_sha256 is not None:
        check_sha256(source, sha256)
    module_name = f"autotune_user_model_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"model file {source} cannot be imported as Python (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    # The file may import helpers that sit beside it, as it would when run directly.
    with _prepended_sys_path(str(path.resolve().parent)), _no_enum_constant_notes():
        try:
            # The bytes hashed above, not a second read: the file could change in between.
            exec(compile(data, str(path), "exec"), module.__dict__)
        except Exception as exc:
            raise WorkloadError(f"model file {source} failed to import: {type(exc).__name__}: {exc}") from exc
        except SystemExit as exc:  # would end autotune silently with the file's exit code
            raise WorkloadError(f"model file {source} called sys.exit({exc.code!r}) while being "
                                f"imported; a model file must only define build_model, make_batch, "
                                f"... (guard script code with if __name__ == '__main__':)") from None
    names = vars(module)
    missing = [name for name in REQUIRED if not callable(names.get(name))]
    if not callable(names.get("make_batch")) and not callable(names.get("build_dataset")):
        missing.append("make_batch")
    if missing:
        raise WorkloadError(
            f"model file {source} must define {' and '.join(f'{m}()' for m in missing)}; "
            f"see the model-file contract in the README (build_model() -> nn.Module, "
            f"make_batch(batch_size) -> batch, or build_dataset() to batch its largest examples)"
        )
    base_lr = names.get("BASE_LR")
    base_batch = names.get("BASE_BATCH")
    if base_lr is not None and (isinstance(base_lr, bool) or not isinstance(base_lr, (int, float))
                                or not math.isfinite(base_lr) or base_lr <= 0):
        raise WorkloadError(f"model file {source}: BASE_LR must be a finite number more than 0, "
                            f"got {base_lr!r}")
    if base_batch is not None and (not isinstance(base_batch, int) or base_batch <= 0):
        raise WorkloadError(f"model file {source}: BASE_BATCH must be a positive int, got {base_batch!r}")
    return Workload(
        model=_named(names["build_model"], source),
        make_batch=_named(names["make_batch"], source) if callable(names.get("make_batch")) else None,
        **{name: _named(names.get(name), source) for name in OPTIONAL},
        base_lr=float(base_lr) if base_lr is not None else None,
        base_batch=base_batch,
        source=source,
        file_sha256=sha256,
        namespace=names,
    )


@contextlib.contextmanager
def _prepended_sys_path(entry: str):
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


# --- the user's functions raising: one line naming the function, then the user's frames -----------

_ARGUMENTS = {"build_model": "", "make_batch": "batch_size", "loss_fn": "model, batch",
              "build_optimizer": "params", "build_dataset": "", "collate_fn": "examples",
              "build_scheduler": "optimizer, plan"}


def _named(function, source: str):
    """``function`` of the model file, raising ``UserCodeError`` (naming it and the file) where it
    raises; None and non-callables are returned as they are (the contract checks them)."""
    if not callable(function):
        return function
    name = getattr(function, "__name__", "?")
    label = f"{name}({_ARGUMENTS.get(name, '...')})"

    @functools.wraps(function)
    def call(*args, **kwargs):
        with user_code(label, source):
            return function(*args, **kwargs)

    return call


@contextlib.contextmanager
def user_code(function: str, source: str):
    """Inside: the user's ``function`` of ``source`` runs; an error it raises becomes a
    ``UserCodeError`` (the original as ``__cause__``). Left untouched: out-of-memory (a trial's
    answer), autotune's own errors, torch.distributed's (a peer that failed, not this code),
    anything raised on fake tensors (the estimate decides what a fake-tensor limit is) and
    interrupts (not ``Exception``)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised untouched unless it is the user's own error
        if not _is_user_failure(exc):
            raise
        text = str(exc).strip()
        detail = text.splitlines()[0] if text else ""
        raise UserCodeError(
            f"{function} in {source} raised {type(exc).__name__}{': ' + detail if detail else ''}",
            user_traceback=user_traceback(exc)) from exc


def _is_user_failure(exc: Exception) -> bool:
    if isinstance(exc, AutotuneError) or is_oom_error(exc):
        return False
    distributed_error = getattr(torch.distributed, "DistError", None)
    if distributed_error is not None and isinstance(exc, distributed_error):
        return False
    if _raised_in_collective(exc):
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if not any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack()):
        return True
    # On fake tensors an error raised inside torch may be a fake-tensor limit (the estimate's to
    # judge); one the user's own line raised (build_model's KeyError) is the user's either way.
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and _is_user_frame(frames[-1].filename)


_DISTRIBUTED_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "distributed") + os.sep


def _raised_in_collective(exc: Exception) -> bool:
    """gloo reports a peer that died as a plain RuntimeError ("Connection closed by peer") from
    inside FSDP2's or DDP's collectives: the innermost frame is torch.distributed's, and the
    failure is the peer's, not the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_DISTRIBUTED_DIR)


_LIBRARY_DIRS = tuple(os.path.abspath(p) + os.sep for p in {
    *(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # autotune itself
    os.path.dirname(os.path.abspath(torch.__file__)),
} if p)


def _is_user_frame(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` (or of the error it was raised from, through autotune's own
    errors) with only the user's frames: the model file and code beside it, not autotune, torch,
    the standard library or installed packages. Empty when none of the frames is the user's."""
    while isinstance(exc, AutotuneError) and exc.__cause__ is not None:
        if isinstance(exc, UserCodeError) and exc.user_traceback:
            return exc.user_traceback
        exc = exc.__cause__
    if isinstance(exc, AutotuneError):
        return ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_frame(f.filename)]
    if not frames:
        return ""
    lines = ["Traceback of your code (autotune's and libraries' frames left out):\n",
             *traceback.format_list(frames), *traceback.format_exception_only(exc)]
    return "".join(lines).rstrip("\n")
