"""Planning in tokens: ``plan(..., seq_len=N|"auto", target_tokens=T)``.

A plan with a sequence length is the ordinary plan of a batch in samples, probed and trained at
``make_batch(n, seq_len)``: tokens per optimizer step = micro-batches × seq_len × world size, so
a token target is a batch of ``target_tokens / seq_len`` samples, which must be a whole number
that the world size divides (or the request is refused with the nearest values that work).
``seq_len="auto"`` takes the longest length that fits at micro-batch 1 (``longest_at_one``),
cut to one that divides the token target (``_auto_length``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, given, option
from ..memory import backend_for
from ..memory.base import MemoryBackend
from ..memory.fake import EstimateMemoryBackend
from ..planning.types import Plan
from ..probing.seq_len import SeqLenResult, probe_seq_len
from ..units import format_bytes
from ..workload.contract import Workload
from ..workload.dataset_batch import LargestExamples

AUTO = "auto"


@dataclass(kw_only=True)
class TokenRequest:
    """A token request resolved to the plan's batch in samples at one sequence length."""

    seq_len: int
    target_batch: int
    target_tokens: int | None = None
    reason: str = ""


def check_token_options(*, target_batch, target_tokens, seq_len, seq_multiple) -> None:
    """Each option on its own and against the others, before any work."""
    if seq_len is not None and seq_len != AUTO and (
            isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ConfigError(f"{given('seq_len', seq_len)} is not a sequence length; use a whole "
                          f"number of at least 1, or {AUTO!r} for the longest that fits")
    for name, value in (("target_tokens", target_tokens), ("seq_multiple", seq_multiple)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{given(name, value)} is not a positive whole number")
    if isinstance(seq_len, int) and seq_multiple and seq_len % seq_multiple:
        raise ConfigError(f"{given('seq_len', seq_len)} is not a multiple of "
                          f"{given('seq_multiple', seq_multiple)}; use {_round(seq_len, seq_multiple)}")
    if target_tokens is not None and target_batch is not None:
        raise ConfigError(f"{option('target_batch')} and {option('target_tokens')} both ask for the "
                          f"batch per optimizer step; give one of them")
    if target_tokens is None and target_batch is None:
        raise ConfigError(f"give {option('target_batch')} (samples per optimizer step) or "
                          f"{option('target_tokens')} (tokens per optimizer step, with "
                          f"{option('seq_len')})")


def resolve(*, target_batch, target_tokens, seq_len, seq_multiple: int, world_size: int,
            longest=None) -> TokenRequest:
    """The batch in samples and the sequence length of a token request. ``longest()`` probes the
    longest length that fits at micro-batch 1 (a ``SeqLenResult``), for ``seq_len="auto"``."""
    if seq_len == AUTO:
        found: SeqLenResult = longest()
        seq_len, reason = _auto_length(found, target_tokens, seq_multiple, world_size)
    else:
        reason = f"{seq_len} positions per sample, as asked ({option('seq_len')})"
    if target_tokens is None:
        return TokenRequest(seq_len=seq_len, target_batch=target_batch, reason=reason)
    step = seq_len * world_size
    if target_tokens % step:
        below, above = (target_tokens // step) * step, (target_tokens // step + 1) * step
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            f"{given('target_tokens', target_tokens)} is not a whole number of sequences per rank: "
            f"tokens per step = micro-batches × {option('seq_len')} {seq_len} × "
            f"{option('world_size')} {world_size}, a multiple of {step}; use "
            f"{option('target_tokens')} {nearest}"
            + (f", or a {option('seq_len')} that divides {target_tokens // world_size}"
               if target_tokens % world_size == 0 else ""))
    return TokenRequest(seq_len=seq_len, target_batch=target_tokens // seq_len,
                        target_tokens=target_tokens,
                        reason=f"{reason}; {target_tokens:,} tokens per step = "
                               f"{target_tokens // seq_len} sequences of {seq_len}")


def _auto_length(found: SeqLenResult, target_tokens, seq_multiple: int, world_size: int):
    """The longest length that fits (a multiple of ``seq_multiple``) and, with a token target,
    divides it into whole sequences on every rank."""
    longest = found.max_seq_len
    said = (f"{option('seq_len')} auto: the longest that fits at micro-batch 1 with an "
            f"accumulation window's gradients held is {longest} ({found.precision}, checkpointing "
            f"{found.checkpointing}, within {format_bytes(found.budget_bytes)}: the budget less the "
            f"headroom; {len(found.trials)} real steps)")
    if found.capped:
        said += " — the model's own limit"
    if target_tokens is None:
        return longest, said
    for length in range(longest - longest % seq_multiple, 0, -seq_multiple):
        if target_tokens % (length * world_size) == 0:
            if length != longest:
                said += (f"; {length} is the longest below it that divides "
                         f"{option('target_tokens')} {target_tokens} into whole sequences on "
                         f"{world_size} rank(s)")
            return length, said
    raise ConfigError(f"{given('target_tokens', target_tokens)}: no sequence length up to "
                      f"{longest} (in multiples of {seq_multiple}) divides it into whole "
                      f"sequences on {world_size} rank(s); give {option('seq_len')} N or a "
                      f"{option('target_tokens')} with more small factors (a power of two)")


def longest_at_one(workload: Workload, backend: MemoryBackend, *, device, limit_bytes: int,
                   precision, checkpointing, seq_multiple: int) -> SeqLenResult:
    """``probe_seq_len`` at micro-batch 1 within ``limit_bytes`` (the plan's budget less its
    headroom and DDP buckets), measuring an accumulation window's micro-step as the plan's
    probe will: the longest length a plan of micro-batch 1 can then take."""
    if isinstance(backend, EstimateMemoryBackend):
        limited = EstimateMemoryBackend(limit_bytes, for_cuda=backend.for_cuda, target=backend.info())
    else:
        limited = backend_for(device if backend.device.type == "cuda" else "cpu", limit_bytes)
    return probe_seq_len(workload, micro_batch=1, seq_multiple=seq_multiple, backend=limited,
                         precision=precision, checkpointing=checkpointing, accumulation=True)


def batch_shapes(workload: Workload, micro_batch: int) -> str:
    """What the probe measured: the tensor shapes of the batch at ``micro_batch`` (for a model
    file without ``make_batch``, of ``build_dataset()``'s largest examples, collated)."""
    batch = workload.batch(micro_batch)
    items = batch.items() if isinstance(batch, dict) else enumerate(
        batch if isinstance(batch, (tuple, list)) else [batch])
    shapes = ", ".join(f"{key if isinstance(key, str) else f'[{key}]'} {tuple(value.shape)}"
                       for key, value in items if isinstance(value, torch.Tensor))
    made = ("build_dataset()'s largest examples, collated" if isinstance(workload.make_batch, LargestExamples)
            else f"make_batch({micro_batch}{'' if workload.seq_len is None else f', {workload.seq_len}'})")
    return f"measured at the planned micro-batch {micro_batch} on {made}: {shapes}"


def with_tokens(plan: Plan, tokens: TokenRequest) -> Plan:
    """The plan, stating its sequence length and token target."""
    plan.seq_len = tokens.seq_len
    plan.target_tokens = tokens.target_tokens
    per_step = plan.effective_batch * tokens.seq_len
    plan.reasons["seq_len"] = (
        f"{tokens.reason}; tokens per optimizer step: {_split(plan)} × {tokens.seq_len} = "
        f"{per_step:,}; probed and trained at make_batch(n, {tokens.seq_len})")
    return plan


def _split(plan: Plan) -> str:
    if len(set(plan.micro_batches)) == 1:
        return f"{plan.micro_batch} × {plan.accumulation_steps} accumulation step(s) × {plan.world_size} rank(s)"
    return f"({' + '.join(map(str, plan.micro_batches))}) × {plan.world_size} rank(s)"


def _round(value: int, multiple: int) -> str:
    low = value - value % multiple
    return f"{low} or {low + multiple}" if low else f"{multiple}"


__all__ = ["AUTO", "TokenRequest", "check_token_options", "longest_at_one", "resolve", "batch_shapes", "with_tokens"]
