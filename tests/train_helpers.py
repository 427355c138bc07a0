"""Tiny float64 workloads and plans for the training-loop tests (fast on two CPU cores)."""

from __future__ import annotations

import torch
from torch import nn

from autotune.planning.types import LRDecision, Plan, WorkloadFingerprint
from autotune.workload.contract import Workload

FEATURES, HIDDEN, CLASSES = 6, 8, 3


def make_plan(micro_batches, *, world_size=1, precision="fp32", lr=None, warmup=0, clip=None,
              sha=None) -> Plan:
    return Plan(
        target_batch=sum(micro_batches) * world_size, world_size=world_size,
        micro_batches=list(micro_batches), precision=precision, checkpointing=False,
        lr=LRDecision(rule="none", lr=lr, warmup_steps=warmup), clip_grad_norm=clip,
        workload=WorkloadFingerprint(source="tests", file_sha256=sha, param_count=0, param_bytes=0),
        versions={"autotune": "test", "torch": torch.__version__, "cuda": None},
    )


def build_mlp(dropout=0.0, dtype=torch.float64):
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(HIDDEN, CLASSES)).to(dtype)


def classification_data(n, dtype=torch.float64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator, dtype=dtype)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def mean_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def mlp_workload(n=64, *, dropout=0.0, optimizer="sgd", dtype=torch.float64, loss_fn=mean_loss,
                 model=None) -> Workload:
    dataset = classification_data(n, dtype)
    return Workload(
        model=model or (lambda: build_mlp(dropout, dtype)),
        make_batch=lambda b: tuple(t[:b] for t in classification_data(b, dtype).tensors),
        loss_fn=loss_fn,
        build_optimizer=_optimizer(optimizer),
        build_dataset=lambda: dataset,
    )


def _optimizer(kind):
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    return lambda params: torch.optim.AdamW(params, lr=1e-2)


# -- a token-level workload: per-position classification with padding ---------------------------
SEQ = 10


def token_data(n, seed=2):
    """Sequences whose real lengths vary from 1 to SEQ (mask marks the real positions)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (n, SEQ), generator=generator)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=generator)
    lengths[: n // 2] = 1  # very uneven token counts across micro-batches
    mask = torch.arange(SEQ) < lengths[:, None]
    return torch.utils.data.TensorDataset(x, y, mask)


def token_loss(model, batch):
    x, y, mask = batch
    losses = nn.functional.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
    return (losses * mask).sum(), mask.sum()


def token_workload(n=32) -> Workload:
    dataset = token_data(n)
    return Workload(model=lambda: build_mlp(), make_batch=lambda b: dataset[:b],
                    loss_fn=token_loss, build_optimizer=_optimizer("sgd"),
                    build_dataset=lambda: dataset)


def params_of(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def initial_params(workload, seed=0):
    torch.manual_seed(seed)
    return params_of(workload.new_model())


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


class OOMOnce(torch.nn.Module):
    """Wraps a model; raises torch.OutOfMemoryError from forward at the chosen calls."""

    def __init__(self, inner, *, fail_at=(), fail_above=None):
        super().__init__()
        self.inner = inner
        self.fail_at, self.fail_above, self.calls = set(fail_at), fail_above, 0

    def forward(self, x):
        self.calls += 1
        if self.calls in self.fail_at or (self.fail_above is not None and x.shape[0] > self.fail_above):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.inner(x)
