"""Hand-built probe results and plans for the planner, plan-file, export and CLI tests."""

from autotune.memory.base import DeviceInfo
from autotune.planning.types import SettingTried, WorkloadFingerprint
from autotune.planning.policy import PlanRequest, build_plan, evaluate_setting, usable_bytes
from autotune.probing.result import MemoryModel, ProbeResult, Trial

MiB = 1 << 20


def device(budget=1000 * MiB, kind="cpu", name="test device"):
    return DeviceInfo(kind=kind, name=name, total_bytes=4 * budget, free_bytes=2 * budget,
                      budget_bytes=budget, budget_source="test")


def linear_probe(max_micro_batch, *, base=100 * MiB, per_sample=10 * MiB, budget=1000 * MiB,
                 precision="fp32", checkpointing=False, upper=None):
    """A probe of a workload whose peak is base + per_sample·n, with trials at 1 and the max."""
    def trial(n, fits=True):
        return Trial(micro_batch=n, fits=fits, peak_bytes=base + per_sample * n, seconds=0.01,
                     activation_peak_bytes=base + per_sample * n, step_peak_bytes=base,
                     baseline_bytes=base)

    trials = [trial(1), trial(max_micro_batch)]
    if upper is None or max_micro_batch < upper:
        trials.append(trial(max_micro_batch + 1, fits=False))
    return ProbeResult(
        max_micro_batch=max_micro_batch, upper_bound=upper,
        capped=upper is not None and max_micro_batch == upper, trials=trials,
        memory_model=MemoryModel(activation=(float(base), float(per_sample), 0.0),
                                 step=(float(base), 0.0), points=2),
        device=device(budget), precision=precision, checkpointing=checkpointing, seconds=0.1,
        oom_count=sum(not t.fits for t in trials))


def fingerprint(**overrides):
    values = dict(source="model.py", file_sha256="ab" * 32, param_count=1000, param_bytes=4000,
                  optimizer="AdamW", optimizer_lr=1e-3, batchnorm=False, checkpointable=True)
    values.update(overrides)
    return WorkloadFingerprint(**values)


def setting(probe=None, *, precision="fp32", checkpointing=False, headroom=0.1, extra=0, error=None):
    tried = SettingTried(precision=precision, checkpointing=checkpointing, probe=probe,
                         error=error if probe is None else None)
    budget = probe.budget_bytes if probe is not None else 1000 * MiB
    return evaluate_setting(tried, usable=usable_bytes(budget, headroom), extra_bytes=extra)


def make_plan(target=128, max_micro=50, *, world_size=1, workload=None, **request):
    """A plan from one fp32 setting whose probe found ``max_micro`` (headroom 0: allowed = max)."""
    request.setdefault("headroom", 0.0)
    req = PlanRequest(target_batch=target, world_size=world_size, checkpointing="off", **request)
    probe = linear_probe(max_micro)
    tried = setting(probe, headroom=req.headroom)
    return build_plan(req, workload=workload or fingerprint(), settings=[tried], device=device(),
                      versions={"autotune": "0.1.0", "torch": "2.x", "cuda": None},
                      created_at="2025-01-01T00:00:00+00:00")
