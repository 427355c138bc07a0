"""Context parallelism: every sequence sharded over the cp ranks, attention as torch's ring attention.

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) shards a batch's
sequence-dimension tensors over a cp mesh, load-balanced head and tail (rank r of c holds chunks
r and 2c-1-r of 2c), and turns ``torch.nn.functional.scaled_dot_product_attention`` into ring
attention over the cp ranks. The same code runs in the estimate (a fake process group and fake
tensors), the probe (real ranks) and the training loop: ``context_parallel_step`` gives them a
workload whose loss shards each batch and whose attention rings, for as long as it is entered.

Three things differ from ``context_parallel()`` itself:

- Ring attention stays on from the first forward to the end of the step (the context manager
  turns it off when left; a backward, and the recomputation of checkpointed blocks in it, run
  attention too), so it is a session, not a per-forward context.
- torch's ring attention handles the CUDA kernels only (flash, memory-efficient, cuDNN); on the
  CPU, SDPA dispatches ``aten._scaled_dot_product_flash_attention_for_cpu`` and DTensor raises
  "does not have a sharding strategy registered". The CPU kernel and its backward return the
  same (output, logsumexp) and take the same gradients, so they are registered here with torch's
  own ring (``_templated_ring_attention``) and sequence-sharding rules, as torch registers the
  CUDA ones. Fake CPU tensors take the same path, so the estimate counts the ring's buffers.
- Hugging Face causal LMs shift their labels inside the loss, which a sharded sequence would cut
  wrongly: their batches get ``shift_labels`` (shifted before sharding, as Hugging Face's own
  context-parallel training does), ``position_ids`` and a token-count loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch

from ..errors import ConfigError, LayoutUnsupported, given
from ..memory.oom import is_oom_error

SEQ_DIM = 1
"""A batch tensor's sequence dimension: (batch, sequence, ...), as ``make_batch(n, seq_len)``."""

_ATTENTION_SEQ_DIM = 2
"""The sequence dimension of SDPA's query, key and value: (batch, heads, sequence, head_dim)."""

IGNORE_INDEX = -100
"""The label Hugging Face's losses skip: the last position of every shifted sequence."""


def check_seq_len(seq_len: int, cp: int, *, option: str | None = "seq_len") -> None:
    """Load balancing splits each sequence into 2 × cp chunks: the length must divide evenly
    (torch would otherwise fall back silently to unbalanced contiguous shards). ``option``: the
    option that set the length (None: the batch's own)."""
    if cp > 1 and seq_len % (2 * cp):
        lower, upper = seq_len // (2 * cp) * 2 * cp, (seq_len // (2 * cp) + 1) * 2 * cp
        what = given(option, seq_len) if option else f"the batch's sequence length {seq_len}"
        raise ConfigError(f"{what} is not divisible by 2 × cp = {2 * cp}: context "
                          f"parallelism splits every sequence into 2 × cp load-balanced chunks; use "
                          f"a sequence length of {lower or upper} or {upper}, or another cp")


# -- the ring on the CPU kernel -----------------------------------------------------------------

def _cpu_kernels():
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    forward, _ = _cpu_kernels()
    return _templated_ring_attention(mesh.get_group(), _ATTENTION_SEQ_DIM, forward, query=query,
                                     key=key, value=value, is_causal=is_causal, dropout_p=dropout_p,
                                     attn_mask=attn_mask, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                   attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward)

    _, backward = _cpu_kernels()
    return _templated_ring_attention_backward(
        mesh.get_group(), _ATTENTION_SEQ_DIM, backward, grad_out=grad_out, grad_out_name="grad_out",
        query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal,
        dropout_p=dropout_p, attn_mask=attn_mask, scale=scale)


