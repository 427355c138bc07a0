"""PEFT fine-tuning (issue 20): LoRA, DoRA, prefix tuning and QLoRA adapters on tiny GPT-2 and
Llama plan, probe, train and export, from a model file and from an instance.

peft builds its adapters with ``Module.to()``, which torch refuses on fake parameters: such a model
is built on the meta device and converted (``autotune.memory.fake_build``), so the estimate still
runs; frozen parameters get no gradient and no optimizer state, in the estimate as in the step.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import autotune
from autotune.cli.main import cli
from autotune.errors import AutotuneWarning, WorkloadError
from autotune.memory import backend_for
from autotune.memory.fake import EstimateMemoryBackend, on_fake_tensors
from autotune.memory.fake_build import build_fake_model
from autotune.precision import Precision
from autotune.probing.trial import TrialSession
from autotune.workload.contract import Workload, load_workload

pytest.importorskip("transformers")
pytest.importorskip("peft")

REAL = pathlib.Path(__file__).resolve().parent.parent / "examples" / "real"
GPT2_LORA = str(REAL / "gpt2_lora.py")
LIMIT = "64MiB"


def _steady(workload, backend, n):
    with TrialSession(workload, backend, precision=Precision.FP32) as session:
        trial = session.run(n)
        trainable = [p for p in session.model.parameters() if p.requires_grad]
        every = [*session.model.parameters(), *session.model.buffers()]
        return trial, trainable, every


def _nbytes(tensors):
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
    return sum(storage.nbytes() for storage in storages.values())


def test_a_peft_model_is_built_on_the_meta_device_with_one_warning():
    workload = load_workload(GPT2_LORA)
    with pytest.warns(AutotuneWarning) as said, FakeTensorMode(allow_non_fake_inputs=True):
        model = build_fake_model(workload)
        build_fake_model(workload)  # the way that worked, without trying the fake build again
    ours = [str(w.message) for w in said if issubclass(w.category, AutotuneWarning)]
    assert len(ours) == 1, ours
    message = ours[0]
    assert "cannot run on fake tensors" in message and "Couldn't swap" in message
    assert "peft/" in message and "built it on the meta device" in message and "\n" not in message
    params = dict(model.named_parameters())
    assert all(isinstance(p, FakeTensor) and p.device.type == "cpu" for p in params.values())
    trainable = {name for name, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    gpt2 = model.base_model.model
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied weights stay one tensor


def test_frozen_parameters_get_no_gradients_nor_optimizer_state_in_the_estimate():
    workload = load_workload(GPT2_LORA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        estimated, trainable, every = _steady(on_fake_tensors(workload), EstimateMemoryBackend(), 2)
    real, real_trainable, _ = _steady(workload, backend_for("cpu", "256MiB"), 2)
    # Before the step: every parameter, and AdamW's two moments and step of the adapters alone.
    state = 2 * _nbytes(trainable) + 4 * len(trainable)
    assert estimated.baseline_bytes == real.baseline_bytes == _nbytes(every) + state
    assert estimated.gradient_bytes == real.gradient_bytes == _nbytes(real_trainable)
    assert real.gradient_bytes < _nbytes(every) / 30
    # The step on fake tensors counts 64 KiB more than the real one (LoRA's forward, the same on
    # a fake copy of a real instance): an upper bound, and the real trials prove the plan.
    assert 0 <= estimated.peak_bytes - real.peak_bytes <= 0.01 * real.peak_bytes


def test_a_model_that_reads_values_while_building_is_built_for_real_and_copied(tmp_path):
    path = tmp_path / "reads_values.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n"
        "    width = 16 + int(torch.ones(1).sum().item())  # a value: neither fake nor meta has it\n"
        "    return torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))\n"
        "def make_batch(n):\n"
        "    return torch.ones(n, 17), torch.zeros(n, 1)\n"
        "def loss_fn(model, batch):\n"
        "    x, y = batch\n"
        "    return torch.nn.functional.mse_loss(model(x), y)\n")
    workload = load_workload(path)
    with pytest.warns(AutotuneWarning, match="nor on the meta device .*built it for real on the CPU"):
        estimated = autotune.estimate_peak(workload, 8)
    assert estimated == _steady(workload, backend_for("cpu", "64MiB"), 8)[0].peak_bytes


def test_a_build_model_bug_is_the_model_files_error_not_a_fallback(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import torch\n"
                    "def build_model():\n"
                    "    return torch.nn.Linear(4, 4, bias={}['missing'])\n"
                    "def make_batch(n):\n"
                    "    return torch.ones(n, 4)\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutotuneWarning)  # a bug is no fallback: nothing said
        with pytest.raises(WorkloadError, match="build_model.* raised KeyError: 'missing'"):
            autotune.estimate_peak(load_workload(path), 2)


@pytest.fixture(scope="module")
def gpt2_lora_plan(tmp_path_factory):
    """`autotune plan` of the GPT-2 LoRA example from the CLI, with its output."""
    plan_path = tmp_path_factory.mktemp("peft") / "plan.json"
    result = CliRunner().invoke(cli, ["plan", GPT2_LORA, "--target-batch", "8", "--memory-limit",
                                      LIMIT, "--device", "cpu", "--precision", "fp32",
                                      "--checkpointing", "off", "--quiet", "-o", str(plan_path)])
    return result, plan_path


def test_cli_plans_a_lora_model_file_with_one_warning_line(gpt2_lora_plan):
    result, plan_path = gpt2_lora_plan
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if line.startswith("autotune: warning:")]
    assert len(said) == 1 and "built it on the meta device" in said[0], result.stderr
    assert "Traceback" not in result.stderr
    data = json.loads(plan_path.read_text())
    assert data["workload"]["trainable_param_count"] == 65_536
    assert data["workload"]["param_count"] == 2_702_336
    shown = CliRunner().invoke(cli, ["show", str(plan_path)])
    assert "trainable 65.5K of 2.7M parameters" in shown.output


def test_the_lora_plan_trains_to_its_predicted_peak_and_exports_to_hf(gpt2_lora_plan, tmp_path):
    _, plan_path = gpt2_lora_plan
    plan = autotune.load_plan(plan_path)
    trained = autotune.train(plan_path, GPT2_LORA, steps=2, progress=False)
    peak = max(m["peak_memory_bytes"] for m in trained.metrics if m["peak_memory_bytes"] is not None)
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes, (
        peak, plan.predicted_peak_bytes)
    exported = CliRunner().invoke(cli, ["export", str(plan_path), "--to", "hf",
                                        "-o", str(tmp_path / "hf.json")])
    assert exported.exit_code == 0, exported.output
    arguments = json.loads((tmp_path / "hf.json").read_text())
    assert arguments["per_device_train_batch_size"] * arguments["gradient_accumulation_steps"] == 8
    transformers = pytest.importorskip("transformers")
    transformers.TrainingArguments(output_dir=str(tmp_path / "out"), **arguments)


def _from_file(name):
    return str(REAL / f"{name}.py")


def _instance(name):
    """The model file's workload with its model built once, as a Python user passes one."""
    workload = load_workload(REAL / f"{name}.py")
    return dataclasses.replace(workload, model=workload.new_model(), source=f"{name} instance")


