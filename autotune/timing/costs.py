"""What one training step costs, counted op by op on fake tensors: pure data, no device.

``StepCosts`` is what ``count.count_step_costs`` records and what ``roofline.compute_time`` (and
the communication model) turn into seconds. Bytes are bytes moved: every input an op reads and
every output it writes; a collective's bytes are its full (gathered / unscattered) buffer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

OP_CLASSES = ("matmul", "attention", "elementwise", "optimizer", "other")
"""matmul: mm/addmm/bmm/convolution and their backward; attention: scaled_dot_product_* kernels;
elementwise: every other op that moves data (pointwise, reductions, norms, softmax, indexing);
optimizer: every op of the optimizer phase (unscale, clip, step, zero_grad); other: ops that move
no data (views, aliases, empty tensors), which cost only their dispatch."""

PHASES = ("forward", "backward", "recompute", "optimizer")
"""recompute: the forward of checkpointed blocks run again during backward."""

KERNELS = ("mm", "convolution", "convolution_backward", "attention", "attention_backward",
           "attention_causal", "attention_causal_backward",
           "pooling", "pooling_backward", "batch_norm", "batch_norm_backward", "layer_norm",
           "layer_norm_backward", "softmax", "softmax_backward", "embedding", "embedding_backward",
           "nll_loss", "nll_loss_backward", "gelu", "gelu_backward", "silu", "silu_backward",
           "inplace")
"""Kernel families a device's speed can tell apart: of the FLOP-counted ops (a CPU runs a
convolution's backward or a small attention far below its matmul rate; a causal attention,
counted at the pairs its mask keeps, at its own rate), and of the memory-bound ones (a CPU's
pooling and batch norm kernels move far fewer bytes per second than an add; so do its layer norm,
softmax, embedding and loss kernels, and GELU and SiLU, whose arithmetic per element a CPU core
does not hide; in-place ops, which write where they read, more)."""

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv",
                    "all_to_all")


@dataclass(frozen=True)
class OpCost:
    """``count`` calls of ops alike in class, phase, FLOPs and bytes; ``flops`` and ``bytes`` are
    the totals of all ``count`` calls (``flops / count`` is one call's)."""

    op_class: str
    phase: str
    flops: float
    bytes: float
    count: int
    kernel: str = ""
    """The kernel family where a device's speed can tell them apart (``KERNELS``); "" else."""
    fresh: float = 0.0
    """Of ``bytes``, those written to new tensors (outputs that alias no input), all ``count``
    calls: where a forward (or recomputed) op writes them the memory is out of cache
    (``roofline.COLD_WRITE_PHASES``)."""

    def __post_init__(self):
        _check_choice("op_class", self.op_class, OP_CLASSES)
        _check_choice("phase", self.phase, PHASES)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective this rank issues: ``bytes`` of the full buffer, over ``group_size`` ranks."""

    kind: str
    bytes: int
    group_size: int
    phase: str
    ring: bool = False
    """Context parallelism's ring attention issued it (its key/value all-gather, its gradients'
    all-to-alls): each waits for the next ring step's attention, which hides it."""

    def __post_init__(self):
        _check_choice("collective kind", self.kind, COLLECTIVE_KINDS)
        _check_choice("phase", self.phase, PHASES)


@dataclass
class StepCosts:
    """Every op and collective of one steady-state training step at ``micro_batch`` samples
    (``tokens``: the tokens in that micro-batch where the batch has a sequence dimension)."""

    ops: tuple[OpCost, ...]
    collectives: tuple[CollectiveCall, ...]
    micro_batch: int
    tokens: int | None = None
    module_calls: dict[str, int] = field(default_factory=dict)
    """``nn.Module`` calls per phase ("forward", "recompute"): each costs its Python ``__call__``
    beyond the ops it dispatches."""
    checkpoint_blocks: int = 0
    """Checkpointed blocks recomputed in backward: each costs checkpoint's own set-up (its hooks,
    the recompute's entry) beyond its ops."""
    sharded_units: int = 0
    """FSDP2 units (``fully_shard``-ed modules, the root included) of a sharded step: each costs
    its pre/post forward and backward hooks' Python every micro-step, beyond the ops they
    dispatch (copy-in, copy-out, views: counted as ops)."""
    sharded_params: int = 0
    """Parameters those units shard: FSDP2's hooks handle each one (its all-gather input, its
    unsharded view, its sharded gradient) every micro-step."""
    dtensor_ops: dict[str, int] = field(default_factory=dict)
    """Ops the real step dispatches on DTensors, per phase (the optimizer's and the clipping's
    on FSDP2's sharded parameters, counted on their local shards where the fake step steps
    those): each pays DTensor's dispatch beyond its local op."""
    dtensor_list_tensors: dict[str, int] = field(default_factory=dict)
    """DTensors passed in tensor lists to those ops (the foreach ops of clipping), per phase:
    DTensor unwraps and wraps each one."""
    optimizer_calls: tuple[tuple, ...] = ()
    """The optimizer phase's ops in the order they ran, one (op name, class, FLOPs, bytes,
    kernel, fresh bytes) per call (also in ``ops``): a foreach op's one call reads every
    parameter, so what it is called is what tells these calls apart as the model grows
    (``timing.extend``)."""

    @property
    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def total_bytes(self) -> float:
        return sum(op.bytes for op in self.ops)

    @property
    def op_count(self) -> int:
        return sum(op.count for op in self.ops)

    def flops_by(self, key: str) -> dict[str, float]:
        """FLOPs summed by ``"op_class"`` or ``"phase"``."""
        return self._sum_by(key, "flops")

    def bytes_by(self, key: str) -> dict[str, float]:
        """Bytes moved summed by ``"op_class"`` or ``"phase"``."""
        return self._sum_by(key, "bytes")

    def count_by(self, key: str) -> dict[str, int]:
        """Op calls summed by ``"op_class"`` or ``"phase"``."""
        return self._sum_by(key, "count")

    def collective_bytes_by_kind(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for call in self.collectives:
            totals[call.kind] += call.bytes
        return dict(totals)

    def _sum_by(self, key: str, field: str) -> dict:
        if key not in ("op_class", "phase"):
            raise ValueError(f"StepCosts sums by 'op_class' or 'phase', not {key!r}")
        totals: dict = defaultdict(int)
        for op in self.ops:
            totals[getattr(op, key)] += getattr(op, field)
        return dict(totals)


def _check_choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {allowed}")


def causal_share(queries: int, keys: int) -> float:
    """The share of a queries × keys attention score matrix a top-left causal mask keeps (query i
    sees keys 0..i, ``torch.ones(L, S).tril()`` in scaled_dot_product_attention's docs): the
    FLOPs a causal flash or memory-efficient kernel computes of the whole square's."""
    if queries <= 0 or keys <= 0:
        return 1.0
    if queries <= keys:
        kept = queries * (queries + 1) // 2
    else:
        kept = keys * (keys + 1) // 2 + (queries - keys) * keys
    return kept / (queries * keys)


__all__ = ["COLLECTIVE_KINDS", "CollectiveCall", "KERNELS", "OP_CLASSES", "OpCost", "PHASES", "StepCosts",
           "causal_share"]
