"""Probing side by side: autotune, Lightning's batch-size finder, Accelerate's, and the exact answer.

Every tool does a real training step of the same workload on the CPU under the same memory budget:
each tool's run happens inside a fresh ``CPUMemoryBackend`` tracking context, which counts live
tensor-storage bytes and raises ``torch.OutOfMemoryError`` ("DefaultCPUAllocator: can't allocate
memory ...", the message Lightning and Accelerate recognise) when the budget is passed.

Tools
  autotune    ``autotune.probe(workload, backend=CPUMemoryBackend(memory_limit=...))``
  lightning   ``Tuner(trainer).scale_batch_size(module, mode="binsearch")``, run as shipped
              (init_val=2, steps_per_trial=3, margin=0.05, max_val=8192) with max_trials=100
  accelerate  ``find_executable_batch_size(starting_batch_size=8192)`` around a function that builds
              the model and optimizer and runs one steady-state step (×0.9 after each OOM)
  exact       a plain doubling-then-bisection over real steady-state steps (optimizer state
              allocated, forward, backward, clip, step), written here independently of autotune

Counted per tool: the batch found and found/exact, training steps (forward passes of the model,
counted by a forward pre-hook), out-of-memory events (budget breaches raised by the tracker),
seconds, and seconds relative to autotune's.

    python bench/probe_compare.py              # plain table
    python bench/probe_compare.py --markdown   # the same table as markdown
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

import autotune
from autotune.memory.cpu import CPUMemoryBackend, StorageTracker
from autotune.memory.oom import is_oom_error
from autotune.workload.contract import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent
CLIP_NORM = 1.0
"""Gradient clipping in every tool's step, as in autotune's trial."""
LIGHTNING_MAX_TRIALS = 100
"""Lightning's default is 25 successful trials; generous so it always converges."""
ACCELERATE_START = 8192
"""Accelerate's starting batch size: the top of Lightning's search range (its max_val)."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    path: str
    memory_limit: str
    shape: str
    """How peak memory grows with the batch (the issue's targets differ for linear growth)."""


CASES = (
    Case("mlp", "examples/mlp.py", "64MiB", "linear"),
    Case("cnn_bn", "examples/cnn_bn.py", "64MiB", "linear"),
    Case("tiny_lm", "examples/tiny_lm.py", "512MiB", "linear"),
)
TOOLS = ("autotune", "lightning", "accelerate", "exact")


# --- measuring: one budget, counted forward passes and OOM events -------------------------------

class CountingTracker(StorageTracker):
    """autotune's storage tracker, counting budget breaches (out-of-memory events)."""

    def __init__(self, budget_bytes):
        super().__init__(budget_bytes)
        self.oom_events = 0

    def add(self, tensor) -> None:
        try:
            super().add(tensor)
        except torch.OutOfMemoryError:
            self.oom_events += 1
            raise


def fresh_backend(memory_limit: str) -> CPUMemoryBackend:
    backend = CPUMemoryBackend(memory_limit=memory_limit)
    backend.tracker = CountingTracker(backend.info().budget_bytes)
    return backend


class ForwardCounter:
    """Counts forward passes of every model built through ``factory``: real ones in ``count``,
    passes on fake tensors (autotune's estimate, nothing allocated or computed) in ``fake``."""

    def __init__(self, factory):
        self._factory = factory
        self.count = 0
        self.fake = 0

    def _hook(self, module, args):
        if any(isinstance(leaf, FakeTensor) for leaf in tree_flatten(args)[0]):
            self.fake += 1
        else:
            self.count += 1

    def build(self) -> torch.nn.Module:
        model = self._factory()
        model.register_forward_pre_hook(self._hook)
        return model


@dataclasses.dataclass
class Outcome:
    tool: str
    found: int | None
    steps: int
    ooms: int
    seconds: float
    note: str = ""
    cpu_seconds: float = 0.0
    """CPU time of this process (all threads): less sensitive than wall time to other load."""


def steady_step(workload: Workload, model, optimizer, params, n: int) -> None:
    """One training step at n samples: forward, backward, clip, optimizer step, zero_grad."""
    batch = workload.batch(n)
    loss, count = workload.loss(model, batch)
    if count is not None:
        loss = loss / count
    loss.backward()
    del loss, batch
    torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build_with_state(workload: Workload, counter: ForwardCounter):
    """Model and optimizer with the optimizer state already allocated (a step on zero gradients)."""
    model = counter.build()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = workload.new_optimizer(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, params


# --- the tools ------------------------------------------------------------------------------------

def run_autotune(workload: Workload, memory_limit: str) -> Outcome:
    backend = fresh_backend(memory_limit)
    counter = ForwardCounter(workload.model)
    counted = dataclasses.replace(workload, model=counter.build)
    start = time.perf_counter()
    result = autotune.probe(counted, backend=backend)
    seconds = time.perf_counter() - start
    notes = []
    if counter.fake:
        notes.append(f"{counter.fake} forward passes on fake tensors first (the estimate: nothing "
                     f"allocated; its time is in the seconds)")
    if len(result.trials) != counter.count or result.oom_count != backend.tracker.oom_events:
        notes.append(f"autotune reports {len(result.trials)} trials / {result.oom_count} OOMs, "
                     f"counted {counter.count} / {backend.tracker.oom_events}")
    note = "; ".join(notes)
    return Outcome("autotune", result.max_micro_batch, counter.count, backend.tracker.oom_events,
                   seconds, note=note)


def run_exact(workload: Workload, memory_limit: str) -> Outcome:
    """Doubling from 1 until a step fails, then bisection: the largest n whose step fits."""
    backend = fresh_backend(memory_limit)
    counter = ForwardCounter(workload.model)
    start = time.perf_counter()
    with backend.tracking():
        model, optimizer, params = build_with_state(workload, counter)

        def fits(n: int) -> bool:
            failed = False
            try:
                steady_step(workload, model, optimizer, params, n)
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                failed = True
            if failed:  # outside the except block: the traceback no longer pins the step's tensors
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
            return not failed

        lo, hi = 0, None
        n = 1
        while hi is None:
            if fits(n):
                lo, n = n, n * 2
            else:
                hi = n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        del model, optimizer, params
        gc.collect()
    return Outcome("exact", lo, counter.count, backend.tracker.oom_events, time.perf_counter() - start)


def run_accelerate(workload: Workload, memory_limit: str, starting_batch_size: int) -> Outcome:
    from accelerate.utils import find_executable_batch_size

    backend = fresh_backend(memory_limit)
    counter = ForwardCounter(workload.model)
    start = time.perf_counter()
    with backend.tracking():
        @find_executable_batch_size(starting_batch_size=starting_batch_size)
        def train(batch_size):
            model, optimizer, params = build_with_state(workload, counter)
            steady_step(workload, model, optimizer, params, batch_size)
            return batch_size

        found = train()
    return Outcome("accelerate", found, counter.count, backend.tracker.oom_events,
                   time.perf_counter() - start, note=f"starting_batch_size={starting_batch_size}")


class PoolDataset(torch.utils.data.Dataset):
    """Samples cycled from one ``make_batch`` pool; collating n of them gives a batch of n."""

    def __init__(self, workload: Workload, pool_size: int = 256, length: int = 1 << 20):
        self.pool = workload.batch(pool_size)
        self.pool_size = pool_size
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return _select(self.pool, index % self.pool_size)


def _select(batch, i):
    if isinstance(batch, torch.Tensor):
        return batch[i]
    if isinstance(batch, dict):
        return {k: _select(v, i) for k, v in batch.items()}
    return type(batch)(_select(v, i) for v in batch)


def run_lightning(workload: Workload, memory_limit: str) -> Outcome:
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    class BenchModule(L.LightningModule):
        def __init__(self, model, dataset, batch_size=2):
            super().__init__()
            self.model = model
            self.dataset = dataset
            self.batch_size = batch_size

        def training_step(self, batch, batch_idx):
            loss, count = workload.loss(self.model, batch)
            return loss / count if count is not None else loss

        def configure_optimizers(self):
            return workload.new_optimizer(self.model.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            nonlocal largest_step
            largest_step = max(largest_step, self.batch_size)

    largest_step = 0  # the largest batch size whose step completed: Lightning's answer before its margin
    dataset = PoolDataset(workload)  # host-side data, built before tracking: not device memory
    backend = fresh_backend(memory_limit)
    counter = ForwardCounter(workload.model)
    start = time.perf_counter()
    with backend.tracking(), tempfile.TemporaryDirectory() as root:
        module = BenchModule(counter.build(), dataset)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            gradient_clip_val=CLIP_NORM, default_root_dir=root,
        )
        _host_side_checkpoints(trainer, backend)
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch",
                                                 max_trials=LIGHTNING_MAX_TRIALS)
        del module, trainer
        gc.collect()
    return Outcome("lightning", found, counter.count, backend.tracker.oom_events,
                   time.perf_counter() - start, note=f"largest step that fit {largest_step}; "
                   f"found = that less its default 5% margin" if largest_step != found else "")


def _host_side_checkpoints(trainer, backend: CPUMemoryBackend) -> None:
    """The finder saves the model before searching and restores it after: on a GPU that checkpoint
    lives in host RAM, not device memory, so here it is not charged to the budget either."""
    def unbudgeted(fn):
        def wrapper(*args, **kwargs):
            with backend.unlimited():
                return fn(*args, **kwargs)
        return wrapper

    trainer.save_checkpoint = unbudgeted(trainer.save_checkpoint)
    connector = trainer._checkpoint_connector
    connector.restore = unbudgeted(connector.restore)


# --- running and reporting ---------------------------------------------------------------------

def warm_up(workload: Workload) -> None:
    """Untimed steps first, so the tool that happens to run first does not pay torch's warm-up."""
    model, optimizer, params = build_with_state(workload, ForwardCounter(workload.model))
    for n in (1, 2, 8):
        steady_step(workload, model, optimizer, params, n)
    del model, optimizer, params
    gc.collect()


def run_case(case: Case, tools, accelerate_start: int, log) -> list[Outcome]:
    workload = load_workload(ROOT / case.path)
    warm_up(workload)
    outcomes = []
    for tool in tools:
        log(f"  {case.name}: {tool} ...")
        cpu_start = time.process_time()
        if tool == "autotune":
            outcome = run_autotune(workload, case.memory_limit)
        elif tool == "lightning":
            outcome = run_lightning(workload, case.memory_limit)
        elif tool == "accelerate":
            outcome = run_accelerate(workload, case.memory_limit, accelerate_start)
        else:
            outcome = run_exact(workload, case.memory_limit)
        outcome.cpu_seconds = time.process_time() - cpu_start
        gc.collect()
        log(f"  {case.name}: {tool}: found {outcome.found}, {outcome.steps} steps, "
            f"{outcome.ooms} OOMs, {outcome.seconds:.1f}s ({outcome.cpu_seconds:.1f}s CPU)")
        outcomes.append(outcome)
    return outcomes


HEADER = ("workload", "budget", "tool", "found", "exact", "found/exact", "steps", "OOMs", "seconds",
          "CPU seconds", "time vs autotune (wall / CPU)")


def table_rows(results):
    rows = []
    for case, outcomes in results:
        by_tool = {o.tool: o for o in outcomes}
        exact = by_tool.get("exact")
        ours = by_tool.get("autotune")
        for o in outcomes:
            ratio = f"{o.found / exact.found:.3f}" if exact and exact.found and o.found else "-"
            vs = (f"{o.seconds / ours.seconds:.1f}x / {o.cpu_seconds / ours.cpu_seconds:.1f}x"
                  if ours and ours.seconds and ours.cpu_seconds else "-")
            rows.append((case.name, case.memory_limit, o.tool, str(o.found),
                         str(exact.found) if exact else "-", ratio, str(o.steps), str(o.ooms),
                         f"{o.seconds:.1f}", f"{o.cpu_seconds:.1f}", vs))
    return rows


def format_plain(rows) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(HEADER), line(["-" * w for w in widths]), *map(line, rows)])


