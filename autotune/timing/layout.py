"""What a model-parallel layout adds to a rank's step time: the pipeline's bubble and the tensor
parallel collectives that nothing overlaps.

- Pipeline bubble. 1F1B over p stages and m micro-batches idles (p − 1) micro-batch times of
  every stage's m + p − 1: a fraction (p − 1)/(m + p − 1) of the step (Narayanan et al.,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
  §2.2.1: bubble time / ideal time = (p − 1)/m). Interleaving v stages per rank divides the
  bubble by v (§2.2.2): (p − 1)/v of m + (p − 1)/v. Zero-bubble schedules fill the bubble with
  the weight-gradient half of backward: ZB-H1 leaves (p − 1)(T_F + T_B − T_W), a third of
  1F1B's (p − 1)(T_F + T_B + T_W) where the three are equal (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024, §3.1); taken here as a third of the interleaved schedule's bubble.
- Tensor parallel with sequence parallel: 4 all-gathers/reduce-scatters of the b × s × h
  activation per block in forward and 4 in backward (Korthikanti et al., 2022, §4.2.2), on the
  critical path of each block (torch's TP runs them synchronously unless async TP is enabled),
  so all of them are exposed, timed by the alpha–beta link of ``autotune.timing.comm`` within the
  host the tensor-parallel group stays in.
"""

from __future__ import annotations

import dataclasses

from ..distributed.layout import Layout, PipelineSchedule
from .comm import Network, collective_time
from .window import WindowTime


def pipeline_bubble(layout: Layout, micro_batches: int) -> float:
    """The fraction of a pipeline step its stages idle (0 without a pipeline)."""
    p, m = layout.pp, max(1, micro_batches)
    if p == 1:
        return 0.0
    idle = (p - 1) / layout.stages_per_rank
    if layout.pp_schedule is PipelineSchedule.ZERO_BUBBLE:
        idle /= 3
    return idle / (m + idle)


def tensor_parallel_seconds(layout: Layout, *, tokens: float, hidden: int, blocks: float,
                            activation_bytes: int, network: Network) -> float:
    """Seconds of one rank's tensor-parallel collectives for ``tokens`` tokens of a micro-step
    through ``blocks`` blocks (8 per block, each of the tokens × hidden activation)."""
    if layout.tp == 1:
        return 0.0
    nbytes = tokens * hidden * activation_bytes
    link = network.link(layout.tp * layout.cp)
    one = collective_time("all_gather", nbytes, layout.tp, link)
    return 8 * blocks * one


def with_layout(time: WindowTime, layout: Layout, *, micro_batches: list[int], seq_len: int | None,
                hidden: int | None, blocks: int, activation_bytes: int, network: Network) -> WindowTime:
    """``time`` (a rank's window as the data-parallel model times it) with the layout's exposed
    tensor-parallel collectives and its pipeline bubble added."""
    stage_blocks = blocks / layout.pp
    comm = sum(tensor_parallel_seconds(layout, tokens=n * (seq_len or 1) / layout.cp, hidden=hidden or 0,
                                       blocks=stage_blocks, activation_bytes=activation_bytes,
                                       network=network) for n in micro_batches)
    busy = time.step_s + comm
    bubble_fraction = pipeline_bubble(layout, len(micro_batches))
    bubble = busy * bubble_fraction / (1 - bubble_fraction)
    step = busy + bubble
    samples = sum(micro_batches)
    return dataclasses.replace(
        time, step_s=step, exposed_comm_s=time.exposed_comm_s + comm, comm_s=time.comm_s + comm,
        bubble_s=time.bubble_s + bubble,
        # Per GPU: one data-parallel rank's samples are shared by its tp × cp × pp ranks.
        samples_per_s=samples / step / layout.model_parallel,
        tokens_per_s=(None if time.tokens_per_s is None else samples * seq_len / step / layout.model_parallel
                      if seq_len else time.tokens_per_s * time.step_s / step / layout.model_parallel),
        mfu=time.mfu * time.step_s / step if time.mfu is not None else None)


__all__ = ["pipeline_bubble", "tensor_parallel_seconds", "with_layout"]
