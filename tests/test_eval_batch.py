"""The plan's eval micro-batch: the largest forward under no_grad (model in eval(), optimizer state
alive) that fits the budget less the headroom, exact against bisection over real forwards, shown,
and exported to Hugging Face and Lightning."""

import json

import pytest
import torch
from click.testing import CliRunner

from autotune import plan
from autotune.cli.format import format_plan
from autotune.cli.main import cli
from autotune.errors import ConfigError
from autotune.memory.cpu import StorageTracker, counting
from autotune.planning.export import export_plan
from autotune.planning.planfile import plan_from_json, plan_to_json
from autotune.planning.policy import usable_bytes

import optimizer_models

MODEL = optimizer_models.__file__
LIMIT = "8MiB"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def planned():
    return plan(MODEL, target_batch=64, device="cpu", memory_limit=LIMIT, precision="fp32",
                checkpointing="off")


def _eval_bisection(limit_bytes: int, fails: int) -> int:
    """The largest n below ``fails`` whose forward under no_grad, beside the parameters and AdamW's
    state, peaks within ``limit_bytes``: bisection, each size a real forward counted on its own
    tracker (none of the probe's code)."""
    model = optimizer_models.build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    tracker = StorageTracker()
    for t in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
        tracker.add(t)

    def fits(n):
        tracker.reset_peak()
        with counting(tracker), torch.no_grad():
            optimizer_models.loss_fn(model, optimizer_models.make_batch(n))
        return tracker.peak <= limit_bytes

    assert not fits(fails)
    fit, fail = 0, fails
    while fail - fit > 1:
        mid = (fit + fail) // 2
        fit, fail = (mid, fail) if fits(mid) else (fit, mid)
    return fit


def test_eval_batch_is_exact_bisection_over_no_grad_forwards(planned):
    n = planned.eval_micro_batch
    limit = usable_bytes(planned.budget_bytes, planned.headroom)
    assert n == _eval_bisection(limit, fails=2 * n + 2)
    assert n >= planned.micro_batch  # no gradients, no optimizer step: a forward fits more
    assert "the fake-tensor estimate said" in planned.reasons["eval"]
    assert f"{n + 1} does not" in planned.reasons["eval"]


def test_the_plan_file_show_and_exports_carry_it(planned, tmp_path):
    transformers = pytest.importorskip("transformers")
    n = planned.eval_micro_batch
    again = plan_from_json(plan_to_json(planned))  # the schema takes the field
    assert again.eval_micro_batch == n
    assert f"eval batch:   {n} (" in format_plan(again)
    config = export_plan(again, "hf").config
    assert config["per_device_eval_batch_size"] == n
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **config)
    assert args.per_device_eval_batch_size == n
    lightning = export_plan(again, "lightning").config
    assert lightning["val_dataloader"] == {"batch_size": n}
    # A plan without one (older files, --no-eval-batch) exports none.
    data = json.loads(plan_to_json(planned))
    del data["eval_micro_batch"]
    older = plan_from_json(json.dumps(data))
    assert older.eval_micro_batch is None
    assert "per_device_eval_batch_size" not in export_plan(older, "hf").config


@pytest.mark.slow
def test_cli_caps_or_skips_the_eval_batch(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", MODEL, "--target-batch", "4", "--micro-batch", "4", "--memory-limit", LIMIT,
            "--precision", "fp32", "-o", str(out)]
    capped = CliRunner().invoke(cli, [*args, "--max-eval-batch", "3"])
    assert capped.exit_code == 0, capped.output
    assert json.loads(out.read_text())["eval_micro_batch"] == 3
    assert "eval batch:   3 (" in capped.output and "--max-eval-batch 3; more may fit" in capped.output
    skipped = CliRunner().invoke(cli, [*args, "--no-eval-batch"])
    assert skipped.exit_code == 0, skipped.output
    assert json.loads(out.read_text())["eval_micro_batch"] is None
    assert "eval batch" not in skipped.output


def test_cli_refuses_a_cap_on_a_skipped_eval_batch(tmp_path):
    both = CliRunner().invoke(cli, ["plan", MODEL, "--target-batch", "4", "--no-eval-batch",
                                    "--max-eval-batch", "3", "-o", str(tmp_path / "plan.json")])
    assert both.exit_code == 2  # conflicting options: a usage error
    assert "--max-eval-batch caps the eval batch, which --no-eval-batch skips" in both.output


def test_max_eval_batch_must_be_a_positive_int():
    with pytest.raises(ConfigError, match=r"max_eval_batch=0 must be a positive int"):
        plan(MODEL, target_batch=4, device="cpu", memory_limit=LIMIT, max_eval_batch=0)


@pytest.mark.slow  # lightning's import and Trainer: the export's config is checked above
def test_lightning_callback_sets_the_val_batch_size(planned):
    lightning = pytest.importorskip("lightning")
    from autotune.integrations.lightning import apply_plan, trainer_arguments

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = self.val_batch_size = 1  # what its dataloaders batch by
            self.layer = torch.nn.Linear(2, 2)

    trainer = lightning.Trainer(**trainer_arguments(planned), logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    apply_plan(planned, trainer, module)
    assert module.val_batch_size == planned.eval_micro_batch > module.batch_size
