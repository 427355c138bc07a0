"""autotune: find the largest micro-batch that fits, plan the exact split of a target batch, and
train it with exact gradient accumulation.

Public API::

    probe(workload, *, device=None, precision="fp32", checkpointing=False,
          memory_limit=None, max_micro_batch=None, use_estimate=True) -> ProbeResult
    probe_seq_len(workload, *, micro_batch=1, seq_multiple=1, ...) -> SeqLenResult
                                 the longest sequence that fits (make_batch(batch_size, seq_len))
    estimate_peak(workload, micro_batch, *, precision="fp32", checkpointing=False,
                  sharding="ddp", world_size=1, shard_group=None) -> int
                                 bytes of one step (one rank's under fsdp), estimated on fake
                                 tensors (EstimateUnavailable) (checkpointing: off/on or a bool,
                                 K blocks, or a fraction "1/3")
    estimate_cuda_peaks(workload, micro_batches, *, gpu_name="", ...) -> {n: (tensors, reserved)}
                                 the same for a CUDA device, with torch's caching allocator
                                 modelled (what max_memory_reserved() would show)
    predict_step_time(workload, micro_batches, *, precision="fp32", checkpointing=False, ...,
                      gpu=None) -> {micro_batch: StepTimePrediction}
                                 compute time of one step (roofline on the fake step's FLOPs and
                                 bytes; this CPU measured once, or a GPU profile)
    plan(workload, *, target_batch, ..., sharding="auto", shard_group=None) -> Plan
                                 micro-batch × accumulation × world = target; ddp or FSDP2 shards
                                 (or target_tokens=, seq_len=N|"auto": × seq_len = tokens)
                                 (gpu=..., optimize="throughput": ranked by predicted step time,
                                 plan.step_time a WindowTime)
    predict_window_time(workload, micro_batches, *, speed, network=None, world_size=1, ...)
                                 -> WindowTime: one optimizer step with its exposed communication
    save_plan, load_plan, export_plan              the plan file and exports for other runners
    train(plan, workload, *, steps=None, epochs=None, ...) -> TrainResult   the built-in loop
    verify_plan(plan, *, device=None, memory_limit=None, steps=3) -> VerifyResult
                                 run a plan's micro-batch here: confirmed, or re-planned
    plot_plan(plan, path), plot_metrics(paths, path), write_report(plan, path)
                                 the memory picture, training curves and an HTML page (plot extra)
    Workload, load_workload      the model-file contract
    ProbeResult, Trial, MemoryModel, DeviceInfo, Plan, LRDecision, Precision, Sharding, Checkpointing
    Layout, PipelineSchedule     a plan's tensor/context/pipeline split (plan(tp=, cp=, pp=, ...))
    is_oom_error                 what counts as out-of-memory
    AutotuneError and its subclasses

Integrations (each imports its library; ``import autotune`` imports neither)::

    autotune.integrations.transformers   training_arguments(plan, **overrides), PlanCallback(plan)
    autotune.integrations.lightning      AutotuneCallback(plan) (or planning at setup),
                                         trainer_arguments(plan)
"""

from .version import check_torch as _check_torch

_check_torch()  # an older torch: one clear ImportError naming the floor, before any import fails

from .errors import (
    AutotuneError, AutotuneWarning, ConfigError, EstimateCrashed, EstimateUnavailable, LayoutUnsupported,
    OutputError, PlanError, PlanFileError, ProbeError, ReportError, UserCodeError, WorkloadError,
)
from .memory import DeviceInfo
from .memory.oom import is_oom_error
from .orchestration.planner import plan
from .planning.export import export_plan
from .planning.planfile import load_plan, save_plan
from .planning.types import LRDecision, Plan
from .orchestration.verify import VerifyResult, verify_plan
from .precision import Precision
from .probing.api import probe
from .probing.deadline import trial_timeout
from .probing.estimate import estimate_cuda_peaks, estimate_peak
from .probing.result import MemoryModel, ProbeResult, Trial
from .probing.seq_len import SeqLenResult, probe_seq_len
from .report import plot_metrics, plot_plan, write_report
from .report.notebook import register_display as _register_display
from .distributed.layout import Layout, PipelineSchedule
from .distributed.sharding import Sharding
from .timing.predict import StepTimePrediction, predict_step_time
from .timing.window import WindowTime, predict_window_time
from .training import NonFiniteError, TrainError, TrainResult, train
from .version import __version__
from .workload import Workload, load_workload
from .workload.checkpoint_count import Checkpointing

__all__ = [
    "AutotuneError", "AutotuneWarning", "Checkpointing", "ConfigError", "DeviceInfo",
    "EstimateCrashed", "EstimateUnavailable", "LRDecision", "Layout", "LayoutUnsupported", "MemoryModel", "PipelineSchedule",
    "NonFiniteError", "OutputError", "Plan", "PlanError", "PlanFileError", "Precision", "ProbeError",
    "ProbeResult", "ReportError", "Sharding", "StepTimePrediction", "TrainError", "TrainResult",
    "Trial", "UserCodeError",
    "VerifyResult", "WindowTime", "Workload", "WorkloadError", "__version__", "estimate_cuda_peaks",
    "estimate_peak", "export_plan",
    "is_oom_error", "load_plan", "load_workload", "plan", "plot_metrics", "plot_plan",
    "predict_step_time", "predict_window_time", "probe", "probe_seq_len", "SeqLenResult", "save_plan", "train",
    "trial_timeout", "verify_plan", "write_report",
]

_register_display()  # Plan, ProbeResult and TrainResult show as HTML in Jupyter
