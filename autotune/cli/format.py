"""Plain-text tables for the CLI: results in, strings out (no printing, no logic)."""

from __future__ import annotations

from ..probing.result import setting_label
from ..units import format_bytes


def table(headers: list[str], rows: list[list], *, align: str | None = None) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(values):
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(values, widths, align))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _reserved_text(plan) -> str:
    """For a CUDA estimate: the peak is reserved memory; what the tensors hold beside it."""
    allocated = plan.predicted_allocated_bytes
    if allocated is None:
        trial = plan.planned_trial  # a plan made before the plan stated it
        allocated = trial.allocated_peak_bytes if trial is not None else None
    if allocated is None:
        return ""
    return f" reserved by the caching allocator (modelled; tensors allocated {format_bytes(allocated)})"


def format_cuda_estimate(source, device: str, peaks: dict, *, outside: int | None = None,
                         memory: int | None = None) -> str:
    """``autotune estimate --gpu``: the tensors' and the modelled reserved peak per micro-batch;
    with the card's ``memory`` and what lives ``outside`` torch's allocator, their sum on it."""
    headers = ["micro-batch", "tensors (allocated)", "reserved", "reserved/allocated"]
    rows = [[n, format_bytes(a), format_bytes(r), f"{r / a:.3f}" if a else "-"]
            for n, (a, r) in peaks.items()]
    on_top = "the CUDA context and NCCL buffers come on top"
    if outside is not None and memory is not None:
        headers.append(f"+ outside torch, of {format_bytes(memory)}")
        rows = [[*row, f"{format_bytes(r + outside)} ({(r + outside) / memory:.0%})"]
                for row, (_, r) in zip(rows, peaks.values())]
        on_top = f"outside torch: {format_bytes(outside)} (the CUDA context and NCCL buffers)"
    return "\n".join([f"{source}: estimated peak of one training step on {device} (fake tensors, "
                      f"torch's CUDA caching allocator modelled; nothing allocated)",
                      table(headers, rows),
                      f"reserved: what torch.cuda.max_memory_reserved() would show, cuBLAS workspaces "
                      f"included; {on_top}"])


def format_probe(result, source: str = "") -> str:
    info = result.device
    rows = [[i + 1, t.micro_batch, "yes" if t.fits else "OOM" if t.past_limit is None else "past limit",
             format_bytes(t.peak_bytes),
             f"{t.seconds:.2f}"] for i, t in enumerate(result.trials)]
    headers = ["trial", "micro-batch", "fits", "peak", "seconds"]
    if any(t.allocated_peak_bytes is not None for t in result.trials):
        # A CUDA estimate: the peak is the modelled allocator's reserved memory, tensors beside it.
        headers = [*headers[:3], "reserved", "tensors", "seconds"]
        rows = [[*row[:4], format_bytes(t.allocated_peak_bytes), row[4]]
                for row, t in zip(rows, result.trials)]
    elif any(t.reserved_peak_bytes is not None for t in result.trials):
        # CUDA: what tensors held (peak), what the cache held, retries, and the device as NVML sees it.
        headers = [*headers[:4], "reserved", "retries", "NVML used", "seconds"]
        rows = [[*row[:4], format_bytes(t.reserved_peak_bytes), t.alloc_retries if t.alloc_retries is not None else "-",
                 format_bytes(t.nvml_used_bytes), row[4]] for row, t in zip(rows, result.trials)]
    head = [
        f"model:      {source}",
        f"device:     {info.name}",
        f"budget:     {format_bytes(info.budget_bytes)} ({info.budget_source})",
        f"setting:    {setting_label(result.precision, result.checkpointing_label)}",
        "",
        table(headers, rows),
        "",
    ]
    model = result.memory_model
    head.append(f"memory model ({model.kind}, {model.points} points): "
                f"peak(n) ≈ {_describe_model(model)}")
    capped = " (the upper bound asked for; more may fit)" if result.capped else ""
    head.append(f"largest micro-batch that fits: {result.max_micro_batch}{capped}  "
                f"[{result.steps} training steps, {result.oom_count} out-of-memory, "
                f"{result.seconds:.1f}s]")
    head.extend(f"note: {n}" for n in result.notes)
    return "\n".join(head)