ADAPTERS = {  # name: (model file, where the plan's workload comes from)
    "gpt2-lora-instance": ("gpt2_lora", _instance),
    "llama-lora": ("llama_lora", _from_file),
    "gpt2-dora": ("gpt2_dora", _from_file),
    "llama-prefix-instance": ("llama_prefix", _instance),
    "llama-qlora": ("llama_qlora", _from_file),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ADAPTERS)
def test_every_adapter_plans_probes_trains_to_its_peak_and_exports(name, tmp_path):
    file, how = ADAPTERS[name]
    if file == "llama_qlora":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure (no CPU backend, old torch)
            pytest.skip(f"bitsandbytes does not import here: {exc}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        plan = autotune.plan(how(file), target_batch=32, memory_limit=LIMIT, device="cpu",
                             precision="fp32", checkpointing="off")
    total, trainable = plan.workload.param_count, plan.workload.trainable_param_count
    assert 0 < trainable < total / 30, (trainable, total)
    plan_path = tmp_path / "plan.json"
    autotune.save_plan(plan, plan_path)
    trained = autotune.train(plan_path, _from_file(file), steps=2, progress=False)
    peak = max(m["peak_memory_bytes"] for m in trained.metrics if m["peak_memory_bytes"] is not None)
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes, (
        peak, plan.predicted_peak_bytes)
    assert autotune.export_plan(plan, "hf").config["per_device_train_batch_size"] >= 1
    probed = CliRunner().invoke(cli, ["probe", _from_file(file), "--device", "cpu",
                                      "--memory-limit", LIMIT, "--json", "--quiet"])
    assert probed.exit_code == 0, probed.output
    assert json.loads(probed.stdout)["max_micro_batch"] >= max(plan.micro_batches)


