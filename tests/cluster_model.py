"""A model file for the cluster tests (tests/test_multinode.py, tests/test_ray_train.py): a small
float64 MLP, 48 samples.

``AUTOTUNE_TEST_KILL_ONCE=MARKER:RANK:CALL`` makes rank RANK SIGKILL itself in its CALL-th forward,
once: it creates the file MARKER first, and a process that finds MARKER does not kill itself (so
the restarted run goes on). ``AUTOTUNE_TEST_SLOW=S`` sleeps S seconds in every forward.
"""

import os
import signal
import time

import torch
from torch import nn

_forwards = []


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        _kill_or_slow()
        return self.head(self.blocks(x))


def _kill_or_slow():
    time.sleep(float(os.environ.get("AUTOTUNE_TEST_SLOW", "0")))
    spec = os.environ.get("AUTOTUNE_TEST_KILL_ONCE")
    if not spec:
        return
    marker, rank, call = spec.rsplit(":", 2)
    _forwards.append(1)
    if int(rank) != int(os.environ.get("RANK", "-1")) or len(_forwards) != int(call):
        return
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def build_model():
    return Model().double()


def make_batch(batch_size):
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (batch_size,), generator=generator))


def build_dataset():
    return torch.utils.data.TensorDataset(*make_batch(48))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)
