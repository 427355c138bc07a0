"""The training loop's own errors (``TrainError``, their base, is in the shared hierarchy)."""

from ..errors import TrainError


class NonFiniteError(TrainError):
    """A window's loss or gradient norm is NaN or infinite (outside fp16's skipped steps): training
    stops before that step changes the weights, so the last checkpoint stays good."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class OOMRestart(TrainError):
    """This rank ran out of memory where the ranks cannot agree in-process (inside FSDP2's
    collectives, or inside DDP's gradient all-reduce in a window's last backward). The smaller
    micro-batch is recorded in the checkpoint folder and the rank exits; torchrun's restart
    (``--max-restarts``) relaunches every rank, and they resume from the last checkpoint with it."""
