"""examples/tiny_lm.py at a tenth of the size, for the torch.compile tests: compiling it on 2
loaded cores takes seconds, not minutes.

``COMPILED`` set in the environment (a backend name): build_model() returns
``torch.compile(model, backend=COMPILED)`` itself, as a user's model file does. ``CRASH_ON_FAKE``
set: building the model on fake tensors kills the process with SIGSEGV, as tracing a compiled
graph on fake tensors did (issue 20).
"""

import importlib.util
import os
import signal
from pathlib import Path

import torch

# Our own copy of the example module (not the one other tests import), made smaller: its
# classes read these constants when they are built and run.
_spec = importlib.util.spec_from_file_location(
    "compile_model_tiny_lm", Path(__file__).resolve().parent.parent / "examples" / "tiny_lm.py")
tiny_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_lm)
tiny_lm.VOCAB, tiny_lm.SEQ_LEN, tiny_lm.DIM, tiny_lm.HEADS, tiny_lm.LAYERS = 64, 16, 32, 2, 2

make_batch, loss_fn, build_optimizer = tiny_lm.make_batch, tiny_lm.loss_fn, tiny_lm.build_optimizer


def build_model() -> torch.nn.Module:
    if os.environ.get("CRASH_ON_FAKE") and isinstance(torch.empty(0), torch._subclasses.FakeTensor):
        os.kill(os.getpid(), signal.SIGSEGV)
    model = tiny_lm.TinyLM()
    backend = os.environ.get("COMPILED")
    return torch.compile(model, backend=backend) if backend else model
