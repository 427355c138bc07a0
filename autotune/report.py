"""Plain-text tables for the CLI: results in, strings out (no printing, no logic)."""

from __future__ import annotations

from .units import format_bytes


def table(headers: list[str], rows: list[list], *, align: str | None = None) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(values):
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(values, widths, align))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def format_probe(result, source: str = "") -> str:
    info = result.device
    rows = [[i + 1, t.micro_batch, "yes" if t.fits else "OOM", format_bytes(t.peak_bytes),
             f"{t.seconds:.2f}"] for i, t in enumerate(result.trials)]
    head = [
        f"model:      {source}",
        f"device:     {info.name}",
        f"budget:     {format_bytes(info.budget_bytes)} ({info.budget_source})",
        f"setting:    {result.precision}, checkpointing {'on' if result.checkpointing else 'off'}",
        "",
        table(["trial", "micro-batch", "fits", "peak", "seconds"], rows),
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


def _describe_model(model) -> str:
    a, b, c = model.activation
    d, e = model.step
    act = f"{format_bytes(a)} + {format_bytes(b)}·n" + (f" + {format_bytes(c)}·n²" if c else "")
    return f"max({act}, {format_bytes(d)} + {format_bytes(e)}·n)"


def format_devices(cuda: list[dict], cpu) -> str:
    lines = []
    if cuda:
        rows = [[f"cuda:{d['index']}", d["name"], format_bytes(d["total_bytes"]), format_bytes(d["free_bytes"]),
                 {True: "yes", False: "no", None: "?"}[d.get("bf16")]] for d in cuda]
        lines.append(table(["device", "name", "total", "free", "bf16"], rows, align="llrrl"))
    else:
        lines.append("no CUDA device visible to torch")
    lines.append("")
    lines.append(f"cpu: {cpu.name}; RAM {format_bytes(cpu.total_bytes)}, available "
                 f"{format_bytes(cpu.free_bytes)}; probe budget {format_bytes(cpu.budget_bytes)} "
                 f"({cpu.budget_source})")
    return "\n".join(lines)