@pytest.mark.slow
@pytest.mark.parametrize("file, limit", [("gpt2_lora", LIMIT), ("llama_lora", "96MiB")])
def test_lora_plans_a_larger_micro_batch_than_full_fine_tuning(file, limit):
    lora = load_workload(REAL / f"{file}.py")
    full = dataclasses.replace(lora, model=lora.namespace["build_base"])
    settings = dict(target_batch=32, memory_limit=limit, device="cpu", precision="fp32",
                    checkpointing="off")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        adapted = autotune.plan(lora, **settings)
        whole = autotune.plan(full, **settings)
    assert max(adapted.micro_batches) > max(whole.micro_batches) > 0
    assert whole.workload.trainable_param_count == whole.workload.param_count


@pytest.mark.slow
def test_hf_trainer_runs_the_lora_plan_and_the_callback_finds_it_fits(gpt2_lora_plan, tmp_path):
    from autotune.integrations.transformers import PlanCallback, training_arguments

    transformers = pytest.importorskip("transformers")
    _, plan_path = gpt2_lora_plan
    workload = load_workload(GPT2_LORA)
    tokens = workload.make_batch(64)["input_ids"]
    callback = PlanCallback(str(plan_path))
    trainer = transformers.Trainer(
        model=workload.model(), train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        args=training_arguments(str(plan_path), output_dir=str(tmp_path), max_steps=2,
                                save_strategy="no", logging_strategy="no", disable_tqdm=True),
        callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 2
    assert callback.report.startswith("fits: the first step's peak"), callback.report


def test_prefix_tuning_is_planned_without_checkpointing_nor_a_pipeline_which_cannot_train_it(tmp_path):
    # peft's prefix tuning reaches every layer through the key-value cache, which a block
    # recomputed in backward extends again (peft issue 869): under checkpointing auto, wherever
    # none left accumulation steps, the probe's step with every block checkpointed failed, and
    # that StepError ended the plan. A pipeline stage hands on the hidden state alone.
    from autotune.errors import LayoutUnsupported
    from autotune.workload.activation_checkpointing import enable_checkpointing

    prefix = _from_file("llama_prefix")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        planned = autotune.plan(prefix, target_batch=64, memory_limit=LIMIT, device="cpu", precision="fp32",
                                eval_batch=False)
        assert planned.checkpointing.label == "off" and planned.accumulation_steps > 1
        assert planned.reasons["checkpointing"].startswith("auto: off; peft's prefix tuning")
        assert "peft issue 869" in planned.reasons["checkpointing"]
        assert not planned.workload.checkpointable and planned.workload.checkpointing_refused
        autotune.save_plan(planned, tmp_path / "plan.json")  # the schema holds the new field
        assert autotune.load_plan(tmp_path / "plan.json").workload == planned.workload
        with pytest.raises(autotune.PlanError, match="checkpointing on: .*prefix tuning .*use auto or off"):
            autotune.plan(prefix, target_batch=64, memory_limit=LIMIT, device="cpu", precision="fp32",
                          checkpointing="on")
        with pytest.raises(WorkloadError, match="prefix tuning .*use checkpointing off"):
            enable_checkpointing(load_workload(prefix).new_model())
        with pytest.raises(LayoutUnsupported, match="prefix tuning .*train it without --pp"):
            autotune.plan(prefix, target_batch=64, world_size=2, pp=2, gpu="h100-80gb", eval_batch=False)


def test_a_peft_models_step_time_is_counted_as_the_estimate_builds_it():
    # `estimate --time` (and predict_step_time) built a peft model on fake tensors to count its
    # identical blocks, which peft's adapters refuse ("Couldn't swap Linear.weight"): a
    # RuntimeError traceback. It is built as the estimate builds it (on the meta device); these
    # tiny configs have too few blocks for small builds, so the step is counted whole either way.
    from autotune.gpus.target import profile_target
    from autotune.timing.count import count_steps_costs

    gpu = profile_target("h100-80gb").profile.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        few = count_steps_costs(_from_file("llama_lora"), [8], precision="bf16", for_gpu=gpu)
        whole = count_steps_costs(_from_file("llama_lora"), [8], precision="bf16", for_gpu=gpu,
                                  few_blocks=False)
    assert few == whole
    shown = CliRunner().invoke(cli, ["estimate", GPT2_LORA, "--gpu", "h100-80gb", "--time", "--micro-batch", "8"])
    assert shown.exit_code == 0, shown.output
    assert "predicted compute time of one training step on NVIDIA H100" in shown.output


@pytest.mark.slow  # a layout search over a peft model, about 20 s here
def test_tensor_parallelism_splits_lora_adapters_with_their_layers():
    # A Hugging Face tp_plan names the base model's layers, and peft's LoRA layers wrap them: the
    # plan is the base model's, each adapted projection split with its adapters
    # (tests/test_tensor_parallel.py checks the styles, the slow tests train it against one process).
    lora = _from_file("llama_lora")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        planned = autotune.plan(lora, target_batch=64, world_size=2, tp=2, gpu="h100-80gb", eval_batch=False)
    assert planned.parallel.tp == 2 and str(planned.sharding) == "fsdp"


def test_tensor_parallelism_over_dora_is_named_and_a_layout_search_skips_it():
    # DoRA's magnitude vectors are not split: --tp 2 names them and the way out; a layout search
    # skips tensor parallelism for this model and plans the others. One setting (bf16, every block
    # checkpointed, FSDP) keeps the search to the layouts: with auto settings it took 70 s.
    from peft import LoraConfig, get_peft_model

    from autotune.errors import LayoutUnsupported

    base = load_workload(REAL / "llama_lora.py")

    def build_dora():
        config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, use_dora=True,
                            target_modules=base.namespace["PROJECTIONS"])
        return get_peft_model(base.namespace["build_base"](), config)

    dora = dataclasses.replace(base, model=build_dora, source="llama DoRA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        with pytest.raises(LayoutUnsupported, match="tp=2: autotune splits LoRA adapters .* not DoRA's "
                                                    "magnitude vectors; define parallelize"):
            autotune.plan(dora, target_batch=64, world_size=2, tp=2, gpu="h100-80gb", eval_batch=False)
        planned = autotune.plan(dora, target_batch=256, world_size=4, tp="auto", pp="auto",
                                gpu="h100-80gb", headroom=0.998, eval_batch=False, precision="bf16",
                                checkpointing="on", sharding="fsdp")
    assert planned.parallel.tp == 1
    reason = planned.reasons["layout"]
    assert "tp 2 (not estimated: " in reason and "DoRA's magnitude vectors" in reason
    assert "tp > 1 is not available for this model (tp 2 showed it)" in reason
