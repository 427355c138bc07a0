"""A model file for the out-of-memory restart tests: three sharded blocks and a head (float64).

``AUTOTUNE_TEST_OOM=RANK:CALL:PHASE`` makes rank RANK run out of memory (torch.OutOfMemoryError,
what the CUDA allocator and the CPU memory backend raise) in the CALL-th forward of the middle
block (PHASE ``forward``) or in its backward (``backward``), or in the CALL-th call of the loss
function before it calls the model (``before``: a batch's copy to the device, an augmentation on
it), in torchrun's first attempt only.
``AUTOTUNE_TEST_KILL=RANK:CALL`` makes rank RANK SIGKILL itself in its CALL-th forward of the
model (first attempt only); ``AUTOTUNE_TEST_SLOW=S`` sleeps S seconds in every forward;
``AUTOTUNE_TEST_WAIT_FOR=PATH`` holds every forward until PATH exists (at most 120 s).
"""

import os
import signal
import time

import torch
from fsdp_model import build_optimizer  # noqa: F401 - the model-file contract's other one
from fsdp_model import loss_fn as _model_loss
from torch import nn

_calls = []


def _fault(where=("forward", "backward")):
    spec = os.environ.get("AUTOTUNE_TEST_OOM")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    rank, call, phase = spec.split(":")
    if phase not in where:
        return None
    _calls.append(1)
    return phase if int(rank) == int(os.environ.get("RANK", "0")) and len(_calls) == int(call) else None


def loss_fn(model, batch):
    if _fault(where=("before",)) == "before":
        raise _out_of_memory("the loss function, before the model")
    return _model_loss(model, batch)


def _out_of_memory(where):
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in {where})")


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise _out_of_memory("backward")


class Block(nn.Module):
    def __init__(self, width_in, width_out, faulty=False):
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.faulty = faulty

    def forward(self, x):
        x = torch.tanh(self.linear(x))
        phase = _fault() if self.faulty else None
        if phase == "forward":
            raise _out_of_memory("forward")
        return _FailInBackward.apply(x) if phase == "backward" else x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(6, 16), Block(16, 16, faulty=True), Block(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        _kill_or_slow()
        return self.head(self.blocks(x))


_forwards = []


def _kill_or_slow():
    time.sleep(float(os.environ.get("AUTOTUNE_TEST_SLOW", "0")))
    gate, deadline = os.environ.get("AUTOTUNE_TEST_WAIT_FOR"), time.time() + 120
    while gate and not os.path.exists(gate) and time.time() < deadline:
        time.sleep(0.05)
    spec = os.environ.get("AUTOTUNE_TEST_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, call = map(int, spec.split(":"))
    _forwards.append(1)
    if rank == int(os.environ.get("RANK", "0")) and len(_forwards) == call:
        os.kill(os.getpid(), signal.SIGKILL)


def build_model():
    return Model().double()


def make_batch(batch_size):
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (batch_size,), generator=generator))


def build_dataset():
    return torch.utils.data.TensorDataset(*make_batch(48))
