"""Real library models end to end: probe, estimate error, checkpointing, plan, train, each export.

For each tiny-config real model in examples/real/ (Hugging Face T5, GPT-2, BERT, Llama, ResNet,
a variable-length GPT-2 with collate_fn, a dataset-only BERT; a timm ViT when timm imports), on
the CPU under one memory limit:

- probe: the exact largest micro-batch (fp32, checkpointing off), capped at the target batch
- est err: the fake-tensor estimate at that micro-batch against the probe's measured peak
- ckpt: the probe's answer with checkpointing on (HF's own switch for HF models)
- plan: ``autotune.plan`` with the defaults (auto precision and checkpointing)
- train: 2 optimizer steps of the plan with the built-in loop (finite loss)
- hf / ds / lightning / accelerate / torchrun: each export accepted by the target's own object
  (TrainingArguments(**file), DeepSpeed's config class where installed else JSON only,
  lightning.Trainer(**file["trainer"]), Accelerate's launch-config loader, the command line)

    python bench/real_models.py --markdown            # a few minutes on 2 cores
    python bench/real_models.py --models gpt2 t5
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time
import traceback

import torch

import autotune
from autotune.planning.export import export_plan
from autotune.probing.estimate import estimate_peak
from autotune.workload.contract import load_workload

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ("t5", "gpt2", "bert", "llama", "resnet", "gpt2_varlen", "bert_dataset", "timm_vit",
          "tv_resnet18")
EXPORTS = ("hf", "deepspeed", "lightning", "accelerate", "torchrun")


def workload_for(name: str):
    if name == "timm_vit":
        return _timm_vit()
    if name == "tv_resnet18":
        return _torchvision_resnet18()
    return load_workload(ROOT / "examples" / "real" / f"{name}.py")


def _timm_vit():
    import timm  # raises ImportError where timm (or its torchvision) does not import

    return _image_classifier(
        lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                  num_classes=10, drop_path_rate=0.1),
        size=32, source="timm vit_tiny")


def _torchvision_resnet18():
    from torchvision import models  # raises ImportError where torchvision does not import

    # 64 x 64 images: at 32 x 32 the last stage is 1 x 1, and BatchNorm refuses micro-batch 1 there.
    return _image_classifier(lambda: models.resnet18(num_classes=10), size=64,
                             source="torchvision resnet18")


def _image_classifier(new_model, *, size: int, source: str):
    """A 10-class classifier on random ``size`` x ``size`` images, seeded like the model files."""
    def build():
        torch.manual_seed(0)
        return new_model()

    def make_batch(n):
        generator = torch.Generator().manual_seed(n)
        return (torch.randn(n, 3, size, size, generator=generator),
                torch.randint(0, 10, (n,), generator=generator))

    def loss_fn(model, batch):
        images, labels = batch
        return torch.nn.functional.cross_entropy(model(images), labels)

    return autotune.Workload(model=build, make_batch=make_batch, loss_fn=loss_fn, source=source)


def check_export(plan, target: str, folder: pathlib.Path) -> str:
    exported = export_plan(plan, target, plan_path=str(folder / "plan.json"))
    path = folder / f"{target}.json"
    path.write_text(exported.render())
    if target == "hf":
        import transformers

        transformers.TrainingArguments(output_dir=str(folder), **json.loads(path.read_text()))
        return "ok"
    if target == "deepspeed":
        try:
            from deepspeed.runtime.config import DeepSpeedConfig
        except ImportError:
            json.loads(path.read_text())
            return "json"
        DeepSpeedConfig(json.loads(path.read_text()))
        return "ok"
    if target == "lightning":
        import lightning

        lightning.Trainer(**json.loads(path.read_text())["trainer"], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False)
        return "ok"
    if target == "accelerate":
        from accelerate.commands.config.config_args import load_config_from_file

        load_config_from_file(str(path))
        return "ok"
    return "ok" if path.read_text().startswith("torchrun ") else "bad"


def run(name: str, *, memory_limit: str, target_batch: int, folder: pathlib.Path) -> dict:
    row: dict = {"model": name}
    try:
        workload = workload_for(name)
    except ImportError as exc:
        return {"model": name, "skipped": f"{type(exc).__name__}: {exc}"}
    started = time.perf_counter()
    probe = autotune.probe(workload, device="cpu", memory_limit=memory_limit, max_micro_batch=target_batch)
    n = probe.max_micro_batch
    measured = probe.peak_at(n)
    row["probe"] = f"{n}{' (cap)' if probe.capped else ''}"
    try:
        estimated = estimate_peak(workload, n)
        row["est err"] = f"{(estimated - measured) / measured:+.1%}" if measured else "n/a"
    except autotune.EstimateUnavailable as exc:
        row["est err"] = "unavailable: " + str(exc).split("because ")[-1][:40]
    try:
        on = autotune.probe(workload, device="cpu", memory_limit=memory_limit, checkpointing=True,
                            max_micro_batch=target_batch)
        row["ckpt"] = f"{on.max_micro_batch}"
    except autotune.AutotuneError as exc:
        row["ckpt"] = f"error: {str(exc)[:40]}"
    plan = autotune.plan(workload, target_batch=target_batch, device="cpu", memory_limit=memory_limit)
    row["plan"] = (f"{'+'.join(map(str, plan.micro_batches)) if not plan.is_even else f'{plan.micro_batch}×{plan.accumulation_steps}'}"
                   f" {plan.precision}{' ckpt' if plan.checkpointing else ''}")
    result = autotune.train(plan, workload, steps=2, progress=False, measure_noise_scale=False)
    losses = [m.get("loss") for m in result.metrics]
    row["train"] = "ok" if result.steps == 2 and all(math.isfinite(x) for x in losses) else f"bad {losses}"
    for target in EXPORTS:
        try:
            row[target] = check_export(plan, target, folder)
        except Exception as exc:  # noqa: BLE001 - the table reports what failed
            row[target] = f"error: {type(exc).__name__}"
            traceback.print_exc()
    row["seconds"] = f"{time.perf_counter() - started:.0f}"
    return row


COLUMNS = ("model", "probe", "est err", "ckpt", "plan", "train", *EXPORTS, "seconds")


def print_table(rows, markdown: bool):
    if markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
    for row in rows:
        if "skipped" in row:
            cells = [row["model"], f"skipped ({row['skipped'][:60]})"] + [""] * (len(COLUMNS) - 2)
        else:
            cells = [str(row.get(c, "")) for c in COLUMNS]
        print(("| " + " | ".join(cells) + " |") if markdown else "  ".join(f"{c:<12}" for c in cells))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--memory-limit", default="48MiB")
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            rows.append(run(name, memory_limit=args.memory_limit, target_batch=args.target_batch,
                            folder=pathlib.Path(folder)))
            print(f"done: {rows[-1]}", file=sys.stderr)
    print_table(rows, args.markdown)
    bad = [r for r in rows if any(str(v).startswith(("error", "bad")) for v in r.values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
