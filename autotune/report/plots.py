"""Figures of what autotune measured and decided: memory against micro-batch, throughput, and
training metrics. matplotlib is optional (``pip install 'autotune[plot]'``).

Figures are built on ``matplotlib.figure.Figure`` without pyplot, so making one never changes the
backend of a notebook or a script. Every drawn element carries a ``gid`` (an ``id`` in SVG) naming
what it shows, so tests and other tools can find it.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from ..files import jsonlines
from ..files.outputs import write_atomic
from ..errors import ReportError
from ..files.outputs import check_outputs
from ..probing.result import setting_label

MiB = 1024 * 1024
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "autotune"}
"""Text stays text (searchable, smaller) and ids are stable, so a committed SVG does not churn."""


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("plots need matplotlib, which is not installed; install it with "
                          "pip install 'autotune[plot]' (or pip install matplotlib)") from None
    return matplotlib, Figure


def _setting_name(precision: str, checkpointing: str) -> str:
    """An SVG id: "fp32-checkpointing-off", "bf16-checkpointing-2-of-6-blocks"."""
    return f"{precision}-checkpointing-{checkpointing.replace(' ', '-')}"


def _memory_axes(ax, *, settings, budget, headroom_bytes, planned, predicted, extra_bytes,
                 chosen, estimated=False):
    """Measured peaks (and out-of-memory trials) against micro-batch, the fitted model, the budget,
    the headroom line and the planned micro-batch."""
    largest = max([planned or 0, *(t.micro_batch for _, probe in settings for t in probe.trials)], default=1)
    xmax = max(2, math.ceil(largest * 1.15))
    colors = [f"C{i}" for i in range(10)]
    measured = "estimated" if estimated else "measured"
    # Settings are told apart by their checkpointing label ("off", "on", "K of N blocks"): every
    # block and the planned K of N are different settings, both "checkpointing" as a bool.
    for index, ((precision, checkpointing), probe) in enumerate(settings):
        name = _setting_name(precision, checkpointing)
        color = colors[index % len(colors)]
        label = setting_label(precision, checkpointing)
        if (precision, checkpointing) == chosen:
            label += " (planned)"
        fits = [t for t in probe.trials if t.fits]
        failed = [t for t in probe.trials if not t.fits]
        xs = [x * xmax / 60 for x in range(61)]
        model = probe.memory_model
        if model.points:
            ax.plot(xs, [(model.predict(x) + extra_bytes) / MiB for x in xs], color=color, lw=1.2,
                    ls="--", label=f"{label}: fitted model", gid=f"model-{name}")
        ax.plot([t.micro_batch for t in fits], [t.peak_bytes / MiB for t in fits], "o", color=color,
                label=f"{label}: {measured} peak", gid=f"measured-{name}")
        if failed:
            ax.plot([t.micro_batch for t in failed], [t.peak_bytes / MiB for t in failed], "x",
                    color=color, ms=8, mew=2, label=f"{label}: out of memory", gid=f"oom-{name}")
    if budget is not None:
        ax.axhline(budget / MiB, color="black", lw=1.5, label="budget", gid="budget")
        if headroom_bytes:
            ax.axhline((budget - headroom_bytes) / MiB, color="gray", lw=1, ls=":",
                       label="budget − headroom", gid="headroom")
    if planned:
        ax.axvline(planned, color="crimson", lw=1, label=f"planned micro-batch {planned}", gid="planned")
        if predicted is not None:
            ax.plot([planned], [predicted / MiB], "*", color="crimson", ms=12, gid="planned-peak")
    ax.set_xlim(0, xmax)
    # The fitted lines run on past the budget; the picture that matters is at and below it.
    peaks = [t.peak_bytes for _, probe in settings for t in probe.trials]
    top = max([budget or 0, *peaks, predicted or 0], default=0)
    ax.set_ylim(0, top * 1.25 / MiB if top else None)
    ax.locator_params(nbins=6)
    ax.set_xlabel("micro-batch (samples per step)")
    ax.set_ylabel("peak memory of one training step (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def _throughput_axes(ax, plan):
    records = list(plan.throughput)
    labels, speeds = [], []
    for index, c in enumerate(records):
        split = f"{c.micro_batch}×{c.accumulation_steps}"
        blocks = c.checkpointing.count
        ckpt = (f"{blocks} of {plan.total_blocks}" if plan.total_blocks and c.checkpointing
                and not c.checkpointing.all_blocks and blocks < plan.total_blocks
                else ("on" if c.checkpointing else "off"))
        labels.append(f"{c.precision}, ckpt {ckpt}, {split}")
        speeds.append(c.samples_per_s if c.fits and c.samples_per_s is not None else 0.0)
    chosen = [c.fits and (c.precision, c.checkpointing, list(c.micro_batches))
              == (plan.precision, plan.checkpointing, list(plan.micro_batches))
              for c in records]
    ys = list(range(len(records)))[::-1]
    for index, (y, speed, label) in enumerate(zip(ys, speeds, labels)):
        ax.barh(y, speed, color="crimson" if chosen[index] else "C0", gid=f"throughput-{index}")
        if not speed:
            ax.text(0, y, "  pruned", va="center", fontsize="small")
    ax.set_yticks(ys, labels, fontsize="small")
    ax.set_xlabel("samples/s (full windows)")
    ax.set_title("throughput search (red: planned)")
    ax.grid(alpha=0.3, axis="x")


def plan_figure(plan):
    """The memory picture of a plan (and, for throughput plans, samples/s of each configuration)."""
    _, Figure = _matplotlib()
    panels = 2 if plan.throughput else 1
    fig = Figure(figsize=(10, 4.8 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    settings = [((s.precision, s.checkpointing_label), s.probe) for s in plan.settings
                if s.probe is not None]
    _memory_axes(axes[0], settings=settings, budget=plan.budget_bytes,
                 headroom_bytes=plan.headroom_bytes, planned=plan.micro_batch,
                 predicted=plan.predicted_peak_bytes, extra_bytes=plan.ddp_bucket_bytes,
                 chosen=(plan.precision, plan.checkpointing_label), estimated=plan.estimated)
    axes[0].set_title(f"{Path(plan.workload.source).name}: "
                      f"{plan.device.name if plan.device else 'device unknown'}", fontsize="medium")
    if plan.throughput:
        _throughput_axes(axes[1], plan)
    return fig


STEP_PARTS = (("compute (less recompute)", "C0"), ("recompute", "C1"),
              ("exposed communication", "C3"), ("pipeline bubble", "C7"))


def _step_segments(t) -> list[float]:
    """A predicted step's parts end to end, in the order of ``STEP_PARTS`` (recompute is part of
    the compute, drawn after the rest of it)."""
    return [t.compute_s - t.recompute_s, t.recompute_s, t.exposed_comm_s, t.bubble_s]


def step_time_figure(plan):
    """Each ranked configuration's predicted optimizer step, split into compute, recompute,
    exposed communication and bubble (the plan's own step where nothing was ranked)."""
    _, Figure = _matplotlib()
    ranked = [(c.label(), c.step_time) for c in plan.predicted]
    if not ranked and plan.step_time is not None:
        ranked = [(f"{plan.chosen_layout}, {plan.label()}", plan.step_time)]
    if not ranked:
        raise ReportError("the plan has no predicted step time (plan with --gpu and --optimize throughput)")
    fig = Figure(figsize=(10, 1.2 + 0.45 * len(ranked)), layout="constrained")
    ax = fig.subplots()
    ys = list(range(len(ranked)))[::-1]
    segments = [_step_segments(t) for _, t in ranked]
    starts = [[sum(parts[:i]) for i in range(len(parts))] for parts in segments]
    for i, (legend, colour) in enumerate(STEP_PARTS):
        ax.barh(ys, [parts[i] * 1e3 for parts in segments], left=[s[i] * 1e3 for s in starts],
                color=colour, label=legend, gid=f"step-part-{i}")
    ax.set_yticks(ys, [label for label, _ in ranked], fontsize="small")
    ax.set_xlabel("predicted time of one optimizer step on one GPU (ms)")
    ax.set_title("predicted step time, fastest first")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def probe_figure(probe):
    _, Figure = _matplotlib()
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    _memory_axes(ax, settings=[((probe.precision, probe.checkpointing_label), probe)],
                 budget=probe.budget_bytes, headroom_bytes=0, planned=None, predicted=None,
                 extra_bytes=0, chosen=None)
    ax.axvline(probe.max_micro_batch, color="crimson", lw=1,
               label=f"largest that fits: {probe.max_micro_batch}", gid="largest")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def load_metrics(path) -> list[dict]:
    """The records of a metrics file written by ``autotune train --metrics`` (one JSON per line)."""
    path = Path(path)
    records = []
    try:
        for number, line in jsonlines.read_lines(path):
            if not line.strip():
                continue
            try:
                record = jsonlines.loads(line)
            except json.JSONDecodeError:
                raise ReportError(f"{path}, line {number}: not JSON (or nested too deeply); is it "
                                  f"a metrics file written by autotune train --metrics?") from None
            if not isinstance(record, dict) or "step" not in record:
                raise ReportError(f"{path}, line {number}: no \"step\" field; is it a metrics "
                                  f"file written by autotune train --metrics?")
            records.append(record)
    except OSError as exc:
        raise ReportError(f"cannot read the metrics file {path}: {exc.strerror}") from None
    except (jsonlines.LineTooLong, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: {exc}; is it a metrics file written by autotune train "
                          f"--metrics?") from None
    if not records:
        raise ReportError(f"{path} holds no metrics records; train with --metrics {path} first")
    return records


def metrics_figure(runs: dict[str, list[dict]]):
    """Loss, learning rate and gradient norm per optimizer step, one line per run."""
    _, Figure = _matplotlib()
    fig = Figure(figsize=(7.5, 7.5), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    for index, (name, records) in enumerate(runs.items()):
        steps = [r["step"] for r in records]
        for ax, key in zip(axes, ("loss", "lr", "grad_norm")):
            values = [r.get(key) if r.get(key) is not None else math.nan for r in records]
            ax.plot(steps, values, lw=1.2, label=name, gid=f"{key}-{index}")
    for ax, label in zip(axes, ("loss", "learning rate", "gradient norm")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("optimizer step")
    return fig


def save_figure(fig, path) -> Path:
    """Write ``fig`` to ``path``; the format follows the suffix (.svg, .png, .pdf)."""
    matplotlib, _ = _matplotlib()
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in ("svg", "png", "pdf"):
        raise ReportError(f"--plot {path}: write .svg, .png or .pdf (the suffix picks the format)")
    metadata = {"Date": None} if suffix == "svg" else None
    buffer = io.BytesIO()
    with matplotlib.rc_context(_SVG_RC):
        fig.savefig(buffer, format=suffix, metadata=metadata)
    return write_atomic(Path(path),
                        lambda handle: handle.write(buffer.getvalue()))


def svg_text(fig) -> str:
    """The figure as an SVG document (for inline HTML)."""
    matplotlib, _ = _matplotlib()
    buffer = io.StringIO()
    with matplotlib.rc_context(_SVG_RC):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()


def plot_plan(plan, path):
    """Draw ``plan`` (a ``Plan``) to ``path`` (.svg, .png or .pdf); returns the path. The model
    file the plan names is never replaced."""
    from ..planning.planfile import check_plan_output

    check_plan_output(plan, path, option="--plot")
    return save_figure(plan_figure(plan), path)


def plot_probe(probe, path):
    return save_figure(probe_figure(probe), path)


def plot_metrics(paths, path):
    """Draw one or more metrics files to ``path``: loss, LR and gradient norm per step (never
    onto one of them)."""
    check_outputs({"--plot": path}, inputs={f"metrics file {source}": source for source in paths})
    runs = {}
    for source in paths:
        name = Path(source).name
        while name in runs:
            name += "'"
        runs[name] = load_metrics(source)
    return save_figure(metrics_figure(runs), path)
