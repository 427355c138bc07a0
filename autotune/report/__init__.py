"""``autotune.report``: what autotune decided, drawn (matplotlib, the ``plot`` extra) and as HTML."""

from .plots import load_metrics, plot_metrics, plot_plan, plot_probe
from .html import plan_html, probe_html, train_html, write_report

__all__ = ["load_metrics", "plan_html", "plot_metrics", "plot_plan", "plot_probe", "probe_html",
           "train_html", "write_report"]
