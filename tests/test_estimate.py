"""Memory estimates on fake tensors: against the CPU backend's measured peaks, and the fallback."""

import json

import pytest
import torch
from click.testing import CliRunner

import autotune
from autotune.workload.activation_checkpointing import repeated_blocks
from autotune.cli.main import cli
from autotune.errors import AutotuneWarning, ConfigError, EstimateUnavailable, StepError
from autotune.memory import CPUMemoryBackend
from autotune.probing.estimate import estimate_peaks
from autotune.precision import Precision
from autotune.probing.trial import TrialSession
from autotune.workload.contract import Workload, load_workload

from conftest import EXAMPLES

TOLERANCE = 0.03
SIZES = (2, 7)
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.py"))


def measured(workload, precision, checkpointing):
    with TrialSession(workload, CPUMemoryBackend(), precision=Precision.parse(precision),
                      checkpointing=checkpointing) as session:
        return {n: session.run(n).peak_bytes for n in SIZES}


pytestmark = pytest.mark.usefixtures("one_thread")


def has_blocks(path) -> bool:
    return bool(repeated_blocks(load_workload(path).new_model()))


def check_against_measurement(path, precision, checkpointing):
    workload = load_workload(path)
    estimates = estimate_peaks(workload, SIZES, precision=precision, checkpointing=checkpointing)
    real = measured(workload, precision, checkpointing)
    for n in SIZES:
        error = abs(estimates[n] - real[n]) / real[n]
        assert error <= TOLERANCE, (path.stem, precision, checkpointing, n, estimates[n], real[n])


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_estimate_matches_cpu_measurement(path):
    # fp32 without and bf16 with checkpointing here; the other two settings in the slow test.
    check_against_measurement(path, "fp32", False)
    check_against_measurement(path, "bf16", has_blocks(path))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_estimate_matches_cpu_measurement_other_settings(path):
    check_against_measurement(path, "bf16", False)
    if has_blocks(path):
        check_against_measurement(path, "fp32", True)


def test_bundled_examples_are_all_covered():
    assert {"mlp", "tiny_lm", "cnn_bn"} <= {p.stem for p in EXAMPLE_FILES}


def test_public_api_and_model_instance_left_untouched():
    source = load_workload(EXAMPLES / "mlp.py")
    model = source.model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    workload = Workload(model=model, make_batch=source.make_batch, loss_fn=source.loss_fn,
                        build_optimizer=source.build_optimizer)
    peak = autotune.estimate_peak(workload, 4)
    assert peak == autotune.estimate_peak(EXAMPLES / "mlp.py", 4)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_estimate_grows_with_the_micro_batch_and_shrinks_with_checkpointing():
    path = EXAMPLES / "tiny_lm.py"
    plain = estimate_peaks(path, [1, 16])
    assert plain[16] > plain[1]
    assert autotune.estimate_peak(path, 16, checkpointing=True) < plain[16]


class _Nonzero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x[torch.nonzero(x[:, 0] > 0).squeeze(1)]).sum()


class _Item(_Nonzero):
    def forward(self, x):
        y = self.linear(x)
        return y.sum() * 2 if y.sum().item() > 0 else y.sum()


class _ShapeBug(_Nonzero):
    def forward(self, x):
        return self.linear(x.t()).sum()


def _workload(model_class):
    return Workload(model=model_class, make_batch=lambda n: torch.randn(n, 4), source=model_class.__name__)


def test_data_dependent_shape_raises_estimate_unavailable():
    with pytest.raises(EstimateUnavailable, match=r"_Nonzero: .*output shape depends on the data.*nonzero.*autotune probe"):
        autotune.estimate_peak(_workload(_Nonzero), 8)


def test_reading_values_in_python_raises_estimate_unavailable():
    with pytest.raises(EstimateUnavailable, match=r"reads a tensor's value in Python"):
        autotune.estimate_peak(_workload(_Item), 8)


