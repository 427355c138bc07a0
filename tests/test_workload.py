import textwrap

import pytest
import torch

from autotune import Workload, WorkloadError, load_workload
from autotune.workload.contract import count_samples

GOOD = """
import torch
def build_model():
    return torch.nn.Linear(4, 1)
def make_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 1)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
BASE_LR = 0.1
BASE_BATCH = 8
"""


def write(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_good_model_file_loads_with_its_functions_and_constants(tmp_path):
    workload = load_workload(write(tmp_path, GOOD))
    assert isinstance(workload.new_model(), torch.nn.Linear)
    assert workload.base_lr == 0.1 and workload.base_batch == 8
    assert isinstance(workload.new_optimizer(workload.new_model().parameters()), torch.optim.AdamW)
    assert len(workload.file_sha256) == 64
    loss, count = workload.loss(workload.new_model(), workload.batch(3))
    assert loss.shape == () and count is None


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(WorkloadError) as info:
        load_workload(tmp_path / "nope.py")
    assert "nope.py" in str(info.value) and "does not exist" in str(info.value)


def test_import_failure_names_the_file_and_keeps_the_cause(tmp_path):
    path = write(tmp_path, "import torch\nraise ValueError('broken on purpose')\n")
    with pytest.raises(WorkloadError) as info:
        load_workload(path)
    assert str(path) in str(info.value) and "broken on purpose" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("drop, expected", [("build_model", "build_model()"), ("make_batch", "make_batch()")])
def test_missing_required_function_is_named(tmp_path, drop, expected):
    text = GOOD.replace(f"def {drop}", "def _unused")
    with pytest.raises(WorkloadError) as info:
        load_workload(write(tmp_path, text))
    assert expected in str(info.value) and "model.py" in str(info.value)


def test_make_batch_with_the_wrong_number_of_samples(tmp_path):
    text = GOOD.replace("torch.randn(batch_size, 4), torch.randn(batch_size, 1)",
                        "torch.randn(batch_size + 1, 4), torch.randn(batch_size + 1, 1)")
    workload = load_workload(write(tmp_path, text))
    with pytest.raises(WorkloadError) as info:
        workload.batch(5)
    message = str(info.value)
    assert "make_batch(5)" in message and "6 samples" in message and "model.py" in message


def test_make_batch_with_mismatched_first_dimensions():
    with pytest.raises(WorkloadError) as info:
        count_samples((torch.zeros(3, 2), torch.zeros(4)))
    assert "[3, 4]" in str(info.value)


def test_count_samples_reads_tensors_tuples_and_dicts():
    assert count_samples(torch.zeros(7, 3)) == 7
    assert count_samples({"input_ids": torch.zeros(5, 9), "labels": torch.zeros(5, 9)}) == 5
    assert count_samples([torch.zeros(2, 1), torch.zeros(2)]) == 2


def test_build_model_must_return_a_module(tmp_path):
    workload = load_workload(write(tmp_path, GOOD.replace("return torch.nn.Linear(4, 1)", "return 42")))
    with pytest.raises(WorkloadError) as info:
        workload.new_model()
    assert "build_model()" in str(info.value) and "int" in str(info.value)


def test_default_loss_uses_a_scalar_output_or_dot_loss():
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            return type("Out", (), {"loss": self.lin(x).mean()})()

    workload = Workload(model=WithLoss(), make_batch=lambda n: torch.randn(n, 3))
    loss, count = workload.loss(workload.new_model(), workload.batch(4))
    assert loss.shape == () and count is None


def test_default_loss_without_a_scalar_output_asks_for_loss_fn():
    workload = Workload(model=torch.nn.Linear(3, 2), make_batch=lambda n: torch.randn(n, 3))
    with pytest.raises(WorkloadError) as info:
        workload.loss(workload.new_model(), workload.batch(4))
    assert "loss_fn(model, batch)" in str(info.value)


def test_loss_sum_and_count_pairs_are_returned_unnormalised():
    workload = Workload(model=torch.nn.Linear(3, 1), make_batch=lambda n: torch.randn(n, 3),
                        loss_fn=lambda m, b: (m(b).sum(), 12))
    loss, count = workload.loss(workload.new_model(), workload.batch(4))
    assert count == 12


def test_non_callable_pieces_are_rejected():
    with pytest.raises(WorkloadError) as info:
        Workload(model=torch.nn.Linear(3, 1), make_batch=5)
    assert "make_batch" in str(info.value)


def test_bad_constants_are_rejected(tmp_path):
    with pytest.raises(WorkloadError) as info:
        load_workload(write(tmp_path, GOOD.replace("BASE_BATCH = 8", "BASE_BATCH = -8")))
    assert "BASE_BATCH" in str(info.value)


def test_model_files_can_import_their_neighbours(tmp_path):
    write(tmp_path, "import torch\nWIDTH = 6\n", name="helpers_for_model.py")
    text = "from helpers_for_model import WIDTH\n" + GOOD.replace("Linear(4, 1)", "Linear(WIDTH, 1)")
    workload = load_workload(write(tmp_path, text))
    assert workload.new_model().in_features == 6


def test_a_model_file_importing_torchao_shows_no_note_to_torchaos_developers(tmp_path):
    # peft imports torchao, whose Enum pytree constants made torch log two deprecation lines on
    # every rank for every such model file; a record that says anything else still shows.
    from conftest import logged

    source = tmp_path / "enum_model.py"
    source.write_text(
        "import enum, logging, torch\n"
        "class Mode(str, enum.Enum):\n"
        "    A = 'a'\n"
        "torch.utils._pytree.register_constant(Mode)\n"
        "logging.getLogger('torch.utils._pytree').warning('something else')\n"
        "def build_model():\n"
        "    return torch.nn.Linear(2, 2)\n"
        "def make_batch(n):\n"
        "    return torch.zeros(n, 2)\n")
    with logged("torch.utils._pytree") as records:
        load_workload(source)
    assert records == ["something else"], records
