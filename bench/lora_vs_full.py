"""LoRA (and QLoRA) against full fine-tuning of the same model under one memory limit.

For the tiny GPT-2 and Llama of examples/real/ (``build_base()`` for full fine-tuning,
``build_model()`` with LoRA adapters; Llama's 4-bit QLoRA where bitsandbytes imports), on the CPU:

- micro-batch: the plan's largest micro-batch for ``--target-batch`` (fp32, checkpointing off)
- trainable / total: the plan's parameter counts
- estimate: the fake-tensor estimate of one step at that micro-batch (QLoRA's 4-bit layers as
  stand-ins of the same storage, an unverified upper bound; "-" where there is none), against
- measured: the CPU backend's peak of the same step (a real trial)
- trained: the largest peak of 2 optimizer steps of the plan in the built-in loop, against the
  plan's predicted peak
- "cache on": the LoRA example with Hugging Face's default ``use_cache=True`` (the examples turn
  the key-value cache off, as peft's guides do for training)

    python bench/lora_vs_full.py --markdown          # about 4 minutes on 2 loaded cores
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import tempfile
import warnings

import autotune
from autotune.errors import AutotuneWarning, EstimateUnavailable
from autotune.memory import backend_for
from autotune.precision import Precision
from autotune.probing.trial import TrialSession
from autotune.progress import quiet
from autotune.workload.contract import load_workload

REAL = pathlib.Path(__file__).resolve().parent.parent / "examples" / "real"
MiB = 1 << 20


def variants(folder: pathlib.Path):
    """(model, method, workload, model file to train)."""
    for name, model in (("gpt2_lora", "GPT-2"), ("llama_lora", "Llama")):
        lora = load_workload(REAL / f"{name}.py")
        yield model, "full", dataclasses.replace(lora, model=lora.namespace["build_base"]), None
        yield model, "LoRA", lora, REAL / f"{name}.py"
        cached = _cache_on(REAL / f"{name}.py", folder)
        yield model, "LoRA, cache on", load_workload(cached), cached
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: no QLoRA row
        return
    yield "Llama", "QLoRA 4-bit", load_workload(REAL / "llama_qlora.py"), REAL / "llama_qlora.py"


def _cache_on(model_file: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """The example with Hugging Face's default ``use_cache=True`` (the examples turn it off)."""
    text = model_file.read_text()
    if "use_cache=False" not in text:
        raise SystemExit(f"{model_file} no longer sets use_cache=False: update the cache-on rows")
    path = folder / f"{model_file.stem}_cache_on.py"
    path.write_text(text.replace("use_cache=False", "use_cache=True"))
    return path


def measure(workload, model_file, *, limit: str, target_batch: int, folder: pathlib.Path) -> dict:
    plan = autotune.plan(workload, target_batch=target_batch, memory_limit=limit, device="cpu",
                         precision="fp32", checkpointing="off")
    n = max(plan.micro_batches)
    try:
        estimate = autotune.estimate_peak(workload, n)
    except EstimateUnavailable:
        estimate = None
    with TrialSession(workload, backend_for("cpu", "1GiB"), precision=Precision.FP32) as session:
        measured = session.run(n).peak_bytes
    trained = None
    if model_file is not None:
        path = folder / "plan.json"
        autotune.save_plan(plan, path)
        metrics = autotune.train(path, str(model_file), steps=2, progress=False).metrics
        trained = max(m["peak_memory_bytes"] for m in metrics if m["peak_memory_bytes"] is not None)
    return {"plan": plan, "n": n, "estimate": estimate, "measured": measured, "trained": trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-limit", default="96MiB")
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    header = ["model", "method", "micro-batch", "vs full", "trainable / total", "estimate MiB",
              "measured MiB", "est err", "predicted MiB", "trained MiB", "trained err"]
    rows, full = [], {}
    with tempfile.TemporaryDirectory(prefix="lora_vs_full_") as folder, quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneWarning)
        for model, method, workload, model_file in variants(pathlib.Path(folder)):
            r = measure(workload, model_file, limit=args.memory_limit, target_batch=args.target_batch,
                        folder=pathlib.Path(folder))
            plan = r["plan"]
            full.setdefault(model, r["n"])
            est = r["estimate"]
            predicted = plan.predicted_peak_bytes
            rows.append([
                model, method, str(r["n"]), f"{r['n'] / full[model]:.2f}x",
                f"{plan.workload.trainable_param_count:,} / {plan.workload.param_count:,}",
                f"{est / MiB:.2f}" if est is not None else "-", f"{r['measured'] / MiB:.2f}",
                f"{(est - r['measured']) / r['measured']:+.2%}" if est is not None else "-",
                f"{predicted / MiB:.2f}",
                f"{r['trained'] / MiB:.2f}" if r["trained"] is not None else "-",
                f"{(r['trained'] - predicted) / predicted:+.2%}" if r["trained"] is not None else "-"])
    print(f"memory limit {args.memory_limit}, target batch {args.target_batch}, fp32, checkpointing off")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + " --- |" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        for row in [header, *rows]:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":
    main()