def format_seq_len(result, source: str = "") -> str:
    """``autotune probe --max-seq-len``: the answer, each real step, and the notes."""
    budget = format_bytes(result.budget_bytes)
    capped = " (the model's limit: longer might fit)" if result.capped else ""
    lines = [f"model:        {source}", f"device:       {result.device.name} ({budget} budget)",
             f"setting:      {setting_label(result.precision, result.checkpointing)}, micro-batch "
             f"{result.micro_batch}, lengths in multiples of {result.seq_multiple}",
             f"max seq len:  {result.max_seq_len}{capped} = {result.tokens:,} tokens per micro-batch",
             "",
             table(["seq len", "fits", "peak"],
                   [[t.seq_len, "yes" if t.fits else "out of memory", format_bytes(t.peak_bytes)]
                    for t in result.trials]),
             f"\n{len(result.trials)} real step(s) in {result.seconds:.1f}s"]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def _describe_model(model) -> str:
    a, b, c = model.activation
    d, e = model.step
    act = f"{format_bytes(a)} + {format_bytes(b)}·n" + (f" + {format_bytes(c)}·n²" if c else "")
    return f"max({act}, {format_bytes(d)} + {format_bytes(e)}·n)"


def format_devices(cuda: list[dict], cpu) -> str:
    lines = []
    if cuda:
        rows = [[f"cuda:{d['index']}", d["name"], format_bytes(d["total_bytes"]), format_bytes(d["free_bytes"]),
                 format_bytes(d.get("used_bytes_nvml")),
                 f"{format_bytes(d.get('allocated_bytes'))} / {format_bytes(d.get('allocated_peak_bytes'))}",
                 f"{format_bytes(d.get('reserved_bytes'))} / {format_bytes(d.get('reserved_peak_bytes'))}",
                 d.get("alloc_retries", "-"), {True: "yes", False: "no", None: "?"}[d.get("bf16")]]
                for d in cuda]
        lines.append(table(["device", "name", "total", "free", "NVML used", "allocated now/peak",
                            "reserved now/peak", "retries", "bf16"], rows, align="llrrrrrrl"))
        lines.append("NVML used counts every process and CUDA context on the device; allocated and "
                     "reserved are this process's tensors and torch's cache (the probe counts "
                     "allocated; reserved well above it, or retries, mean fragmentation)")
    else:
        lines.append("no CUDA device visible to torch")
    lines.append("")
    lines.append(f"cpu: {cpu.name}; RAM {format_bytes(cpu.total_bytes)}, available "
                 f"{format_bytes(cpu.free_bytes)}; probe budget {format_bytes(cpu.budget_bytes)} "
                 f"({cpu.budget_source})")
    return "\n".join(lines)


