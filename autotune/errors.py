"""One exception hierarchy for everything autotune reports to a user.

The CLI maps ``AutotuneError`` to exit code 1 and prints only the message, so every message
names the option or file involved, the values seen and the fix.
"""


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


class ReportError(AutotuneError):
    """A plot or report cannot be made (matplotlib missing, an unreadable metrics file)."""


class OutputError(AutotuneError, OSError):
    """An output path cannot or must not be written (a missing or read-only folder, a symlink, a
    folder, one of the command's own inputs, a full disk). An ``OSError`` too, so code that
    caught the file system's own error still catches it."""


class TrainError(AutotuneError):
    """Training cannot start or continue (resume mismatch, out of memory at micro-batch 1, ...)."""