def test_custom_kernel_without_fake_impl_raises_estimate_unavailable():
    library = torch.library.Library("autotune_test_estimate", "DEF")  # noqa: TOR901 - test-only op
    library.define("double(Tensor x) -> Tensor")
    library.impl("double", lambda x: x * 2, "CPU")

    class Custom(_Nonzero):
        def forward(self, x):
            return torch.ops.autotune_test_estimate.double(self.linear(x)).sum()

    with pytest.raises(EstimateUnavailable, match=r"no fake-tensor \(meta\) implementation"):
        autotune.estimate_peak(_workload(Custom), 8)


def test_a_bug_in_the_model_is_not_disguised_as_unavailable():
    # A bug fails the same way on real tensors: a StepError (the model's step failed), not
    # "cannot be estimated", with the model's own error as its cause.
    with pytest.raises(StepError) as info:
        autotune.estimate_peak(_workload(_ShapeBug), 8)
    assert not isinstance(info.value, EstimateUnavailable)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_micro_batch(bad):
    with pytest.raises(ConfigError, match="micro-batch"):
        autotune.estimate_peak(EXAMPLES / "mlp.py", bad)


def test_cli_estimate():
    runner = CliRunner()
    result = runner.invoke(cli, ["estimate", str(EXAMPLES / "mlp.py"), "--micro-batch", "4",
                                 "--micro-batch", "16", "--precision", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    peaks = json.loads(result.output)
    assert peaks == {str(n): autotune.estimate_peak(EXAMPLES / "mlp.py", n, precision="bf16")
                     for n in (4, 16)}
    text = runner.invoke(cli, ["estimate", str(EXAMPLES / "tiny_lm.py"), "--micro-batch", "2",
                               "--checkpointing", "on"])
    assert text.exit_code == 0 and "checkpointing on" in text.output and "micro-batch      2" in text.output


def test_cli_estimate_unavailable_exits_1(tmp_path):
    model_file = tmp_path / "masked.py"
    model_file.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(4, 1)\n"
        "def make_batch(n):\n    return torch.randn(n, 4)\n"
        "def loss_fn(model, x):\n    return model(x[x[:, 0] > 0]).sum()\n"
    )
    result = CliRunner().invoke(cli, ["estimate", str(model_file), "--micro-batch", "8"])
    assert result.exit_code == 1
    assert "cannot be estimated under fake tensors" in result.output and "autotune probe" in result.output


class _Stack(torch.nn.Module):
    """Parameters of few kinds, large next to the activations of a small batch: the optimizer
    step's transient decides the peak."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(192, 192) for _ in range(4)),
                                          torch.nn.Linear(192, 3))

    def forward(self, x):
        return self.layers(x).square().mean()


OPTIMIZERS = {
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, amsgrad=True),
    "adam-l2-maximize": lambda p: torch.optim.Adam(p, weight_decay=0.1, maximize=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.5),
    "nadam": lambda p: torch.optim.NAdam(p),
    "two-groups": lambda p: torch.optim.AdamW([{"params": p[:4]}, {"params": p[4:], "lr": 1e-4}]),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_estimate_steps_one_parameter_per_kind_and_still_matches_measurement(name, monkeypatch):
    from autotune.probing import estimate

    workload = Workload(model=_Stack, make_batch=lambda n: torch.randn(n, 192),
                        build_optimizer=lambda params: OPTIMIZERS[name](list(params)), source=name)
    stepped = []
    original = estimate._distinct_neighbour_runs

    def spy(optimizer):
        runs = original(optimizer)
        stepped.append(None if runs is None else sum(len(run) for _, run in runs))
        return runs

    monkeypatch.setattr(estimate, "_distinct_neighbour_runs", spy)
    peaks = estimate_peaks(workload, SIZES)
    # 10 parameters: 4 x (weight, bias) of the same two kinds, then the head's two.
    assert stepped and stepped[0] is not None and stepped[0] < 10, stepped
    monkeypatch.setattr(estimate, "_distinct_neighbour_runs", lambda optimizer: None)
    assert estimate_peaks(workload, SIZES) == peaks  # the full step, every parameter
    assert peaks == measured(workload, "fp32", False)


def test_neighbour_runs_and_optimizers_that_step_every_parameter():
    from autotune.probing.estimate import _distinct_neighbour_runs

    params = [torch.nn.Parameter(torch.zeros(3, 3)) for _ in range(7)]
    for p in params:
        p.grad = torch.zeros_like(p)
    params[2].grad = torch.zeros(3, 3).t()  # a transposed gradient: another kind of parameter
    runs = _distinct_neighbour_runs(torch.optim.AdamW(params, foreach=False))
    # Kinds a a b a a a a: the pairs (-, a), (a, a), (a, b), (b, a) appear by the fourth; the
    # last three parameters repeat (a, a).
    position = {id(p): i for i, p in enumerate(params)}
    assert [(index, [position[id(p)] for p in run]) for index, run in runs] == [(0, [0, 1, 2, 3])]
    assert _distinct_neighbour_runs(torch.optim.AdamW(params, foreach=True)) is None

    class Custom(torch.optim.SGD):
        pass

    assert _distinct_neighbour_runs(Custom(params, lr=0.1)) is None
    assert _distinct_neighbour_runs(torch.optim.LBFGS(params)) is None


def test_a_build_that_reads_values_is_built_for_real_naming_the_line(tmp_path):
    # timm's ViT calls .item() in its constructor; the message said "the step reads a tensor's
    # value" with no file, line or phase. Now such a model is built for real on the CPU and copied
    # onto fake tensors (issue 20), with one warning naming the library line that read the value.
    (tmp_path / "layers.py").write_text(
        "import torch\n\n\ndef drop_rates(depth):\n"
        "    return [x.item() for x in torch.linspace(0, 0.1, depth)]\n")
    (tmp_path / "model.py").write_text(
        "import torch\nfrom layers import drop_rates\n\n\ndef build_model():\n"
        "    rates = drop_rates(3)\n    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in rates))\n\n\n"
        "def make_batch(n):\n    return torch.randn(n, 4)\n\n\n"
        "def loss_fn(model, batch):\n    return model(batch).pow(2).mean()\n")
    with pytest.warns(AutotuneWarning) as said:
        estimated = autotune.estimate_peak(tmp_path / "model.py", 4)
    (message,) = [str(w.message) for w in said if issubclass(w.category, AutotuneWarning)]
    assert "cannot run on fake tensors nor on the meta device" in message
    assert f"in {tmp_path / 'layers.py'}:5" in message and "built it for real on the CPU" in message
    probed = autotune.probe(tmp_path / "model.py", memory_limit="64MiB", max_micro_batch=4)
    assert estimated == next(t.peak_bytes for t in probed.trials if t.micro_batch == 4)


def test_unavailable_in_the_forward_names_that_phase():
    with pytest.raises(EstimateUnavailable, match=r"while the forward and backward pass.*in forward: "
                                                  r"return y.sum\(\) \* 2 if y.sum\(\).item\(\)"):
        autotune.estimate_peak(_workload(_Item), 8)


def test_probe_falls_back_to_real_trials_in_one_note(tmp_path):
    (tmp_path / "model.py").write_text(
        "import torch\n\n\ndef build_model():\n"
        "    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))\n\n\n"
        "def make_batch(n):\n    return torch.randn(n, 4)\n\n\n"
        "def loss_fn(model, batch):\n    out = model(batch)\n"
        "    return out.pow(2).mean() * (2 if out.sum().item() > 0 else 1)\n")
    result = autotune.probe(tmp_path / "model.py", memory_limit="4MiB", max_micro_batch=16)
    assert result.max_micro_batch == 16
    notes = [n for n in result.notes if "real trials only" in n]
    assert len(notes) == 1 and "\n" not in notes[0] and "while the forward and backward pass" in notes[0]