def _parameters(workload) -> str:
    """"131,840 parameters", or with frozen ones "trainable 11.3K of 131.8K parameters"."""
    trainable = workload.trainable_param_count
    if trainable is None or trainable == workload.param_count:
        return f"{workload.param_count:,} parameters"
    return f"trainable {_count(trainable)} of {_count(workload.param_count)} parameters"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def format_plan(plan) -> str:
    """The readable summary of a ``Plan``: device, budget, settings tried, the split, LR, warnings."""
    info = plan.device
    lines = [f"model:        {plan.workload.source} ({_parameters(plan.workload)}, "
             f"{format_bytes(plan.workload.param_bytes)})"]
    if info is not None:
        lines.append(f"device:       {info.name}")
        lines.append(f"budget:       {format_bytes(info.budget_bytes)} ({info.budget_source}); headroom "
                     f"{plan.headroom:.0%} = {format_bytes(plan.headroom_bytes)}, leaving "
                     f"{format_bytes(info.budget_bytes - plan.headroom_bytes)}")
    if plan.ddp_bucket_bytes:
        lines.append(f"DDP buckets:  {format_bytes(plan.ddp_bucket_bytes)} added to every prediction")
    if getattr(plan, "estimated", False):
        lines.append("estimate:     memory estimated on fake tensors without the device, not measured; "
                     "check it there with autotune verify")
    lines += ["", "settings tried:"]
    rows = []
    chosen_setting = plan.chosen_setting
    for s in plan.settings:
        chosen = "<- plan" if s is chosen_setting else ""
        layout = s.layout
        if s.probe is None:
            rows.append([s.precision, s.checkpointing_label, layout, "-", "-", "-", "does not fit"])
            continue
        capped = "+" if s.probe.capped else ""
        rows.append([s.precision, s.checkpointing_label, layout,
                     f"{s.raw_max_micro_batch}{capped}", s.allowed_micro_batch, s.probe.steps, chosen])
    lines.append(table(["precision", "checkpointing", "sharding", "probe max", "planned max", "trials",
                        "chosen"], rows, align="lllrrrl"))
    if any(s.probe is not None and s.probe.capped for s in plan.settings):
        lines.append("(+: the probe stopped at the largest micro-batch the plan needs; more may fit)")
    lines += ["", f"split:        {_split_text(plan)}",
              f"precision:    {plan.precision} ({plan.reasons.get('precision', '')})",
              f"checkpointing: {plan.checkpointing_label} "
              f"({plan.reasons.get('checkpointing', '')})"]
    if getattr(plan, "seq_len", None) is not None:
        lines.append(f"tokens:       {plan.tokens_per_step:,} per optimizer step = {plan.effective_batch} "
                     f"sequences × seq len {plan.seq_len} ({plan.reasons.get('seq_len', '')})")
        if "batch_shapes" in plan.reasons:
            lines.append(f"shapes:       {plan.reasons['batch_shapes']}")
    if "sharding" in plan.reasons:
        group = f", shard group {plan.shard_group}" if plan.shard_group else ""
        lines.append(f"sharding:     {plan.sharding}{group} ({plan.reasons['sharding']})")
    parallel = getattr(plan, "parallel", None)
    if parallel is not None and (not parallel.trivial or "layout" in plan.reasons):
        why = (f"{plan.data_parallel} data-parallel rank(s) of {plan.world_size} take different samples"
               if not parallel.trivial else "")
        why = "; ".join(w for w in (why, plan.reasons.get("layout")) if w)
        lines.append(f"layout:       {parallel.describe(plan.world_size, str(plan.sharding).upper())} "
                     f"({why})")
    if plan.compile:
        lines.append(f"compile:      {plan.compile_backend or 'build_model'} "
                     f"({plan.reasons.get('compile', '')})")
    if "gradient_sync" in plan.reasons:  # sharded with accumulation: when gradients are reduced
        lines.append(f"grad sync:    {plan.reasons['gradient_sync']}")
    if plan.predicted_peak_bytes is not None:
        lines.append(f"peak:         {format_bytes(plan.predicted_peak_bytes)}{_reserved_text(plan)} "
                     f"predicted at micro-batch {plan.micro_batch}")
    if plan.step_time is not None:
        lines += format_step_time(plan.step_time)
    if "eval" in plan.reasons:
        size = plan.eval_micro_batch if plan.eval_micro_batch is not None else "-"
        lines.append(f"eval batch:   {size} ({plan.reasons['eval']})")
    lr = plan.lr
    lines.append(f"lr:           {lr.lr:.4g} ({lr.rule} rule, ×{lr.scale:.4g})" if lr.lr is not None
                 else f"lr:           the optimizer's own ({lr.rule} rule not applied)")
    if lr.note:
        lines.append(f"              {lr.note}")
    if lr.warmup_steps:
        lines.append(f"warmup:       {lr.warmup_steps} optimizer steps, linear")
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.throughput:
        lines += ["", format_throughput(plan)]
    if plan.predicted:
        lines += ["", format_predicted(plan)]
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def format_step_time(t) -> list[str]:
    """A predicted window: its time and split, then the rates per GPU."""
    rates = [f"{t.samples_per_s:.4g} samples/s"]
    if t.tokens_per_s is not None:
        rates.append(f"{t.tokens_per_s:.4g} tokens/s")
    mfu = f", MFU {t.mfu:.1%}" if t.mfu is not None else ""
    return [f"step time:    {_ms(t.step_s)} predicted per optimizer step (compute {_ms(t.compute_s)}, "
            f"exposed communication {_ms(t.exposed_comm_s)} of {_ms(t.comm_s)}, bubble "
            f"{_ms(t.bubble_s)}; recompute {_ms(t.recompute_s)} of the compute)",
            f"throughput:   {', '.join(rates)} per GPU predicted{mfu}"]


