"""What counting the CPU training peak costs, and whether it is the peak the probe measured.

For each example and micro-batch (no accumulation): one training step with and without the
tensor counting that
``autotune.training.metrics.PeakMeter`` does on counted CPU steps, alternating (so machine load
hits both alike); the median time ratio; and the counted steady-state peak beside the peak a probe
trial measures at the same micro-batch (the number the plan predicts from).

    python bench/peak_counting.py --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.memory import CPUMemoryBackend  # noqa: E402
from autotune.precision import Precision  # noqa: E402
from autotune.probing.trial import TrialSession  # noqa: E402
from autotune.training.metrics import PeakMeter  # noqa: E402
from autotune.units import format_bytes  # noqa: E402
from autotune.workload.contract import load_workload  # noqa: E402

CASES = [("examples/tiny_lm.py", 8), ("examples/tiny_lm.py", 32), ("examples/mlp.py", 64),
         ("examples/cnn_bn.py", 32)]


def _step(workload, model, optimizer, batch):
    loss, count = workload.loss(model, batch)
    (loss if count is None else loss / count).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(path: str, n: int, rounds: int) -> list:
    workload = load_workload(ROOT / path)
    torch.manual_seed(0)
    model = workload.new_model()
    optimizer = workload.new_optimizer(model.parameters())
    _step(workload, model, optimizer, workload.batch(n))  # optimizer state allocated: steady now
    meter = PeakMeter(torch.device("cpu"), total_steps=1)  # step 1 of 1: always counted
    live = lambda: [*model.parameters(), *model.buffers(),  # noqa: E731
                    *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    counted, plain = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        meter.counted = 0
        with meter.step(1, live()):
            # The batch is made inside, as the loop's slice of a window is: both count it.
            _step(workload, model, optimizer, workload.batch(n))
        counted.append(time.perf_counter() - start)
        start = time.perf_counter()
        _step(workload, model, optimizer, workload.batch(n))
        plain.append(time.perf_counter() - start)
    with TrialSession(workload, CPUMemoryBackend(), precision=Precision.FP32, checkpointing=False) as s:
        probed = s.run(n).peak_bytes
    ratio = statistics.median(counted) / statistics.median(plain)
    return [path, n, f"{ratio:.2f}", format_bytes(meter.peak), format_bytes(probed),
            f"{meter.peak / probed:.4f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    headers = ["model", "micro-batch", "counted/plain time", "counted peak", "probe peak", "ratio"]
    rows = [measure(path, n, args.rounds) for path, n in CASES]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