def _ring_handler(op_call, args, kwargs):
    """DTensor's handler for the CPU kernels: torch's ``_sdpa_handler`` with the CPU ring."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise RuntimeError(f"context parallel: {op_call} got inputs not sharded on the sequence")
    ring = _ring_forward if op_call == _cpu_kernels()[0] else _ring_backward
    _RINGS.running += 1
    try:
        local = ring(info.compute_mesh, *info.local_args, **info.local_kwargs)
    finally:
        _RINGS.running -= 1
    return dispatcher.wrap(local, sharding.output_spec)


def _sequence_sharded(count: int):
    """A sharding rule: every tensor (outputs, then inputs) sharded on the attention's sequence."""
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _cp_sharding

    def strategy(op, args_schema, kwargs_schema):
        return [[_cp_sharding() for _ in range(count)]]

    return strategy


def cpu_ring_available() -> bool:
    """Whether this torch has the sharding-rule hooks the CPU ring registers with (torch 2.14;
    2.13's context parallel module has neither)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._sharding_rules import (  # noqa: F401
            _cp_sharding, _single_dim_strategy_context)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _cpu_ring_kernels():
    """The CPU flash kernels dispatch to the ring while inside (see the module's docstring)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import (
        _single_dim_strategy_context)

    forward, backward = _cpu_kernels()
    dispatcher = DTensor._op_dispatcher
    with contextlib.ExitStack() as stack:
        # (output, logsumexp; query, key, value) and (3 gradients; grad_out, q, k, v, out, lse);
        # the scalars from dropout_p on are part of the cached sharding decision.
        stack.enter_context(_single_dim_strategy_context(forward, _sequence_sharded(5), RuntimeSchemaInfo(3)))
        stack.enter_context(_single_dim_strategy_context(backward, _sequence_sharded(9), RuntimeSchemaInfo(6)))
        saved = dispatcher._custom_op_handlers
        dispatcher._custom_op_handlers = {**saved, forward: _ring_handler, backward: _ring_handler}
        try:
            yield
        finally:
            dispatcher._custom_op_handlers = saved


# -- attention as ring attention, for a session -------------------------------------------------

class _Attention:
    """One session's ring (its cp ``mesh``, torch's SDPA input and output functions for it) and
    what the patched SDPA saw through it: the calls, and the first one ring attention cannot take."""

    def __init__(self, source: str, mesh, style):
        self.source = source
        self.mesh = mesh
        self.cp = mesh.size()
        self.calls = 0
        self.checked_input = self.input_fn(style.sdpa_input_fn)
        self.output_fn = style.sdpa_output_fn

    def input_fn(self, sdpa_input_fn):
        def check(module, args, kwargs, mesh):
            self.calls += 1
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            bound = dict(zip(names, args), **kwargs)
            mask, causal = bound.get("attn_mask"), bool(bound.get("is_causal", False))
            if mask is not None or not causal:
                what = "an attention mask" if mask is not None else "is_causal=False"
                raise ConfigError(
                    f"{self.source}: the model calls scaled_dot_product_attention with {what}; "
                    f"context parallelism (cp {self.cp}) supports causal attention only "
                    f"(is_causal=True, no attn_mask: torch's ring attention takes no mask and "
                    f"balances causal work). Call F.scaled_dot_product_attention(q, k, v, "
                    f"is_causal=True) (nn.MultiheadAttention passes its mask), or train "
                    f"without context parallelism")
            query, dropout = bound.get("query"), bound.get("dropout_p") or 0.0
            if dropout and isinstance(query, torch.Tensor) and query.device.type == "cpu":
                # The CPU's flash kernel takes no dropout: SDPA falls back to its math path,
                # which has no ring (DTensor then fails on a mixed add).
                raise ConfigError(
                    f"{self.source}: the model's attention has dropout (dropout_p={dropout}), and "
                    f"on the CPU only the flash kernel, which has none, rings under context "
                    f"parallelism (cp {self.cp}); set the attention dropout to 0 (Hugging Face: "
                    f"attn_pdrop=0.0 or attention_dropout=0.0), or train on CUDA")
            return sdpa_input_fn(module, args, kwargs, mesh)

        return check


