"""autotune: find the largest micro-batch that fits, plan the exact split of a target batch, and
train it with exact gradient accumulation.

Public API::

    probe(workload, *, device=None, precision="fp32", checkpointing=False,
          memory_limit=None, max_micro_batch=None) -> ProbeResult
    Workload, load_workload      the model-file contract
    ProbeResult, Trial, MemoryModel, DeviceInfo
    is_oom_error                 what counts as out-of-memory
    AutotuneError and subclasses
    estimate_peak(workload, micro_batch, *, precision="fp32", checkpointing=False) -> int
                                 bytes of one step, estimated on fake tensors (EstimateUnavailable)
    plan(workload, *, target_batch, ...) -> Plan   micro-batch × accumulation × world = target
    Plan, save_plan, load_plan, export_plan        the plan file and exports for other runners
    train(plan, workload, *, steps=None, epochs=None, ...) -> TrainResult   the built-in loop
    verify_plan(plan, *, device=None, memory_limit=None, steps=3) -> VerifyResult
                                 run a plan's micro-batch here: confirmed, or re-planned
"""

from .errors import AutotuneError, ConfigError, PlanError, PlanFileError, ProbeError, WorkloadError
from .memory import DeviceInfo
from .oom import is_oom_error
from .precision import Precision
from .probe import MemoryModel, ProbeResult, Trial, probe
from .workload import Workload, load_workload
from .plan import LRDecision, Plan
from .planfile import load_plan, save_plan
from .planning import plan
from .export import export_plan
from .errors import EstimateUnavailable
from .memory.estimate import estimate_peak
from .train import TrainError, TrainResult, train
from .verify import VerifyResult, verify_plan

__version__ = "0.1.0"

__all__ = [
    "AutotuneError", "ConfigError", "DeviceInfo", "MemoryModel", "PlanError", "PlanFileError",
    "Precision", "ProbeError", "ProbeResult", "Trial", "Workload", "WorkloadError", "__version__",
    "is_oom_error", "load_workload", "probe",
    "LRDecision", "Plan", "export_plan", "load_plan", "plan", "save_plan",
    "TrainError", "TrainResult", "train", "VerifyResult", "verify_plan",
]
