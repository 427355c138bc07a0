"""Causal attention is counted at the FLOPs its kernel computes: the pairs the causal mask keeps.

torch's flop counter counts every scaled_dot_product_attention at its whole L × S square; flash and
memory-efficient kernels skip the masked blocks of a causal one, and the attention rates the
roofline divides by (FlashAttention-2's benchmark, this CPU's microbenchmark) are rates of the
FLOPs so counted. Before, a causal model's attention was timed at twice its work on a GPU profile,
and a context-parallel layout (whose ring skips the chunks above the diagonal) ranked ahead of
one that was not by that bias.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional

from autotune import Workload
from autotune.gpus.target import profile_target
from autotune.timing.costs import causal_share
from autotune.timing.count import count_step_costs

HEADS, LENGTH, HEAD_DIM = 2, 12, 8
H100 = profile_target("h100-80gb").profile.name


class _Attention(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM, bias=False)

    def forward(self, x):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, LENGTH, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if self.mode == "causal":
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mode == "mask":  # the same mask as a tensor: the kernel computes every pair
            keep = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=x.device).tril()
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            out = functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(n, LENGTH, HEADS * HEAD_DIM)


def _workload(mode: str) -> Workload:
    def build():
        return _Attention(mode)

    build.__name__ = f"attention_{mode}"
    return Workload(model=build, make_batch=lambda n: torch.randn(n, LENGTH, HEADS * HEAD_DIM),
                    loss_fn=lambda model, batch: model(batch).float().sum(),
                    build_optimizer=lambda params: torch.optim.SGD(params, lr=0.1), source=build.__name__)


def _attention_flops(mode: str, **kwargs) -> dict:
    costs = count_step_costs(_workload(mode), 2, **kwargs)
    flops = {}
    for op in costs.ops:
        if op.op_class == "attention":
            flops[op.phase] = flops.get(op.phase, 0.0) + op.flops
    return flops


def test_the_share_a_causal_mask_keeps():
    assert causal_share(4, 4) == 10 / 16
    assert causal_share(1, 5) == 1 / 5  # the one query sees the first key only
    assert causal_share(5, 3) == (6 + 2 * 3) / 15  # queries past the keys see them all
    assert causal_share(8192, 8192) == pytest.approx(0.5, abs=1e-4)


@pytest.mark.parametrize("for_gpu", [None, H100])
def test_causal_attention_counts_the_pairs_its_mask_keeps(for_gpu):
    settings = dict(for_gpu=for_gpu, precision="bf16" if for_gpu else "fp32")
    whole = _attention_flops("full", **settings)
    causal = _attention_flops("causal", **settings)
    masked = _attention_flops("mask", **settings)
    assert set(whole) == {"forward", "backward"} and all(whole.values())
    for phase in whole:
        assert causal[phase] == pytest.approx(whole[phase] * causal_share(LENGTH, LENGTH), rel=1e-12)
        assert masked[phase] == whole[phase]  # a mask tensor skips nothing


def test_causal_and_other_attention_are_timed_as_two_kernel_families():
    # A causal kernel's rate per counted FLOP is its own (at 128 tokens this CPU's flash kernel
    # does the whole square's work under is_causal): the counts tell the two apart.
    def kernels(mode: str) -> set:
        return {(op.kernel, op.phase) for op in count_step_costs(_workload(mode), 2).ops
                if op.op_class == "attention"}

    assert kernels("causal") == {("attention_causal", "forward"), ("attention_causal_backward", "backward")}
    assert kernels("mask") == kernels("full") == {("attention", "forward"), ("attention_backward", "backward")}
