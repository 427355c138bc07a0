"""One exception hierarchy for everything autotune reports to a user.

The CLI maps ``AutotuneError`` to exit code 1 and prints only the message, so every message
names the option or file involved, the values seen and the fix: in the words of the caller
(``option``/``given``): ``--target-batch 130`` from the command line, ``target_batch=130`` from
Python.
"""

import contextlib
import contextvars

_CLI_WORDS = contextvars.ContextVar("autotune_cli_words", default=False)


@contextlib.contextmanager
def cli_words():
    """Inside: messages name options as the command line spells them (the CLI's commands)."""
    token = _CLI_WORDS.set(True)
    try:
        yield
    finally:
        _CLI_WORDS.reset(token)


def option(name: str) -> str:
    """``name`` (a keyword argument, e.g. "target_batch") as the caller wrote it: "--target-batch"
    on the command line, "target_batch" from Python."""
    if name.startswith("--"):
        return name
    return "--" + name.replace("_", "-") if _CLI_WORDS.get() else name


def given(name: str, value) -> str:
    """An option and its value as the caller wrote them: "--target-batch 130" or "target_batch=130"
    (a string quoted in both: "--precision 'fp8'"). A name already spelled "--name" is kept."""
    if name.startswith("--") or _CLI_WORDS.get():
        return f"{option(name)} {value!r}"
    return f"{option(name)}={value!r}"


def flag(name: str) -> str:
    """A switch turned on, as the caller wrote it: "--resume" on the command line, "resume=True"
    from Python."""
    return option(name) if _CLI_WORDS.get() else f"{name}=True"


class AutotuneError(Exception):
    """Base class of every error autotune raises on purpose."""


class WorkloadError(AutotuneError):
    """The model file or workload objects do not meet the contract."""


class StepError(WorkloadError):
    """A training step of the workload failed with an error that is not out-of-memory (a bug in
    the model file, or a setting the model does not support). The message names the setting, the
    micro-batch and the model file; the original exception is chained as ``__cause__``."""


class UserCodeError(WorkloadError):
    """A function of the model file (``build_model``, ``make_batch``, ``loss_fn``, the model's
    forward, ...) raised. The message is one line naming the function and the file;
    ``user_traceback`` holds the traceback's frames of the user's own code (not autotune's or
    torch's), which the CLI prints under it; the original exception is the ``__cause__``."""

    def __init__(self, message: str, *, user_traceback: str = ""):
        super().__init__(message)
        self.user_traceback = user_traceback


class LayoutUnsupported(WorkloadError):
    """The model cannot be split along one degree of a model-parallel layout, whatever its value
    (a pipeline over weights tied across the blocks' two ends, or over blocks it cannot find;
    context parallelism over a batch without a sequence dimension, or a loss that is a mean;
    tensor parallelism over peft's adapter layers): ``degree`` ("tp", "cp", "pp") names it. A layout search that chose the degree itself (auto) answers
    every candidate with it above 1 alike, and plans the others."""

    def __init__(self, message: str, *, degree: str):
        super().__init__(message)
        self.degree = degree


class ProbeError(AutotuneError):
    """The probe could not find a micro-batch that fits (or was asked something impossible)."""


class PlanError(AutotuneError):
    """The request cannot be planned (indivisible target, pinned micro-batch too large, ...)."""


class PlanFileError(AutotuneError):
    """A plan file is missing, corrupt, of an unknown schema version or for another workload."""


class ConfigError(AutotuneError):
    """An option value is invalid (memory limits, precisions, device names, ...)."""


class EstimateUnavailable(AutotuneError):
    """The model cannot run under fake tensors (data-dependent shapes, custom kernels, reading
    tensor values in Python): its memory can only be measured with real trials."""


class EstimateCrashed(AutotuneError):
    """The child process that ran the fake-tensor estimate of a compiled model died (a signal, or
    an exit without an answer): the planning process itself is unharmed."""


class AutotuneWarning(UserWarning):
    """Something the user should know that stops nothing (the CLI prints it on one line)."""


class ReportError(AutotuneError):
    """A plot or report cannot be made (matplotlib missing, an unreadable metrics file)."""


class OutputError(AutotuneError, OSError):
    """An output path cannot or must not be written (a missing or read-only folder, a symlink, a
    folder, one of the command's own inputs, a full disk). An ``OSError`` too, so code that
    caught the file system's own error still catches it."""


class TrainError(AutotuneError):
    """Training cannot start or continue (resume mismatch, out of memory at micro-batch 1, ...)."""
