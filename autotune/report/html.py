"""HTML views: Plan, ProbeResult and TrainResult in Jupyter (see ``notebook``), and the
self-contained report page of ``autotune report`` (inline SVG and CSS, nothing fetched)."""

from __future__ import annotations

import datetime
from html import escape
from pathlib import Path

from ..files.outputs import write_atomic
from ..errors import ReportError
from ..planning.planfile import check_plan_output
from ..units import format_bytes
from . import plots

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table.autotune { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
table.autotune th, table.autotune td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
table.autotune th { background: #f3f3f3; }
.autotune-warning { color: #8a4b00; }
"""


def _table(headers, rows, *, css_id: str | None = None) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    ident = f' id="{css_id}"' if css_id else ""
    return f'<table class="autotune"{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _facts(rows, *, css_id: str) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f'<table class="autotune" id="{css_id}"><tbody>{body}</tbody></table>'


def _figure(make) -> str:
    """The figure as inline SVG, or a line saying how to get it when matplotlib is missing."""
    try:
        fig = make()
    except ReportError as exc:
        return f"<p><em>{escape(str(exc))}</em></p>"
    svg = plots.svg_text(fig)
    return '<div class="autotune-plot">' + svg[svg.index("<svg"):] + "</div>"


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def plan_summary(plan) -> list[tuple[str, str]]:
    info = plan.device
    lr = plan.lr
    rows = [("model", f"{plan.workload.source} ({plan.workload.param_count:,} parameters)"),
            ("split", f"{' + '.join(map(str, plan.micro_batches))} per rank × {plan.data_parallel} "
                      f"{'data-parallel ' if not plan.parallel.trivial else ''}rank(s) = "
                      f"{plan.effective_batch} ({plan.accumulation_steps} accumulation step(s))"),
            ("precision", f"{plan.precision}: {plan.reasons.get('precision', '')}"),
            ("checkpointing", f"{_on_off(plan.checkpointing)}: {plan.reasons.get('checkpointing', '')}")]
    if not plan.parallel.trivial or "layout" in plan.reasons:
        layout = plan.parallel.describe(plan.world_size, str(plan.sharding).upper())
        rows.append(("layout", f"{layout} on {plan.world_size} rank(s)"
                               + (f": {plan.reasons['layout']}" if "layout" in plan.reasons else "")))
    if info is not None:
        rows.append(("device", info.name))
        rows.append(("budget", f"{format_bytes(info.budget_bytes)} ({info.budget_source}); headroom "
                               f"{plan.headroom:.0%}"))
    if plan.predicted_peak_bytes is not None:
        rows.append(("predicted peak", f"{format_bytes(plan.predicted_peak_bytes)} at micro-batch "
                                       f"{plan.micro_batch}"))
    rows.append(("learning rate", f"{lr.lr:.4g} ({lr.rule} rule, ×{lr.scale:.4g})" if lr.lr is not None
                 else f"the optimizer's own ({lr.rule} rule not applied)"))
    if lr.warmup_steps:
        rows.append(("warmup", f"{lr.warmup_steps} optimizer steps"))
    if plan.estimated:
        rows.append(("estimated", "memory estimated on fake tensors; check it with autotune verify"))
    return rows


def _settings_rows(plan):
    for s in plan.settings:
        # By label: every block and the planned K of N are both "checkpointing" as a bool.
        chosen = ("planned" if (s.precision, s.checkpointing_label)
                  == (plan.precision, plan.checkpointing_label) else "")
        if s.probe is None:
            yield [s.precision, s.checkpointing_label, "-", "-", "-", s.error or "does not fit"]
        else:
            yield [s.precision, s.checkpointing_label, s.raw_max_micro_batch, s.allowed_micro_batch,
                   s.probe.steps, chosen]


def _throughput_rows(plan):
    for c in plan.throughput:
        speed = f"{c.samples_per_s:.1f}" if c.samples_per_s is not None else "-"
        yield [c.precision, _on_off(c.checkpointing), c.micro_batch, c.accumulation_steps, speed,
               format_bytes(c.peak_bytes), c.status + (f": {c.note}" if c.note else "")]


def _step_time_rows(t):
    rows = [("step", f"{t.step_s * 1e3:.4g} ms per optimizer step"),
            ("compute", f"{t.compute_s * 1e3:.4g} ms (recompute {t.recompute_s * 1e3:.4g} ms)"),
            ("exposed communication", f"{t.exposed_comm_s * 1e3:.4g} ms of {t.comm_s * 1e3:.4g} ms"),
            ("pipeline bubble", f"{t.bubble_s * 1e3:.4g} ms"),
            ("samples/s per GPU", f"{t.samples_per_s:.4g}")]
    if t.tokens_per_s is not None:
        rows.append(("tokens/s per GPU", f"{t.tokens_per_s:.4g}"))
    if t.mfu is not None:
        rows.append(("MFU", f"{t.mfu:.1%}"))
    return rows


def _predicted_rows(plan):
    for c in plan.predicted:
        t = c.step_time
        yield [c.label(), f"{t.step_s * 1e3:.4g}", f"{t.compute_s * 1e3:.4g}",
               f"{t.exposed_comm_s * 1e3:.4g}", f"{t.samples_per_s:.4g}",
               f"{t.mfu:.1%}" if t.mfu is not None else "-"]


def plan_html(plan) -> str:
    """The plan as an HTML fragment: summary, settings, memory plot, throughput, warnings."""
    parts = ["<h3>autotune plan</h3>", _facts(plan_summary(plan), css_id="summary"),
             "<h4>settings probed</h4>",
             _table(["precision", "checkpointing", "probe max", "planned max", "trials", ""],
                    list(_settings_rows(plan)), css_id="settings"),
             "<h4>memory</h4>", _figure(lambda: plots.plan_figure(plan))]
    if plan.throughput:
        parts += ["<h4>throughput search</h4>",
                  _table(["precision", "checkpointing", "micro-batch", "steps", "samples/s", "peak",
                          "status"], list(_throughput_rows(plan)), css_id="throughput")]
    if plan.step_time is not None or plan.predicted:
        parts += ["<h4>predicted step time</h4>"]
        if plan.step_time is not None:
            parts.append(_facts(_step_time_rows(plan.step_time), css_id="step-time"))
        parts.append(_figure(lambda: plots.step_time_figure(plan)))
        if plan.predicted:
            parts.append(_table(["configuration", "step (ms)", "compute (ms)", "exposed comm (ms)",
                                 "samples/s per GPU", "MFU"], list(_predicted_rows(plan)),
                                css_id="predicted"))
    if plan.warnings:
        parts.append('<h4>warnings</h4><ul id="warnings">' + "".join(
            f'<li class="autotune-warning">{escape(w)}</li>' for w in plan.warnings) + "</ul>")
    return '<div class="autotune">' + "".join(parts) + "</div>"


def probe_html(probe) -> str:
    rows = [[t.micro_batch, "yes" if t.fits else t.verdict, format_bytes(t.peak_bytes),
             f"{t.seconds:.2f}"] for t in probe.trials]
    facts = [("largest micro-batch that fits", f"{probe.max_micro_batch}"
              + (" (the upper bound asked for)" if probe.capped else "")),
             ("setting", f"{probe.precision}, checkpointing {_on_off(probe.checkpointing)}"),
             ("device", probe.device.name),
             ("budget", f"{format_bytes(probe.budget_bytes)} ({probe.device.budget_source})"),
             *(("note", n) for n in probe.notes)]
    return ('<div class="autotune"><h3>autotune probe</h3>' + _facts(facts, css_id="summary")
            + _table(["micro-batch", "fits", "peak", "seconds"], rows, css_id="trials")
            + _figure(lambda: plots.probe_figure(probe)) + "</div>")


def train_html(result) -> str:
    last = result.metrics[-1] if result.metrics else None
    facts = [("optimizer steps", result.steps), ("skipped steps", result.skipped_steps),
             ("out-of-memory recoveries", result.oom_recoveries),
             ("micro-batches", " + ".join(map(str, result.micro_batches)))]
    if last is not None:
        facts += [("last loss", f"{last['loss']:.4g}"),
                  ("peak", f"{format_bytes(last.get('peak_memory_bytes'))} "
                           f"{last.get('peak_memory_kind') or ''}".strip())]
    if result.noise_scale is not None:
        facts.append(("gradient noise scale", f"{result.noise_scale:.3g} samples"))
    parts = ['<div class="autotune"><h3>autotune train</h3>', _facts(facts, css_id="summary")]
    if result.metrics:
        parts.append(_figure(lambda: plots.metrics_figure({"this run": result.metrics})))
    parts += [f'<p class="autotune-warning">{escape(w)}</p>' for w in result.warnings]
    return "".join(parts) + "</div>"


def report_page(plan, *, title: str | None = None) -> str:
    """A whole HTML page for ``plan``: everything inline, nothing to fetch."""
    title = title or f"autotune plan: {Path(plan.workload.source).name}"
    made = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1>{plan_html(plan)}"
            f"<p><small>report written {made}; plan made {escape(plan.created_at)}</small></p>"
            f"</body></html>\n")


def write_report(plan, path) -> Path:
    """Write the self-contained report page of ``plan`` to ``path`` (atomically); the model file
    the plan names is never replaced."""
    check_plan_output(plan, path)
    data = report_page(plan).encode("utf-8")
    return write_atomic(Path(path), lambda handle: handle.write(data))
