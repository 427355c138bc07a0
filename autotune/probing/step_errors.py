"""A trial's step that fails with an error that is not out-of-memory, told as a ``StepError``.

The probe, the estimate, ``verify`` and the throughput search run the user's step at settings the
user never tried (bf16, K of N checkpointed blocks, FSDP2). Where such a step raises (a bug in the
model file, or a setting the model does not support), the user needs the setting, the micro-batch
and the model file in one message, not a traceback from deep inside torch; the original exception
stays chained as ``__cause__`` for Python callers.
"""

from __future__ import annotations

from ..errors import AutotuneError, StepError, UserCodeError
from ..memory.fake import failure_site, is_fake_tensor_limit
from ..memory.oom import is_oom_error
from .result import setting_label


def is_step_failure(exc: BaseException) -> bool:
    """Whether ``exc`` from a trial is the model's own failure: not out-of-memory (a trial's
    answer), not autotune's own error (already a message) other than a function of the model file
    that raised (``UserCodeError``, which does not know the setting), not a fake-tensor limit (the
    estimate falls back to real trials), not an interrupt."""
    if isinstance(exc, UserCodeError):
        return True
    return (isinstance(exc, Exception) and not isinstance(exc, AutotuneError)
            and not is_oom_error(exc) and not is_fake_tensor_limit(exc))


def original(exc: BaseException) -> BaseException:
    """What to chain the StepError to: the user's own exception, not the UserCodeError around it."""
    return exc.__cause__ if isinstance(exc, UserCodeError) and exc.__cause__ is not None else exc


def step_failed(session, exc: BaseException, micro_batch: int | None) -> StepError:
    """The StepError for ``exc`` raised in ``session`` (a TrialSession) at ``micro_batch`` (None:
    while setting the step up); raise it ``from original(exc)``."""
    source = session.workload.source
    setting = setting_label(session.precision.value, session.checkpointing_label)
    if session.sharded:
        setting += ", sharded with " + ("fsdp-offload" if session.offload else "FSDP2")
    when = f"at micro-batch {micro_batch}" if micro_batch is not None else "while setting it up"
    options = ["--precision", "--checkpointing", "--sharding"]
    layout = getattr(session, "parallel", None)
    if layout is not None and not layout.trivial:
        # The model-parallel split is the likeliest cause in a step that runs without it (a
        # derived tensor-parallel plan that does not match the model's layers, a "sequence" that
        # is a feature dimension): name it first.
        setting += ", " + layout.describe_degrees()
        options = [f"--{name} {getattr(layout, name)}" for name in ("tp", "cp", "pp")
                   if getattr(layout, name) > 1] + options
    if isinstance(exc, UserCodeError):
        what = str(exc)  # already names the function, the file and the error
    else:
        text = str(exc).strip()
        what = f"{type(exc).__name__}{': ' + text.splitlines()[0].rstrip('.') if text else ''}"
    return StepError(
        f"{source}: the training step failed {when} ({setting})"
        f"{failure_site(original(exc), source)}: {what}. This is not out-of-memory but an "
        f"error in the model's step at this setting: fix the model file, or plan without the "
        f"setting ({', '.join(options)}). From Python, the original exception "
        f"is this error's __cause__."
    )


__all__ = ["is_step_failure", "original", "step_failed"]