def format_markdown(rows) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] * len(HEADER)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def targets(results) -> list[str]:
    """The issue's targets, each with whether this run met it."""
    lines = []
    for case, outcomes in results:
        by_tool = {o.tool: o for o in outcomes}
        ours, exact, light = by_tool.get("autotune"), by_tool.get("exact"), by_tool.get("lightning")
        if ours is None:
            continue
        checks = []
        if exact:
            checks.append((f"found/exact = 1.000 ({ours.found}/{exact.found})", ours.found == exact.found))
        if case.shape == "linear":
            checks.append((f"<= 6 steps ({ours.steps})", ours.steps <= 6))
            checks.append((f"<= 1 OOM ({ours.ooms})", ours.ooms <= 1))
        checks.append((f"<= 10 steps ({ours.steps})", ours.steps <= 10))
        if light:
            checks.append((f"time <= 1/5 of Lightning's (wall {ours.seconds:.1f}s vs {light.seconds:.1f}s)",
                           ours.seconds * 5 <= light.seconds))
            checks.append((f"CPU time <= 1/5 of Lightning's ({ours.cpu_seconds:.1f}s vs "
                           f"{light.cpu_seconds:.1f}s)", ours.cpu_seconds * 5 <= light.cpu_seconds))
        for text, ok in checks:
            lines.append(f"{case.name}: {'met' if ok else 'NOT met'}: {text}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--workloads", nargs="+", choices=[c.name for c in CASES],
                        default=[c.name for c in CASES])
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--accelerate-start", type=int, default=ACCELERATE_START,
                        help=f"Accelerate's starting_batch_size (default {ACCELERATE_START})")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    results = []
    for case in CASES:
        if case.name in args.workloads:
            with contextlib.redirect_stdout(sys.stderr):  # keep the tools' chatter off the table
                outcomes = run_case(case, args.tools, args.accelerate_start, log)
            results.append((case, outcomes))
    rows = table_rows(results)
    print(format_markdown(rows) if args.markdown else format_plain(rows))
    notes = [f"{case.name}/{o.tool}: {o.note}" for case, outcomes in results for o in outcomes if o.note]
    print()
    for line in targets(results) + notes:
        print(f"- {line}" if args.markdown else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
