"""Launched by `accelerate launch --config_file EXPORT` in test_export: trains a small MLP with the
exported Accelerator and DataLoader arguments and writes, per rank, what Accelerate ran.

    accelerate launch --config_file accelerate.json accelerate_train_script.py script.json OUT
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from autotune.distributed.collectives import settle

SAMPLES, FEATURES = 256, 8


def build():
    """The model and data (the test trains the same in one process for reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, FEATURES, generator=generator),
                                          torch.randint(0, 2, (SAMPLES,), generator=generator))
    return model, data


def main(script_path: str, out: str) -> None:
    exported = json.loads(Path(script_path).read_text())
    accelerator = Accelerator(**exported["accelerator"])
    model, data = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(data, **exported["dataloader"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen, per_step = 0, []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            seen += len(x)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                per_step.append(int(accelerator.reduce(torch.tensor(seen), reduction="sum")))
                seen = 0
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps({
        "distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1],
        "processes": accelerator.num_processes, "samples_per_step": per_step,
        "weights": weights.tolist()}))
    # gloo's worker threads may still hold the last collective's tensors; a rank that exits then
    # aborts at interpreter shutdown ("terminate called without an active exception").
    settle()


if __name__ == "__main__":
    main(*sys.argv[1:])
