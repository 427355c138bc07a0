"""bench/gpu_proof.py on the CPU: --list, the one-line no-CUDA exit, and every check's code path
run once with the CUDA adapter faked (tiny sizes), so the first real GPU run does not die of a
typo. What cannot run here (NCCL under torchrun, `pytest -m gpu` on a GPU) runs against a faked
``run_command`` whose plan files are real ones."""

import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import autotune

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_proof.py"
MiB = 1 << 20


def _load():
    spec = importlib.util.spec_from_file_location("gpu_proof", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_proof"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_proof = _load()


def _script(*args, env=None):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=environment, cwd=ROOT, timeout=120)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class CPUDevice:
    """The device adapter on the CPU. Memory is what autograd keeps for backward (saved-tensor
    hooks count each saved tensor until its graph is freed), and under ``capped`` a step that
    would pass the cap raises torch.OutOfMemoryError mid-forward, as the caching allocator does.
    Not the CUDA numbers, only their code paths."""

    torch_device = "cpu"

    def __init__(self, count=1):
        self._count = count
        self.live = self.peak = self.ooms = self.session = 0
        self.cap = None
        self.capped_with = []

    def available(self):
        return True

    def count(self):
        return self._count

    def describe(self):
        return {"name": "CPU fake", "total_bytes": 1 << 30, "count": self._count, "bf16": True,
                "cuda": None, "capability": None}

    def total_bytes(self):
        return 1 << 30

    def supports(self, precision):
        return True

    @contextlib.contextmanager
    def capped(self, limit):
        # Each capped session counts from zero: tensors a failed step left alive (torch can keep
        # a failed backward's for good) belong to the session before.
        self.cap, self.live, self.peak = limit, 0, 0
        self.session += 1
        self.capped_with.append(limit)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda box: box.tensor):
                yield
        finally:
            self.cap = None

    def _pack(self, tensor):
        size = tensor.numel() * tensor.element_size()
        if self.cap is not None and self.live + size > self.cap:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"fake: {self.live + size} bytes past the {self.cap}-byte cap")
        box = _Saved(tensor)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self._free, size, self.session)
        return box

    def _free(self, size, session):
        if session == self.session:
            self.live -= size

    def release(self):
        gc.collect()

    def reset_peaks(self):
        self.peak = self.live

    def peaks(self):
        return self.peak, self.peak

    def oom_count(self):
        return self.ooms

    def synchronize(self):
        pass


