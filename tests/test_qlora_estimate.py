"""QLoRA's estimate (issue 20): bitsandbytes' 4-bit weights cannot be copied onto fake tensors, so
each 4-bit layer of the model built for real becomes a stand-in holding its storage by dtype (packed
weight and quantization state) that runs with a dequantized weight of its shape
(``autotune.memory.quantized``). The estimate is then an unverified upper bound: a ``--gpu`` plan
says so; on the CPU the probe's real trials still give the answer.
"""

from __future__ import annotations

import json
import warnings

import pytest
from click.testing import CliRunner

from autotune.cli.main import cli
from autotune.errors import AutotuneWarning
from autotune.memory import backend_for
from autotune.memory.fake import EstimateMemoryBackend, on_fake_tensors
from autotune.memory.quantized import QuantizedLinear, is_quantized_4bit, quant_state_tensors
from autotune.precision import Precision
from autotune.probing.trial import TrialSession

from real_models import real_model, real_path


@pytest.fixture(scope="module")
def qlora():
    pytest.importorskip("peft")
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure (no CPU backend, old torch)
        pytest.skip(f"bitsandbytes does not import here: {exc}")
    return real_model("llama_qlora")


def _nbytes(tensors):
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _trial(workload, backend):
    with TrialSession(workload, backend, precision=Precision.FP32) as session:
        layers = [m for m in session.model.modules() if isinstance(m, QuantizedLinear)]
        return session.run(2), len(layers)


def test_the_estimate_counts_the_4bit_storage_by_dtype_to_the_byte(qlora):
    real_model_ = qlora.new_model()
    quantized = [p for p in real_model_.parameters() if is_quantized_4bit(p)]
    assert quantized
    held = [*real_model_.parameters(), *real_model_.buffers(),
            *(t for p in quantized for t in quant_state_tensors(p.quant_state))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        estimated, stand_ins = _trial(on_fake_tensors(qlora), EstimateMemoryBackend())
    real, _ = _trial(qlora, backend_for("cpu", "256MiB"))
    assert stand_ins == len(quantized)
    # Weights, quantization state and AdamW's state of the adapters: the same bytes.
    assert estimated.baseline_bytes == real.baseline_bytes
    assert real.baseline_bytes - real.gradient_bytes * 2 - _nbytes(held) == 4 * 28  # AdamW steps
    # The step: an upper bound (whole dequantized weights, LoRA's forward), within 3%.
    assert 0 <= estimated.peak_bytes - real.peak_bytes <= 0.03 * real.peak_bytes


@pytest.mark.slow  # 6-12 s: the fast suite's 10 minutes
def test_a_gpu_plan_of_qlora_is_estimated_and_says_it_is_unverified(qlora, tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", real_path("llama_qlora"), "--gpu", "t4",
                                      "--target-batch", "8", "--quiet", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    # Weights, not packed bytes: the stand-ins keep each layer's shape before packing.
    assert (data["workload"]["param_count"], data["workload"]["trainable_param_count"]) == (
        3_343_616, 65_536)
    warnings_ = data["warnings"]
    said = [w for w in warnings_ if "unverified" in w]
    assert len(said) == 1 and "14 bitsandbytes 4-bit layers" in said[0], warnings_
    assert "Traceback" not in result.stderr
