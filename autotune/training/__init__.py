"""The built-in training loop: run a plan with exact accumulation, on one device or under torchrun.

Modules, one job each: ``data`` (which samples each window, rank and micro-batch gets), ``loop`` (one optimizer step, OOM recovery), ``checkpoint``
(atomic save/resume), ``distributed`` (process group and collectives), ``metrics``, ``schedule``
(LR and warmup), ``recovery`` (the OOM split policy), ``restart`` (an OOM the ranks cannot agree
on in-process, recovered by torchrun's restart), ``stop`` (signals), ``checks`` (errors before
training), ``api`` (``train``). Exact loss weighting is ``autotune.accumulation``, which the
probe's trials share (their step holds the loop's scalars).
"""

from .api import TrainResult, save_model, train
from .errors import NonFiniteError, OOMRestart, TrainError

__all__ = ["NonFiniteError", "OOMRestart", "TrainError", "TrainResult", "save_model", "train"]