def _tiny_config(**changes):
    g = gpu_proof
    cell = g.Cell("gpt_varlen", "fp32", "on", 2 * MiB)
    config = g.Config(
        cards=[2 * MiB], probe_cells=[cell], estimate_cells=[cell],
        train_cases=[g.TrainCase(g.Cell("gpt_varlen", "fp32", "off", 2 * MiB), 1.5)],
        verify_cases=[g.VerifyCase("gpt_varlen", "t4", 16 << 30, 8)],
        overhead={"workload": "gpt_varlen", "precision": "fp32", "micro_batch": 4, "accumulation": 2,
                  "steps": 4, "rounds": 1, "warmup": 1},
        multi={"workload": "gpt_varlen", "precision": "fp32", "target_batch": 8, "card": 8 * MiB,
               "steps": 2, "shardings": ("ddp",)},
        train_steps=3, budget_seconds=300, pytest_args=("-m", "gpu", "tests/test_gpu.py"),
        reserved_cases=[g.TimeCase("tiny_lm", "bf16", sizes=(2, 4))],
        time_cases=[g.TimeCase("tiny_lm", "bf16", sizes=(2, 4)), g.TimeCase("gpt_varlen", "fp32", cell=cell)],
        time_profile="h100-80gb", time_warmup=1, time_repeats=2)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_list_prints_every_check_without_cuda():
    done = _script("--list", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    for check in ("probe_exact", "estimate", "train_200", "loop_overhead", "verify_profile",
                  "multi_gpu", "pytest_gpu"):
        assert f"  {check} " in done.stdout
    assert "default subset" in done.stdout and "16 GiB" in done.stdout


def test_without_cuda_one_line_and_exit_2(tmp_path):
    done = _script("--out", str(tmp_path / "out"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert done.stdout.count("\n") == 1 and "no CUDA device" in done.stdout
    assert not (tmp_path / "out").exists()  # nothing written where nothing was measured


def test_usage_errors_exit_2(capsys):
    assert gpu_proof.main(["--cards", "16XB", "--list"]) == 2
    assert gpu_proof.main(["--checks", "probe_exact,nope", "--list"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_full_matrix_covers_every_example_precision_and_checkpointing():
    config = gpu_proof.default_config([16 << 30, 24 << 30, 40 << 30], full=True)
    workloads = {c.workload for c in config.probe_cells}
    assert workloads == {p.stem for p in (ROOT / "examples").glob("*.py")} | {"gpt2"}
    assert len(config.probe_cells) == len(workloads) * 3 * 2 * 3
    subset = gpu_proof.default_config([16 << 30, 24 << 30, 40 << 30])
    assert {(c.precision, c.checkpointing) for c in subset.probe_cells} == {
        (p, c) for p in ("fp32", "bf16", "fp16") for c in ("off", "on")}


def _fake_commands(tmp_path):
    """run_command for what needs a GPU: the multi-GPU plan (a real plan file, made here on the
    CPU), torchrun (metrics lines) and pytest (its summary line); anything else runs for real."""
    made = autotune.plan(str(ROOT / "examples" / "gpt_varlen.py"), target_batch=8, world_size=2,
                         device="cpu", memory_limit=8 * MiB, precision="fp32", checkpointing="off",
                         sharding="ddp")
    seen = []
    real = gpu_proof.run_command

    def run(argv, *, timeout, cwd=ROOT):
        seen.append(argv)
        if "pytest" in argv:
            return gpu_proof.Completed(0, "......\n6 passed in 9.81s\n", 9.8)
        if "torch.distributed.run" in argv:
            metrics = Path(argv[argv.index("--metrics") + 1])
            steps = int(argv[argv.index("--steps") + 1])
            peak = made.predicted_peak_bytes
            metrics.write_text("".join(
                json.dumps({"step": s + 1, "peak_memory_bytes": peak, "reserved_peak_bytes": peak,
                            "oom_recoveries": 0}) + "\n" for s in range(steps)))
            return gpu_proof.Completed(0, "", 1.0)
        if "plan" in argv and "--world-size" in argv:
            autotune.save_plan(made, argv[argv.index("-o") + 1])
            return gpu_proof.Completed(0, "", 1.0)
        return real(argv, timeout=timeout, cwd=cwd)

    return run, seen


@pytest.mark.slow  # every check end to end: about 40 s alone, 90 s on a loaded machine
def test_every_check_runs_on_the_cpu_with_cuda_faked(tmp_path, monkeypatch, capsys, one_thread):
    run, seen = _fake_commands(tmp_path)
    monkeypatch.setattr(gpu_proof, "run_command", run)
    device = CPUDevice(count=2)
    out = tmp_path / "out"
    # The tiny configuration's 300 s budget cut a check short on a machine slowed by a debugging
    # allocator and other work; what this asserts is that every check runs, not how fast.
    code = gpu_proof.main(["--out", str(out)], device=device, config=_tiny_config(budget_seconds=3600))
    lines = capsys.readouterr().out.splitlines()
    report = json.loads((out / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == [c.name for c in gpu_proof.CHECKS]
    errors = {n: c for n, c in checks.items() if c["status"] == "error"
              or any(r.get("status") == "error" for r in c["rows"])}
    assert not errors, json.dumps(errors, indent=1, default=str)[:3000]
    # Every check reached its verdict through its own code; on the fake meter the probe and the
    # reference disagree (they count different bytes), so no verdict is asserted but these:
    probe_row = checks["probe_exact"]["rows"][0]
    assert probe_row["found"] >= 1 and probe_row["exact"] >= 1 and probe_row["exact_ooms"] >= 1
    assert checks["estimate"]["status"] == "pass"  # the CPU backend's trials: the estimate is exact
    train_row = checks["train_200"]["rows"][0]
    assert train_row["steps"] == 3 and train_row["split"].endswith("x 2") and train_row["ooms"] == 0
    assert device.capped_with.count(2 * MiB) >= 2  # the bisection and the training run, capped
    assert checks["loop_overhead"]["rows"][-1]["ratio"] > 0
    # Both kinds of allocator-model row ran (the fake's "reserved" is its saved-tensor meter, so
    # no verdict): the probe trials' and the reference steps' at both checkpointing settings.
    reserved_rows = checks["reserved"]["rows"]
    assert any(r["case"].startswith("gpt_varlen") for r in reserved_rows)
    assert {r["ckpt"] for r in reserved_rows if r["case"] == "tiny_lm bf16"} == {"off", "on"}
    timed = [r for r in checks["step_time"]["rows"] if "measured_ms" in r]
    assert len(timed) >= 4 and all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in timed)
    assert checks["verify_profile"]["status"] == "pass", checks["verify_profile"]
    assert checks["multi_gpu"]["status"] == "pass", checks["multi_gpu"]
    assert checks["pytest_gpu"]["status"] == "pass" and checks["pytest_gpu"]["rows"][0]["passed"] == 6
    assert any("torch.distributed.run" in argv for argv in seen)
    assert code == report["exit_code"] == gpu_proof.exit_code(report["checks"])
    # A row per check as it finished (after that check's cases), and the Markdown report.
    rows = [line.split()[0] for line in lines if line and not line.startswith(" ")]
    assert [r for r in rows if r in checks] == list(checks)
    markdown = (out / "report.md").read_text()
    assert "| check | status | seconds | result |" in markdown and "### probe_exact" in markdown


def test_one_gpu_skips_multi_gpu_and_the_run_can_still_pass(tmp_path, monkeypatch):
    outcome = gpu_proof.check_multi_gpu(gpu_proof.Context(CPUDevice(count=1), _tiny_config(),
                                                          gpu_proof.Report(tmp_path, {})))
    assert outcome.status == "skip" and "need 2" in outcome.summary
    assert gpu_proof.exit_code([{"status": "pass"}, {"status": "skip"}]) == 0
    assert gpu_proof.exit_code([{"status": "pass"}, {"status": "cut"}]) == 1
    assert gpu_proof.exit_code([]) == 1


def test_exhaustive_bisection_with_fp16_and_checkpointed_blocks(one_thread):
    workload = autotune.load_workload(str(ROOT / "examples" / "tiny_lm.py"))
    device = CPUDevice()
    step = gpu_proof.ReferenceStep(workload, "cpu", "fp16", checkpointing=True)
    wrapped = [b for b in step.model.blocks if b.forward.__name__ == "run"]
    assert len(wrapped) == len(step.model.blocks)  # every block of the ModuleList checkpointed
    found = gpu_proof.exhaustive_max(step, device, 3 * MiB)
    assert found["exact"] >= 1 and found["ooms"] >= 1 and not found["capped_at_limit"]
    # The answer fits; twice it does not (the fake meter may keep a failed step's saved tensors,
    # as torch sometimes does, so exactness at + 1 is the GPU's to show).
    with device.capped(3 * MiB):
        step(found["exact"])
    with device.capped(3 * MiB), pytest.raises(torch.OutOfMemoryError):
        step(2 * found["exact"] + 2)


def test_a_crashing_check_is_an_error_row_and_the_others_still_run(tmp_path, monkeypatch):
    def boom(ctx):
        raise RuntimeError("typo")

    monkeypatch.setattr(gpu_proof, "CHECKS", [
        gpu_proof.Check("first", "crashes", 1.0, boom),
        gpu_proof.Check("second", "holds", 1.0, lambda ctx: gpu_proof.Outcome("pass", "ok"))])
    code = gpu_proof.main(["--out", str(tmp_path), "--checks", "first,second"], device=CPUDevice(),
                          config=_tiny_config())
    report = json.loads((tmp_path / "report.json").read_text())
    assert [c["status"] for c in report["checks"]] == ["error", "pass"] and code == 1
    assert "RuntimeError: typo" in report["checks"][0]["summary"]


def test_a_signal_stops_the_run_and_keeps_the_report(tmp_path, monkeypatch):
    def first(ctx):
        ctx.add_row({"case": "a", "status": "pass"})
        raise gpu_proof.Stopped("SIGTERM")

    monkeypatch.setattr(gpu_proof, "CHECKS", [gpu_proof.Check("first", "stopped", 1.0, first),
                                              gpu_proof.Check("second", "never", 1.0, None)])
    code = gpu_proof.main(["--out", str(tmp_path), "--checks", "first,second"], device=CPUDevice(),
                          config=_tiny_config())
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and [c["status"] for c in report["checks"]] == ["cut"]
    assert report["checks"][0]["rows"] == [{"case": "a", "status": "pass"}]


def test_a_spent_budget_cuts_the_remaining_checks(tmp_path, monkeypatch):
    code = gpu_proof.main(["--out", str(tmp_path), "--checks", "probe_exact,estimate"],
                          device=CPUDevice(), config=_tiny_config(budget_seconds=1e-9))
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and {c["status"] for c in report["checks"]} == {"cut"}


def test_spearman_and_the_profile_named_like_the_device():
    assert gpu_proof.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert gpu_proof.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    # Ties take their average rank: ranks (0, 1.5, 1.5, 3) against (0, 1, 2, 3).
    assert gpu_proof.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / 22.5 ** 0.5)
    profile = gpu_proof.profile_for
    assert profile({"name": "NVIDIA H200", "total_bytes": 140 << 30}) == "h200-141gb"
    assert profile({"name": "NVIDIA H100 80GB HBM3", "total_bytes": 79 << 30}) == "h100-80gb"
    assert profile({"name": "NVIDIA A100-SXM4-80GB", "total_bytes": 79 << 30}) == "a100-80gb"
    assert profile({"name": "NVIDIA A100-PCIE-40GB", "total_bytes": 39 << 30}) == "a100-40gb"
    assert profile({"name": "Tesla T4", "total_bytes": 15 << 30}) == "t4"
    assert profile({"name": "CPU fake", "total_bytes": 1 << 30}) is None
    for name in {p for _, p in gpu_proof.PROFILE_BY_NAME if p} | {"a100-80gb", "a100-40gb",
                                                                   "v100-32gb", "v100-16gb"}:
        assert (ROOT / "profiles" / f"{name}.toml").is_file(), name


def test_step_time_rows_and_the_ranking_on_the_cpu_fake(tmp_path, one_thread):
    # fp32: bf16 on a CPU without bf16 units runs tiny_lm's steps about 20x slower (14 s here).
    config = _tiny_config(time_cases=[gpu_proof.TimeCase("tiny_lm", "fp32", sizes=(1, 4))])
    report = gpu_proof.Report(tmp_path, {})
    report.current = "step_time"
    ctx = gpu_proof.Context(CPUDevice(), config, report, log=lambda *a, **k: None)
    outcome = gpu_proof.check_step_time(ctx)
    timed = [r for r in outcome.rows if "measured_ms" in r]
    assert [(r["case"], r["micro_batch"]) for r in timed] == [
        ("tiny_lm fp32 ckpt off", 1), ("tiny_lm fp32 ckpt off", 4),
        ("tiny_lm fp32 ckpt on", 1), ("tiny_lm fp32 ckpt on", 4)]
    assert outcome.rows[-1]["settings"] == 4 and "Spearman" in outcome.summary
    # The measurements are cached: the reserved check's reference steps are not run again.
    assert set(ctx._measured) == {("tiny_lm", "fp32", c, n) for c in (False, True) for n in (1, 4)}
    unknown = gpu_proof.check_step_time(gpu_proof.Context(
        CPUDevice(), _tiny_config(time_profile=None), gpu_proof.Report(tmp_path, {})))
    assert unknown.status == "skip" and "no bundled GPU profile" in unknown.summary