@contextlib.contextmanager
def ring_attention(mesh, *, source: str = "<model>"):
    """Inside: every ``torch.nn.functional.scaled_dot_product_attention`` call is ring attention
    over ``mesh`` (1-D, the cp ranks), load-balanced as torch balances it, on CUDA kernels and on
    the CPU's flash kernel (real or fake tensors). Yields the ``_Attention`` record of calls."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    cpu_ring = cpu_ring_available()
    if not cpu_ring and mesh.device_type == "cpu":
        raise ConfigError(f"{source}: context parallelism on CPU tensors (gloo ranks, and the "
                          f"fake-tensor estimate) rings the CPU's attention kernel through "
                          f"sharding-rule hooks torch {torch.__version__} lacks; use torch 2.14 "
                          f"or later, or plan and train context parallelism on CUDA")
    style = cp._ContextParallel(seq_dim=_ATTENTION_SEQ_DIM, attention_type=cp._ContextParallel.AttentionType.SDPA)
    attention = _Attention(source, mesh, style)
    with _patched_sdpa(cpu_ring):
        _RINGS.entered.append(attention)
        previous, _RINGS.active = _RINGS.active, attention
        try:
            yield attention
        finally:
            _RINGS.entered.remove(attention)
            _RINGS.active = (previous if previous in _RINGS.entered
                             else _RINGS.entered[-1] if _RINGS.entered else None)


class _Rings:
    """The rings of the sessions alive (a few-block estimate holds two or three at once, each on
    its own fake mesh) and the one SDPA goes through: the ring of the last loss computed
    (``ContextParallelLoss`` activates its own), which stays on through that step's backward."""

    def __init__(self):
        self.entered: list[_Attention] = []
        self.active: _Attention | None = None
        self.depth = 0
        self.paused = 0
        """Inside ``whole_sequence_loss``: batches whole, SDPA as it is."""
        self.running = 0
        """Inside a ring's own ops (``_ring_handler``): its collectives are the ring's."""


_RINGS = _Rings()


def inside_ring() -> bool:
    """Whether the op being run is ring attention's own (its key/value all-gather and gradient
    all-to-alls, as ``timing`` tells them from a layout's other collectives)."""
    return _RINGS.running > 0


def _ring_sdpa(original):
    def sdpa(*args, **kwargs):
        ring = _RINGS.active
        if _RINGS.paused:
            return original(*args, **kwargs)
        args, kwargs = ring.checked_input(None, args, kwargs, ring.mesh)
        return ring.output_fn(None, (args, kwargs), original(*args, **kwargs), ring.mesh)

    return sdpa


@contextlib.contextmanager
def _patched_sdpa(cpu_ring: bool):
    """SDPA through the active ring, DTensor's ring dispatch and load balancing on, while any
    session's ring is entered (once for all of them: torch's own ``_distribute_function`` keys
    its patch on the function, so a second session would find it patched with the first one's
    mesh, and the first to leave would turn the dispatcher off under the others)."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if _RINGS.depth:
        _RINGS.depth += 1
        try:
            yield
        finally:
            _RINGS.depth -= 1
        return
    original = F.scaled_dot_product_attention
    saved_balance = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = True
    cp._enable_cp_dtensor_dispatcher()
    _RINGS.depth = 1
    try:
        # torch rings its CUDA kernels itself; the CPU's need the hooks (cpu_ring_available).
        with _cpu_ring_kernels() if cpu_ring else contextlib.nullcontext():
            F.scaled_dot_product_attention = _ring_sdpa(original)
            try:
                yield
            finally:
                F.scaled_dot_product_attention = original
    finally:
        _RINGS.depth = 0
        cp._disable_cp_dtensor_dispatcher()
        cp._cp_options.enable_load_balance = saved_balance


# -- the batch, sharded ------------------------------------------------------------------------

def sequence_length(batch, *, source: str) -> int:
    """The batch's sequence length: the second dimension its 2-D-or-more tensors share."""
    from ..workload.contract import _leaves

    lengths = {int(t.shape[SEQ_DIM]) for t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > SEQ_DIM}
    if len(lengths) != 1:
        shapes = [tuple(t.shape) for t in _leaves(batch) if isinstance(t, torch.Tensor)]
        raise LayoutUnsupported(
            f"{source}: context parallelism shards every batch tensor along its second (sequence) "
            f"dimension, and this batch's tensors have shapes {shapes[:6]}"
            f"{' (no sequence dimension)' if not lengths else ''}; make_batch must return inputs "
            f"and targets of the same length, batch first (shift the targets in make_batch, not "
            f"after: tokens[:, :-1] and tokens[:, 1:])", degree="cp")
    return lengths.pop()


