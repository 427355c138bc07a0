"""torch.compile (issue 20): the compiled step is probed, planned and trained; the fake-tensor
estimate runs the eager module (in a child process for --compile model files) and never takes
the process down.

Fast tests use torch.compile's "eager" and "aot_eager" backends (compiling with inductor takes
minutes on two loaded cores); the inductor test is slow.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.compiled import compile_backend, eager_module, graphs_compiled, is_compiled
from autotune.errors import ConfigError
from autotune.memory.cpu import CPUMemoryBackend
from autotune.planning.planfile import plan_from_json, plan_to_json, plan_schema
from autotune.precision import Precision
from autotune.probing.api import probe
from autotune.probing.estimate import estimate_peak
from autotune.probing.trial import TrialSession
from autotune.workload.contract import load_workload

from plan_helpers import make_plan

MODEL = str(Path(__file__).resolve().parent / "compile_model.py")
ROOT = Path(__file__).resolve().parent.parent
BUDGET = "16MiB"

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          timeout=600)


def test_a_crash_in_the_estimates_child_process_is_a_message_and_exit_1(monkeypatch):
    # The model file kills whatever process builds it on fake tensors with SIGSEGV, as tracing a
    # compiled graph on fake tensors did: with --compile that is the estimate's child process.
    monkeypatch.setenv("CRASH_ON_FAKE", "1")
    result = CliRunner().invoke(cli, ["probe", MODEL, "--memory-limit", BUDGET,
                                      "--compile-backend", "eager", "-q"])
    assert result.exit_code == 1, result.output
    assert "child process, which was killed by SIGSEGV (this process is unharmed)" in result.output
    assert "What would help" in result.output and "Traceback" not in result.output


def test_a_compiled_build_model_is_estimated_as_its_eager_module(monkeypatch):
    # Before: the estimate traced the compiled graph on fake tensors (a segfault with inductor).
    # Now torch.compile is off on fake tensors and the eager module is counted: the same bytes.
    eager = estimate_peak(MODEL, 8)
    monkeypatch.setenv("COMPILED", "aot_eager")
    assert is_compiled(load_workload(MODEL).new_model())
    assert estimate_peak(MODEL, 8) == eager


def test_compile_settings():
    assert compile_backend(True) == "inductor" and compile_backend("aot_eager") == "aot_eager"
    assert compile_backend(False) is None and compile_backend(None) is None
    with pytest.raises(ConfigError, match="compile='fast' is not a torch.compile backend"):
        compile_backend("fast")
    module = torch.nn.Linear(2, 2)
    assert eager_module(torch.compile(module, backend="eager")) is module
    assert eager_module(module) is module


def test_plans_record_compile_and_older_files_read_as_eager():
    plan = dataclasses.replace(make_plan(), compile=True, compile_backend="aot_eager")
    data = json.loads(plan_to_json(plan))
    assert data["compile"] is True and data["compile_backend"] == "aot_eager"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, plan_schema(), cls=jsonschema.Draft202012Validator)
    assert plan_from_json(plan_to_json(plan)).compile_backend == "aot_eager"
    del data["compile"], data["compile_backend"]  # a file written before compile was planned
    old = plan_from_json(json.dumps(data))
    assert old.compile is False and old.compile_backend is None


def test_a_compiled_plan_exports_trainer_arguments_that_compile():
    from autotune.planning.export import to_hf

    plan = dataclasses.replace(make_plan(), compile=True, compile_backend="aot_eager")
    config = to_hf(plan).config
    assert config["torch_compile"] is True and config["torch_compile_backend"] == "aot_eager"
    assert "torch_compile" not in to_hf(make_plan()).config
    transformers = pytest.importorskip("transformers")
    arguments = transformers.TrainingArguments(output_dir="unused", **config)
    assert arguments.torch_compile and arguments.torch_compile_backend == "aot_eager"


def _largest_fitting_compiled_step(workload, budget: str) -> tuple[int, int]:
    """The largest micro-batch whose compiled real step fits, by plain bisection over steps of
    one session (doubling up to the first failure, then halving the bracket); and the graphs
    compiled on the way."""
    session = TrialSession(workload, CPUMemoryBackend(budget), precision=Precision.FP32)
    with session:
        fits = {}

        def fit(n):
            fits[n] = session.run(n).fits
            return fits[n]

        low, high = 0, 1
        while fit(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fit(middle) else (low, middle)
    assert session.compiled
    return low, session.graphs_compiled


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_probe_equals_bisection_over_compiled_steps_without_recompiling(backend):
    result = probe(MODEL, memory_limit=BUDGET, compile=backend)
    assert result.compiled and result.compile_backend == backend
    # Dynamic batch sizes: one graph for every micro-batch (two where micro-batch 1 is tried:
    # torch specialises size 1), however many trials ran.
    assert result.graphs_compiled <= 2, result.trials
    expected, graphs = _largest_fitting_compiled_step(
        dataclasses.replace(load_workload(MODEL), compile=backend), BUDGET)
    assert result.max_micro_batch == expected
    assert graphs <= 2
    assert any("ran the compiled training step" in note for note in result.notes)


@pytest.mark.slow
def test_a_compiled_build_model_is_probed_compiled(monkeypatch):
    monkeypatch.setenv("COMPILED", "aot_eager")
    result = probe(MODEL, memory_limit=BUDGET)
    assert result.compiled and result.compile_backend is None
    expected, _ = _largest_fitting_compiled_step(load_workload(MODEL), BUDGET)
    assert result.max_micro_batch == expected


@pytest.mark.slow
def test_plan_and_train_with_compile(tmp_path):
    from autotune.training import train

    plan_file = tmp_path / "plan.json"
    result = _cli("plan", MODEL, "--target-batch", "256", "--memory-limit", BUDGET,
                  "--compile-backend", "aot_eager", "--precision", "fp32", "--checkpointing", "off",
                  "-o", str(plan_file), "-q")
    assert result.returncode == 0, result.stderr
    assert "compile:      aot_eager (the training step is compiled" in result.stdout
    plan = json.loads(plan_file.read_text())
    assert plan["compile"] is True and plan["compile_backend"] == "aot_eager"
    before = graphs_compiled()
    trained = train(str(plan_file), MODEL, steps=2, progress=False, measure_noise_scale=False)
    assert graphs_compiled() > before  # the loop ran the compiled step
    assert not is_compiled(trained.model)  # what is saved is the eager module's state
    peak = max(record["peak_memory_bytes"] for record in trained.metrics)
    # The plan's peak is the compiled step's: the trained one reaches it within 1%.
    assert abs(peak - plan["predicted_peak_bytes"]) <= 0.01 * plan["predicted_peak_bytes"]


@pytest.mark.slow
def test_a_compiled_model_instance_is_probed_and_left_as_it_was():
    from autotune.workload.contract import Workload

    workload = load_workload(MODEL)
    module = workload.new_model()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    instance = dataclasses.replace(workload, model=torch.compile(module, backend="aot_eager"),
                                   file_sha256=None)
    assert isinstance(instance, Workload)
    result = probe(instance, memory_limit=BUDGET)
    assert result.compiled and result.max_micro_batch > 0
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in module.parameters())
