"""autotune: find the largest micro-batch that fits, plan the exact split of a target batch, and
train it with exact gradient accumulation.

Public API::

    probe(workload, *, device=None, precision="fp32", checkpointing=False,
          memory_limit=None, max_micro_batch=None, use_estimate=True) -> ProbeResult
    estimate_peak(workload, micro_batch, *, precision="fp32", checkpointing=False) -> int
                                 bytes of one step, estimated on fake tensors (EstimateUnavailable)
    plan(workload, *, target_batch, ...) -> Plan   micro-batch × accumulation × world = target
    save_plan, load_plan, export_plan              the plan file and exports for other runners
    train(plan, workload, *, steps=None, epochs=None, ...) -> TrainResult   the built-in loop
    verify_plan(plan, *, device=None, memory_limit=None, steps=3) -> VerifyResult
                                 run a plan's micro-batch here: confirmed, or re-planned
    Workload, load_workload      the model-file contract
    ProbeResult, Trial, MemoryModel, DeviceInfo, Plan, LRDecision, Precision
    is_oom_error                 what counts as out-of-memory
    AutotuneError and its subclasses
"""

from .errors import (
    AutotuneError, ConfigError, EstimateUnavailable, OutputError, PlanError, PlanFileError, ProbeError,
    WorkloadError,
)
from .planning.export import export_plan
from .memory import DeviceInfo
from .probing.estimate import estimate_peak
from .oom import is_oom_error
from .planning.types import LRDecision, Plan
from .planning.planfile import load_plan, save_plan
from .planning.api import plan
from .precision import Precision
from .probing.api import MemoryModel, ProbeResult, Trial, probe
from .training import NonFiniteError, TrainError, TrainResult, train
from .planning.verify import VerifyResult, verify_plan
from .version import __version__
from .workload import Workload, load_workload


__all__ = [
    "AutotuneError", "ConfigError", "DeviceInfo", "EstimateUnavailable", "LRDecision", "MemoryModel",
    "NonFiniteError", "OutputError",
    "Plan", "PlanError", "PlanFileError", "Precision", "ProbeError", "ProbeResult", "TrainError",
    "TrainResult", "Trial", "VerifyResult", "Workload", "WorkloadError", "__version__",
    "estimate_peak", "export_plan", "is_oom_error", "load_plan", "load_workload", "plan", "probe",
    "save_plan", "train", "verify_plan",
]