def is_causal_lm_batch(model, batch) -> bool:
    """A Hugging Face causal LM's batch: input_ids and labels the model shifts in its loss."""
    return (isinstance(batch, dict) and "input_ids" in batch and "labels" in batch
            and hasattr(getattr(model, "config", None), "_attn_implementation"))


def _causal_lm_batch(model, batch, *, source: str, cp: int) -> dict:
    """The batch Hugging Face's model takes under context parallelism: labels shifted before
    sharding (``shift_labels``), absolute ``position_ids`` and a summed loss
    (``num_items_in_batch`` of 1), as Hugging Face's Trainer prepares it; no attention mask."""
    implementation = model.config._attn_implementation
    if implementation != "sdpa":
        raise ConfigError(f"{source}: the model's attention is {implementation!r}; context "
                          f"parallelism (cp {cp}) rings torch's scaled_dot_product_attention only: "
                          f"build it with attn_implementation=\"sdpa\"")
    input_ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    if mask is not None and not _is_fake(mask) and not bool(mask.all()):
        raise ConfigError(f"{source}: the batch has padding (attention_mask with zeros); context "
                          f"parallelism (cp {cp}) takes no attention mask: pack the sequences to "
                          f"full length instead of padding them, or train without it")
    length = input_ids.shape[SEQ_DIM]
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    converted = dict(batch, shift_labels=shift_labels, labels=shift_labels)
    converted.pop("attention_mask", None)  # all ones (checked where its values exist)
    converted.setdefault("position_ids", torch.arange(length, device=input_ids.device).expand_as(input_ids))
    converted["num_items_in_batch"] = 1
    return converted