def format_predicted(plan) -> str:
    """The configurations ranked by predicted throughput, fastest first."""
    rows = []
    for c in plan.predicted:
        t = c.step_time
        chosen = ((c.layout, c.precision, c.checkpointing, list(c.micro_batches))
                  == (plan.chosen_layout, plan.precision, plan.checkpointing, list(plan.micro_batches)))
        rows.append([c.layout, c.precision, c.checkpointing.label, c.micro_batch, c.accumulation_steps,
                     _ms(t.step_s), _ms(t.compute_s), _ms(t.exposed_comm_s), f"{t.samples_per_s:.4g}",
                     f"{t.tokens_per_s:.4g}" if t.tokens_per_s is not None else "-",
                     f"{t.mfu:.1%}" if t.mfu is not None else "-", "<- plan" if chosen else ""])
    text = table(["layout", "precision", "checkpointing", "micro-batch", "steps", "step", "compute",
                  "exposed comm", "samples/s", "tokens/s", "MFU", ""], rows, align="lllrrrrrrrrl")
    why = plan.reasons.get("throughput", "")
    return ("ranked by predicted throughput (per GPU, one optimizer step):\n" + text
            + (f"\nwhy: {why}" if why else ""))


def format_throughput(plan) -> str:
    """The throughput search's table: every configuration considered, fastest first."""
    rows = []
    for c in plan.throughput:
        blocks = c.checkpointing.setting
        chosen = (c.fits and (c.precision, c.checkpointing, c.micro_batches)
                  == (plan.precision, plan.checkpointing, list(plan.micro_batches)))
        speed = f"{c.samples_per_s:.1f}" if c.samples_per_s is not None else "-"
        if c.compared:
            speed += " (side by side)"
        elif c.warm_up_only and c.samples_per_s is not None:
            speed += " (warm-up only)"
        status = ("<- plan" if chosen else f"skipped: {c.note}" if c.status == "skipped" else
                  "reused" if c.reused and c.fits else "" if c.fits else f"pruned: {c.note}")
        rows.append([c.precision, blocks if isinstance(blocks, str) else f"{blocks} blocks", c.micro_batch,
                     c.accumulation_steps, speed, format_bytes(c.peak_bytes),
                     format_bytes(c.predicted_peak_bytes), status])
    text = table(["precision", "checkpointing", "micro-batch", "steps", "samples/s", "peak",
                  "predicted", ""], rows, align="llrrrrrl")
    why = plan.reasons.get("throughput", "")
    return "throughput search (samples/s over full windows):\n" + text + (f"\nwhy: {why}" if why else "")


def _split_text(plan) -> str:
    steps = plan.accumulation_steps
    if plan.is_even:
        per_rank = f"{plan.micro_batch} × {steps} accumulation step{'s' if steps > 1 else ''}"
    else:
        per_rank = f"({plan.split_text}) over {steps} accumulation steps"
    if plan.parallel.trivial:
        ranks = f"{plan.world_size} rank{'s' if plan.world_size > 1 else ''}"
    else:  # the model-parallel ranks of one data-parallel rank see the same samples
        ranks = f"{plan.data_parallel} data-parallel rank(s) of {plan.world_size}"
    return f"{per_rank} × {ranks} = {plan.effective_batch}"


