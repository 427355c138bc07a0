"""A model file for the cluster tests (tests/test_multinode.py, tests/test_ray_train.py): a small
float64 MLP, 48 samples.

``AUTOTUNE_TEST_KILL_ONCE=MARKER:RANK:CALL`` makes rank RANK SIGKILL itself in its CALL-th forward,
once: it creates the file MARKER first, and a process that finds MARKER does not kill itself (so
the restarted run goes on). ``AUTOTUNE_TEST_KILL_DELAY=S`` waits S seconds before that kill (so a
supervisor that polls its workers, as Ray's controller does every 2 s, has seen the checkpoints
reported before it). ``AUTOTUNE_TEST_SLOW=S`` sleeps S seconds in every forward.
"""

import os
import signal
import time

from fsdp_model import build_optimizer, loss_fn  # noqa: F401 - the model-file contract's other parts
from oom_restart_model import build_dataset, make_batch  # noqa: F401 - the same 48 float64 samples
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
    time.sleep(float(os.environ.get("AUTOTUNE_TEST_KILL_DELAY", "0")))
    os.kill(os.getpid(), signal.SIGKILL)


def build_model():
    return Model().double()
