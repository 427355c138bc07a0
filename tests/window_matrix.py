"""Plan vs trained peak over a covering set of layouts, splits, checkpointing and precisions.

    python tests/window_matrix.py            # prints the markdown table of bench/README.md

Each row is planned in this process (sharded layouts estimated on fake tensors with a fake
process group, as ``autotune plan --world-size W`` does), then trained for three optimizer steps
by the built-in loop: in this process for one rank, under one torchrun launch per world size
for the others (the rows of a world size share its process group). A row's trained peak is the
largest rank's peak in the last step, every layout's steady state (the first has no optimizer
state yet, and DDP rebuilds its buckets in the second, where the CPU meter counts them), plus
DDP's gradient buckets where the plan counts them (the CPU meter counts tensors, and the buckets
were made before the step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MODEL = TESTS.parent / "examples" / "tiny_lm.py"
STEPS = 3
LIMIT = "256MiB"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    world_size: int
    sharding: str
    target_batch: int
    micro_batch: int
    checkpointing: str
    precision: str
    shard_group: int | None = None

    @property
    def layout(self) -> str:
        if self.world_size == 1 and self.sharding == "ddp":
            return "one process"
        if self.shard_group is not None and self.shard_group < self.world_size:
            return f"hybrid {self.world_size} (groups of {self.shard_group})"
        return f"{self.sharding} {self.world_size}"


# Every layout, accumulation 1 / 2 / uneven, checkpointing off / on / K of N, fp32 and bf16.
ROWS = [
    Row("single-1", 1, "ddp", 8, 8, "off", "fp32"),
    Row("single-2", 1, "ddp", 16, 8, "off", "fp32"),
    Row("single-uneven-on-bf16", 1, "ddp", 20, 7, "on", "bf16"),
    Row("single-2-k2", 1, "ddp", 16, 8, "2", "fp32"),
    Row("ddp-2", 2, "ddp", 32, 8, "off", "fp32"),
    Row("ddp-1-k2-bf16", 2, "ddp", 16, 8, "2", "bf16"),
    Row("ddp-uneven-on", 2, "ddp", 40, 7, "on", "fp32"),
    Row("fsdp-1", 2, "fsdp", 16, 8, "off", "fp32"),
    Row("fsdp-2", 2, "fsdp", 32, 8, "off", "fp32"),
    Row("fsdp-uneven-on-bf16", 2, "fsdp", 40, 7, "on", "bf16"),
    Row("offload-2", 2, "fsdp-offload", 32, 8, "off", "fp32"),
    Row("fsdp4-2-k2", 4, "fsdp", 64, 8, "2", "fp32"),
    Row("hybrid4-2", 4, "fsdp", 64, 8, "off", "fp32", shard_group=2),
    Row("hybrid4-uneven-bf16", 4, "fsdp", 80, 7, "off", "bf16", shard_group=2),
]


def make_plan(row: Row):
    import autotune

    checkpointing = int(row.checkpointing) if row.checkpointing.isdigit() else row.checkpointing
    return autotune.plan(str(MODEL), target_batch=row.target_batch, world_size=row.world_size,
                         sharding=row.sharding, shard_group=row.shard_group,
                         micro_batch=row.micro_batch, device="cpu", memory_limit=LIMIT,
                         precision=row.precision, checkpointing=checkpointing, headroom=0.0)


def trained_peaks(plan_paths: dict[str, Path], world_size: int, out: Path) -> dict[str, int]:
    """{row name: the largest rank's peak in the last step} from training each plan."""
    if world_size == 1:
        from autotune.training.api import train

        return {name: train(str(path), str(MODEL), steps=STEPS, progress=False).metrics[-1][
                    "peak_memory_bytes"] for name, path in plan_paths.items()}
    spec = out / f"plans-{world_size}.json"
    spec.write_text(json.dumps({name: str(path) for name, path in plan_paths.items()}))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    from conftest import rank_command

    done = subprocess.run(rank_command(world_size, __file__, "--train", spec),
                          env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads((out / f"plans-{world_size}.peaks.json").read_text())


def _train_under_torchrun(spec: Path) -> None:
    """Every plan of one world size, one after the other, in one process group."""
    import torch.distributed as dist

    from autotune.distributed.collectives import settle
    from autotune.training.api import train

    dist.init_process_group("gloo")
    peaks = {}
    for name, path in json.loads(spec.read_text()).items():
        mine = train(path, str(MODEL), steps=STEPS, progress=False).metrics[-1]["peak_memory_bytes"]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        peaks[name] = max(every)
    if dist.get_rank() == 0:
        spec.with_name(spec.stem + ".peaks.json").write_text(json.dumps(peaks))
    settle()
    dist.destroy_process_group()


def run_matrix(rows=ROWS, out: Path | None = None) -> list[dict]:
    """One record per row: the plan's split, sync choice, predicted peak and the trained peak."""
    out = Path(out or tempfile.mkdtemp(prefix="window-matrix-"))
    plans, paths = {}, {}
    for row in rows:
        plans[row.name] = plan = make_plan(row)
        paths[row.name] = out / f"{row.name}.json"
        from autotune.planning.planfile import save_plan

        save_plan(plan, paths[row.name])
    measured = {}
    for world in sorted({row.world_size for row in rows}):
        names = [row.name for row in rows if row.world_size == world]
        measured.update(trained_peaks({n: paths[n] for n in names}, world, out))
    records = []
    for row in rows:
        plan = plans[row.name]
        buckets = plan.ddp_bucket_bytes if not plan.sharding.sharded else 0
        trained = measured[row.name] + buckets
        records.append({
            "row": row, "split": plan.split_text, "sync": _sync(plan),
            "predicted": plan.predicted_peak_bytes, "trained": trained,
            "budget": plan.budget_bytes,
            "error": (trained - plan.predicted_peak_bytes) / plan.predicted_peak_bytes,
        })
    return records


def _sync(plan) -> str:
    if not plan.sharding.sharded or plan.accumulation_steps == 1:
        return "-"
    return "every micro-step" if plan.reduce_every_micro_step else "last micro-step"


def table(records: list[dict]) -> str:
    from autotune.units import format_bytes

    lines = ["| layout | precision | checkpointing | split per rank | gradient sync | plan | trained | error |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in records:
        row = r["row"]
        blocks = f"{row.checkpointing} of 4" if row.checkpointing.isdigit() else row.checkpointing
        lines.append(f"| {row.layout} | {row.precision} | {blocks} | {r['split']} | {r['sync']} | "
                     f"{format_bytes(r['predicted'])} | {format_bytes(r['trained'])} | "
                     f"{r['error']:+.2%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        _train_under_torchrun(Path(sys.argv[2]))
    else:
        print(table(run_matrix()))
