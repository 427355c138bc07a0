"""Per-step time of autotune's built-in loop against a hand-written PyTorch loop doing the same math.

Both run the same model file, micro-batch, accumulation steps and precision, one after the other
in blocks that alternate within one process (so drift in machine load hits both alike). The
hand-written loop is what a careful user writes: a DataLoader of micro-batches, autocast, the
loss divided by the accumulation steps (exact for even splits), clipping, optimizer and scheduler
steps and a loss.item() per step. Per-step times are medians over all blocks, the first two steps
of every block left out (iterator start-up, lazy optimizer state). Two clocks: wall time, and the
process's CPU time (with --threads 1 the latter barely moves when other processes load the
machine, which wall time on a shared machine does a lot).

Two tables: whole runs (``autotune.training`` against the hand-written loop, data loading
included), and the optimizer step alone, the loop's ``StepRunner.step`` against the hand-written
step on the same batch, alternating every step (the most precise comparison on a busy machine).

    python bench/train_overhead.py --rounds 8 --steps 8 --threads 1

``--fsdp`` prints the FSDP2 row instead: the script relaunches itself under torchrun (2 gloo
ranks on the CPU) and alternates, every step, the loop's ``StepRunner.step`` on a model sharded
as a plan says against a hand-written FSDP2 step (``set_requires_gradient_sync(False)`` on all
micro-steps but the last, the loss divided by the accumulation steps, global-norm clipping over
the DTensors, one all-reduce of the loss), each on its own sharded copy of the model.

    python bench/train_overhead.py --fsdp --rounds 8 --steps 8 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.planning.types import LRDecision, Plan, WorkloadFingerprint  # noqa: E402
from autotune.precision import Precision, autocast  # noqa: E402
from autotune.training import metrics as train_metrics  # noqa: E402
from autotune.distributed import process_group as distributed  # noqa: E402
from autotune.training import train  # noqa: E402
from autotune.training.data import Window  # noqa: E402
from autotune.training.loop import StepRunner, TrainState  # noqa: E402
from autotune.training.schedule import build_scheduler  # noqa: E402
from autotune.precision import grad_scaler  # noqa: E402
from autotune.workload.contract import load_workload  # noqa: E402
from autotune.distributed.sharding.wrap import build_mesh, shard_model  # noqa: E402

CASES = [  # (model file, micro-batch, accumulation steps, precision)
    ("examples/cnn_bn.py", 32, 4, "fp32"),
    ("examples/mlp.py", 64, 4, "fp32"),
    ("examples/cnn_bn.py", 32, 4, "bf16"),
]
WARMUP = 2
CLIP = 1.0


def _plan(micro, accum, precision):
    return Plan(target_batch=micro * accum, world_size=1, micro_batches=[micro] * accum,
                precision=precision, checkpointing=False, lr=LRDecision(rule="none"),
                clip_grad_norm=CLIP,
                workload=WorkloadFingerprint(source="bench", file_sha256=None, param_count=0,
                                             param_bytes=0))


class _Clock:
    """Wall and CPU time between successive ticks."""

    def __init__(self):
        self.wall, self.cpu = [], []
        self._last = (time.perf_counter(), time.process_time())

    def tick(self):
        now = (time.perf_counter(), time.process_time())
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self._last = now

    def after_warmup(self):
        return self.wall[WARMUP:], self.cpu[WARMUP:]


def builtin_steps(workload, micro, accum, precision, steps):
    # The loop writes one metrics record at the end of every optimizer step: tick there.
    clock = _Clock()
    original = train_metrics.MetricsLog.write

    def write(self, record):
        original(self, record)
        clock.tick()

    train_metrics.MetricsLog.write = write
    try:
        clock._last = (time.perf_counter(), time.process_time())
        train(_plan(micro, accum, precision), workload, steps=steps, progress=False)
    finally:
        train_metrics.MetricsLog.write = original
    return clock.after_warmup()


def handwritten_steps(workload, micro, accum, precision, steps):
    device = torch.device("cpu")
    precision = Precision(precision)
    torch.manual_seed(0)
    model = workload.new_model().to(device)
    model.train()
    optimizer = workload.new_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(workload.build_dataset(), batch_size=micro, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    clock = _Clock()
    for _ in range(steps):
        _hand_step(workload, model, optimizer, scheduler, (next(batches) for _ in range(accum)),
                   accum, precision, device)
        clock.tick()
    return clock.after_warmup()


def _hand_step(workload, model, optimizer, scheduler, micro_batches, accum, precision, device):
    """The hand-written optimizer step: what a careful user writes for an even split."""
    total = 0.0
    for batch in micro_batches:
        with autocast(precision, device):
            loss = workload.loss_fn(model, batch)
        (loss / accum).backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    _ = (total / accum).item()


def interleaved_steps(workload, micro, accum, precision, steps):
    """CPU ms per step of StepRunner.step and of the hand-written step, alternating every step."""
    precision, device = Precision(precision), torch.device("cpu")
    dataset = workload.build_dataset()
    batch = dataset[torch.arange(micro * accum)]

    def fresh():
        torch.manual_seed(0)
        model = workload.new_model()
        model.train()
        return model, workload.new_optimizer(model.parameters())

    ours_model, ours_opt = fresh()
    plan = _plan(micro, accum, precision.value)
    ctx = distributed.DistContext(world_size=1, rank=0, device=device)
    runner = StepRunner(model=ours_model, optimizer=ours_opt,
                        scheduler=build_scheduler(workload, ours_opt, plan),
                        scaler=grad_scaler(precision, device), precision=precision,
                        workload=workload, ctx=ctx, clip_grad_norm=CLIP, state=TrainState())
    window = Window(step=0, epoch=0, index=0, samples=micro * accum, start=0, stop=micro * accum,
                    micro_batches=(micro,) * accum)
    hand_model, hand_opt = fresh()
    hand_sched = torch.optim.lr_scheduler.LambdaLR(hand_opt, lambda step: 1.0)

    def ours():
        runner.step(window, batch, stop_requested=False)

    def hand():
        parts = (tuple(t[i * micro:(i + 1) * micro] for t in batch) for i in range(accum))
        _hand_step(workload, hand_model, hand_opt, hand_sched, parts, accum, precision, device)

    times = {ours: [], hand: []}
    for i in range(steps):
        for run in ((ours, hand) if i % 2 else (hand, ours)):
            start = time.process_time()
            run()
            times[run].append(time.process_time() - start)
    return ([t * 1e3 for t in times[ours][WARMUP:]], [t * 1e3 for t in times[hand][WARMUP:]])


FSDP_CASE = ("examples/mlp.py", 64, 4, "fp32")
FSDP_RANKS = 2


def _hand_fsdp_step(workload, model, optimizer, micro_batches, accum):
    """The hand-written FSDP2 optimizer step for an even split (a careful user's version)."""
    import torch.distributed as dist

    total = torch.zeros(())
    for index, batch in enumerate(micro_batches):
        model.set_requires_gradient_sync(index == accum - 1)
        loss = workload.loss_fn(model, batch)
        (loss / accum).backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    _ = (total / (accum * dist.get_world_size())).item()


def fsdp_interleaved_steps(workload, micro, accum, steps):
    """CPU ms per step on this rank: StepRunner.step on a sharded model, then the hand FSDP2 step."""
    import torch.distributed as dist

    precision, device = Precision.FP32, torch.device("cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = workload.build_dataset()
    batch = dataset[torch.arange(rank * micro * accum, (rank + 1) * micro * accum)]
    mesh = build_mesh("cpu", world_size, world_size)

    def fresh():
        torch.manual_seed(0)
        model = shard_model(workload.new_model(), mesh=mesh, sharding="fsdp", precision="fp32")
        model.train()
        return model, workload.new_optimizer(model.parameters())

    ours_model, ours_opt = fresh()
    plan = _plan(micro, accum, precision.value)
    ctx = distributed.DistContext(world_size=world_size, rank=rank, device=device)
    runner = StepRunner(model=ours_model, optimizer=ours_opt,
                        scheduler=build_scheduler(workload, ours_opt, plan),
                        scaler=grad_scaler(precision, device), precision=precision,
                        workload=workload, ctx=ctx, clip_grad_norm=CLIP, state=TrainState())
    samples = micro * accum * world_size
    window = Window(step=0, epoch=0, index=0, samples=samples, start=0, stop=samples,
                    micro_batches=(micro,) * accum)
    hand_model, hand_opt = fresh()

    def ours():
        runner.step(window, batch, stop_requested=False)

    def hand():
        parts = (tuple(t[i * micro:(i + 1) * micro] for t in batch) for i in range(accum))
        _hand_fsdp_step(workload, hand_model, hand_opt, parts, accum)

    times = {ours: [], hand: []}
    for i in range(steps):
        for run in ((ours, hand) if i % 2 else (hand, ours)):
            dist.barrier()  # neither loop's time includes waiting for the other rank to finish
            start = time.process_time()
            run()
            times[run].append(time.process_time() - start)
    return ([t * 1e3 for t in times[ours][WARMUP:]], [t * 1e3 for t in times[hand][WARMUP:]])


def fsdp_main(args) -> None:
    """Under torchrun: every rank measures; rank 0 prints the row (medians over all ranks' steps)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    path, micro, accum, _ = FSDP_CASE
    ours, hand = fsdp_interleaved_steps(load_workload(ROOT / path), micro, accum, args.rounds * args.steps)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ours, hand))
    if dist.get_rank() == 0:
        ours = [t for pair in gathered for t in pair[0]]
        hand = [t for pair in gathered for t in pair[1]]
        ours_ms, hand_ms = statistics.median(ours), statistics.median(hand)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank, "
              f"{dist.get_world_size()} gloo ranks; FSDP2 optimizer step alone, alternating every "
              f"step ({args.rounds * args.steps} steps each per rank), median CPU ms over all ranks")
        print(f"{'workload':<30} {'hand cpu':>9} {'ours cpu':>9} {'ratio':>6}")
        print(f"{Path(path).name + f' {micro}x{accum} fp32 fsdp':<30} {hand_ms:>9.2f} "
              f"{ours_ms:>9.2f} {ours_ms / hand_ms:>6.3f}")
    dist.destroy_process_group()


def _launch_fsdp(argv) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(FSDP_RANKS),
               "--standalone", __file__, *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    raise SystemExit(subprocess.run(command, env=env).returncode)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="alternating blocks per loop")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--fsdp", action="store_true",
                        help=f"the FSDP2 row instead ({FSDP_RANKS} gloo ranks under torchrun)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fsdp:
        if "WORLD_SIZE" not in os.environ:
            _launch_fsdp(sys.argv[1:] if argv is None else argv)
        fsdp_main(args)
        return
    rows = []
    for path, micro, accum, precision in CASES:
        workload = load_workload(ROOT / path)
        times = {"ours": ([], []), "hand": ([], [])}
        for round_ in range(args.rounds):
            # Alternate which loop goes first, so neither always follows the other.
            order = [("ours", builtin_steps), ("hand", handwritten_steps)]
            for name, run in (order if round_ % 2 == 0 else order[::-1]):
                wall, cpu = run(workload, micro, accum, precision, args.steps)
                times[name][0].extend(wall)
                times[name][1].extend(cpu)
        medians = {name: [statistics.median(t) * 1e3 for t in pair] for name, pair in times.items()}
        rows.append((f"{Path(path).name} {micro}x{accum} {precision}", medians["hand"], medians["ours"]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} rounds x "
          f"{args.steps} steps; median ms per optimizer step")
    print(f"{'workload':<26} {'hand wall':>10} {'ours wall':>10} {'ratio':>6}   "
          f"{'hand cpu':>9} {'ours cpu':>9} {'ratio':>6}")
    for name, hand, ours in rows:
        print(f"{name:<26} {hand[0]:>10.2f} {ours[0]:>10.2f} {ours[0] / hand[0]:>6.3f}   "
              f"{hand[1]:>9.2f} {ours[1]:>9.2f} {ours[1] / hand[1]:>6.3f}")
    print(f"\noptimizer step alone, alternating every step ({args.rounds * args.steps} steps each), "
          f"median CPU ms")
    print(f"{'workload':<26} {'hand cpu':>9} {'ours cpu':>9} {'ratio':>6}")
    for path, micro, accum, precision in CASES:
        ours, hand = interleaved_steps(load_workload(ROOT / path), micro, accum, precision,
                                       args.rounds * args.steps)
        ours_ms, hand_ms = statistics.median(ours), statistics.median(hand)
        print(f"{Path(path).name + f' {micro}x{accum} {precision}':<26} {hand_ms:>9.2f} "
              f"{ours_ms:>9.2f} {ours_ms / hand_ms:>6.3f}")


if __name__ == "__main__":
    main()