@contextlib.contextmanager
def _no_packed_sequences():
    """Hugging Face reads position_ids that do not rise by one as packed sequences and builds a
    block mask for them (on fake tensors always, as it cannot read them there); a load-balanced
    shard's positions jump by design (chunks r and 2c-1-r), and its sequences are never packed
    (padding is refused above). Inside, it finds none, so it keeps SDPA's is_causal, in real and
    fake runs alike."""
    masking = sys.modules.get("transformers.masking_utils")
    saved = getattr(masking, "find_packed_sequence_indices", None)
    if saved is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = saved


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def shard_batch(batch, mesh, *, source: str = "<batch>"):
    """This cp rank's part of ``batch``: every tensor with the sequence as its second dimension,
    load-balanced as torch's ``context_parallel`` shards its buffers; other leaves as they are."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_buffers
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.utils._pytree import tree_flatten, tree_unflatten

    length = sequence_length(batch, source=source)
    check_seq_len(length, mesh.size(), option=None)
    leaves, spec = tree_flatten(batch)
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() > SEQ_DIM]
    device = leaves[positions[0]].device
    balancer = _HeadTailLoadBalancer(length, mesh.size(), device)
    shards = _context_parallel_buffers(mesh, [leaves[i] for i in positions], [SEQ_DIM] * len(positions),
                                       balancer)
    for i, shard in zip(positions, shards):
        leaves[i] = shard
    return tree_unflatten(leaves, spec)


# -- the step -----------------------------------------------------------------------------------

class ContextParallelLoss:
    """``loss_fn(model, batch)`` of a context-parallel workload: the batch sharded over the cp
    ranks, the workload's own loss on this rank's part, and the loss as (sum, token count) so the
    loop's exact accumulation weighs every rank's tokens (``autotune.accumulation``)."""

    def __init__(self, workload, mesh, attention: _Attention):
        self.workload = workload
        self.mesh = mesh
        self.attention = attention

    def __call__(self, model, batch):
        from ..compiled import eager_module

        if _RINGS.paused:  # whole_sequence_loss
            loss, count = self.workload.loss(model, batch)
            return loss if count is None else (loss, count)
        source, cp = self.workload.source, self.mesh.size()
        causal_lm = is_causal_lm_batch(eager_module(model), batch)
        if causal_lm:
            batch = _causal_lm_batch(eager_module(model), batch, source=source, cp=cp)
        local = shard_batch(batch, self.mesh, source=source)
        _RINGS.active = self.attention  # this step's attention rings over this session's mesh
        calls = self.attention.calls
        try:
            with _no_packed_sequences() if causal_lm else contextlib.nullcontext():
                loss, count = self.workload.loss(model, local)
        except Exception as exc:
            if self.attention.calls != calls or is_oom_error(exc):
                raise
            # Failed before any attention: the split itself is the likeliest cause (an MLP's
            # feature dimension taken for a sequence: "a and b must have same reduction dim").
            raise LayoutUnsupported(
                f"{source}: under context parallelism (cp {cp}) the step failed before any "
                f"attention ran ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                f"context parallelism splits every batch tensor's second dimension as a sequence "
                f"and rings the model's scaled_dot_product_attention, so it takes sequence models "
                f"only: plan without --cp", degree="cp") from exc
        if self.attention.calls == calls:
            raise ConfigError(
                f"{source}: the model's forward called no torch.nn.functional."
                f"scaled_dot_product_attention under context parallelism (cp {cp}), so its "
                f"attention would see only this rank's part of each sequence; use SDPA attention "
                f"(Hugging Face: attn_implementation=\"sdpa\"), or train without context parallelism")
        if causal_lm:
            return loss, (local["shift_labels"] != IGNORE_INDEX).sum()
        if count is None:
            raise LayoutUnsupported(
                f"{source}: loss_fn returns a mean; under context parallelism (cp {cp}) each rank "
                f"holds part of every sequence, so the ranks' means cannot be weighed exactly: "
                f"return (loss_sum, token_count) from loss_fn (e.g. cross_entropy(..., "
                f"reduction=\"sum\"), and the number of target tokens)", degree="cp")
        return loss, count


def whole_sequence_loss(workload):
    """``loss(model, batch)`` of ``workload`` as it is without context parallelism: the batch
    whole, attention not ringed, even inside a session (``ring_attention``). A pipeline reads
    which parameters its stages run and the activations' shapes from it, on fake tensors with no
    collective; the stages then send their rank's share of the sequence."""
    def loss(model, batch):
        _RINGS.paused += 1
        try:
            return workload.loss(model, batch)
        finally:
            _RINGS.paused -= 1

    return loss


@contextlib.contextmanager
def context_parallel_step(workload, mesh):
    """``workload`` with every batch sharded over ``mesh`` (the cp ranks) and its attention as
    ring attention, for as long as this is entered (forward, backward and optimizer step)."""
    with ring_attention(mesh, source=workload.source) as attention:
        yield dataclasses.replace(workload, loss_fn=ContextParallelLoss(workload, mesh, attention))


def fsdp_mesh(mesh):
    """The part of a layout's mesh (``Layout.mesh_dims``) FSDP2 shards over under context
    parallelism: the data-parallel shard and cp dims flattened into one ("dp_shard_cp", as
    torchtitan does), beside "dp_replicate" where the plan replicates across shard groups.
    The first call makes the flattened group: outside fake-tensor modes (see ``sharded_step``);
    later calls on the same mesh reuse it."""
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard_cp"]
    return flat


__all__ = ["ContextParallelLoss", "SEQ_DIM", "check_seq_len", "context_parallel_step", "fsdp_mesh",
           "is_causal_lm_batch", "ring_attention", "sequence_length", "shard_batch", "whole_sequence_loss"]