def format_verify(result) -> str:
    """The report of ``autotune verify`` (a ``VerifyResult``)."""
    plan, info = result.plan, result.device
    # The check runs within the plan's budget where the device has more (verify_plan: the smaller).
    budget = (f"budget {format_bytes(info.budget_bytes)}, {info.budget_source}"
              if result.budget_bytes >= info.budget_bytes else
              f"checked within the plan's budget of {format_bytes(result.budget_bytes)}; this device's "
              f"is {format_bytes(info.budget_bytes)}, {info.budget_source}")
    lines = [f"device:     {info.name} ({budget})",
             f"checked:    micro-batch {plan.micro_batch}, "
             f"{setting_label(plan.precision, plan.checkpointing_label)}, {result.steps} real steps",
             f"limit:      {format_bytes(result.usable_bytes)} = {format_bytes(result.budget_bytes)} "
             f"budget less {plan.headroom:.0%} headroom"]
    predicted = format_bytes(result.predicted)
    kind = "estimated" if plan.estimated else "predicted"
    if result.predicted_bytes is not None:
        kind += " (tensors; its peak is CUDA's reserved memory)"
    if result.measured_peak_bytes is None:
        lines.append(f"peak:       out of memory (the plan {kind} {predicted})")
    else:
        off = ""
        if result.error_bytes is not None:
            off = (f"; the plan {kind} {predicted}, off by {_signed_bytes(result.error_bytes)} "
                   f"({result.error_fraction:+.1%})")
        lines.append(f"peak:       {format_bytes(result.measured_peak_bytes)} measured{off}")
    if result.confirmed:
        lines.append("confirmed:  the plan fits on this device")
    else:
        lines.append("NOT confirmed: the plan's micro-batch does not fit within the limit here")
        new = result.new_plan
        if new is not None:
            # The split as plan and show print it: an uneven one multiplied out said 43 × 3 = 128.
            lines.append(f"re-planned: {_split_text(new)} (was {_split_text(plan)}); "
                         f"{setting_label(new.precision, new.checkpointing_label)}")
        if result.replan_error is not None:
            lines.append(f"re-plan failed: {result.replan_error}")
    return "\n".join(lines)


def _signed_bytes(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


def format_metrics(runs: dict[str, list[dict]]) -> str:
    """One row per metrics file: steps, first and last loss, the last peak."""
    rows = []
    for name, records in runs.items():
        first, last = records[0], records[-1]
        peak = f"{format_bytes(last.get('peak_memory_bytes'))} {last.get('peak_memory_kind') or ''}"
        rows.append([name, f"{first['step']}-{last['step']}", f"{first['loss']:.4f}",
                     f"{last['loss']:.4f}", peak.strip()])
    return table(["metrics", "steps", "first loss", "last loss", "last peak"], rows, align="lrrrr")


def format_step_times(predictions: dict, *, as_json: bool = False, layout: str | None = None) -> str:
    """``predict_step_time``'s answer: per micro-batch the step's compute time, its parts, FLOPs
    and bytes moved (``as_json``: the same numbers as JSON); ``layout``: the model-parallel layout
    (its description) whose rank was counted."""
    import json

    if as_json:
        return json.dumps({str(n): {"seconds": p.seconds, "breakdown_seconds": p.breakdown,
                                    "flops": p.costs.total_flops, "bytes": p.costs.total_bytes,
                                    "ops": p.costs.op_count, "device": p.device}
                           for n, p in predictions.items()}, indent=2)
    parts = ("matmul", "attention", "elementwise", "optimizer", "other", "recompute", "loop")
    rows = [[str(n), f"{p.seconds * 1e3:.3f}", *(f"{p.breakdown.get(k, 0.0) * 1e3:.3f}" for k in parts),
             f"{p.costs.total_flops / 1e9:.3f}", format_bytes(int(p.costs.total_bytes)),
             str(p.costs.op_count)] for n, p in predictions.items()]
    device = next(iter(predictions.values())).device if predictions else ""
    rank = (f"one rank of {layout}; no communication, no pipeline bubble" if layout
            else "no communication")
    return (f"predicted compute time of one training step on {device} ({rank}):\n"
            + table(["micro-batch", "step ms", *(f"{k} ms" for k in parts), "GFLOP", "moved", "ops"],
                    rows))
