"""What a plan costs beyond its trials: the garbage collector's passes over a heap the plan cannot
free (``memory.frozen_heap``) and the fake step each candidate layout's planner ran to see that
the model can be estimated."""

from __future__ import annotations

import gc
import threading

import pytest

from autotune import plan
from autotune.memory.frozen_heap import frozen_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_plan_freezes_the_heap_it_found_and_gives_it_back(examples_dir, monkeypatch, unfrozen):
    from autotune.orchestration import planner

    before = []  # a container: the collector tracks it

    def in_oldest() -> bool:
        return any(o is before for o in gc.get_objects(2))

    seen = []
    original = planner._Planner.run

    def run(self):
        seen.append((gc.get_freeze_count(), in_oldest()))
        return original(self)

    monkeypatch.setattr(planner._Planner, "run", run)
    gc.collect()  # ``before`` moves to the oldest generation
    assert in_oldest()
    plan(examples_dir / "mlp.py", target_batch=16, device="cpu", memory_limit="256MiB",
         eval_batch=False)
    frozen, was_in_oldest = seen[0]
    # While planning, what existed before it is out of the collector's generations...
    assert frozen > 0 and not was_in_oldest
    # ...and afterwards it is back in the oldest, collected as before.
    assert gc.get_freeze_count() == 0
    assert in_oldest()


def test_cycles_made_while_frozen_are_still_collected(unfrozen):
    class Node:
        pass

    with frozen_heap():
        a, b = Node(), Node()
        a.other, b.other = b, a
        ids = {id(a), id(b)}
        del a, b
        gc.collect()
        assert not any(id(o) in ids for o in gc.get_objects() if isinstance(o, Node))


def test_a_heap_frozen_by_the_caller_stays_frozen(unfrozen):
    kept = []  # a container the collector tracks
    gc.freeze()
    with frozen_heap():
        pass
    # Still in the permanent generation, out of every other (the count itself drops as frozen
    # objects die, so it is not compared).
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())


def test_nested_and_concurrent_plans_unfreeze_once_the_last_ends(unfrozen):
    started, release = threading.Event(), threading.Event()

    def other():
        with frozen_heap():
            started.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    started.wait(10)
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() > 0  # the other thread's plan still runs
    release.set()
    thread.join(10)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("model", ["tiny_lm.py", "real/llama.py"])  # ours, a tiny HF Llama
def test_a_layout_search_checks_that_the_model_can_be_estimated_once(examples_dir, monkeypatch, model):
    from autotune.gpus import target

    checked = []
    original = target.ProfileTarget.check_estimable
    monkeypatch.setattr(target.ProfileTarget, "check_estimable",
                        lambda self, workload, precision: (checked.append(precision),
                                                           original(self, workload, precision))[1])
    # A pinned micro-batch of 1 leaves 4 steps, so the search plans tp 2 after data parallel.
    planned = plan(examples_dir / model, gpu="h100-80gb", world_size=2, target_batch=8,
                   micro_batch=1, tp="auto", eval_batch=False)
    assert "FSDP 1 × TP 2 (8 accumulation steps" in planned.reasons["layout"]
    assert [str(p) for p in checked] == ["bf16"]


def test_a_model_fake_tensors_cannot_run_is_still_refused_in_a_search(tmp_path):
    from autotune.errors import EstimateUnavailable

    model = tmp_path / "model.py"
    model.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.l(x).sum().item()  # a value fake tensors do not have\n"
        "def build_model():\n    return Net()\n"
        "def make_batch(n):\n    return torch.randn(n, 4)\n"
        "def loss_fn(model, batch):\n    return torch.tensor(model(batch), requires_grad=True)\n")
    with pytest.raises(EstimateUnavailable, match="--gpu h100-80gb plans from memory estimates"):
        plan(model, gpu="h100-80gb", world_size=2, target_batch=8, tp="auto", eval_batch=False)
