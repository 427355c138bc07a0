"""Rich display in Jupyter: Plan, ProbeResult and TrainResult render as HTML (summary table and
memory plot inline).

The view is registered with IPython's display formatter when autotune is imported inside IPython,
instead of ``_repr_html_`` methods on the data types: the types stay free of view code, and the
imports point one way (this package imports them, never the reverse).
"""

from __future__ import annotations

import sys

from ..planning.types import Plan
from ..probing.result import ProbeResult
from ..training.api import TrainResult
from .html import plan_html, probe_html, train_html

VIEWS = ((Plan, plan_html), (ProbeResult, probe_html), (TrainResult, train_html))


def register_display(shell=None) -> bool:
    """Register the HTML views with ``shell`` (default: the running IPython, if any); returns
    whether there was a shell to register with."""
    if shell is None:
        ipython = sys.modules.get("IPython")  # never imported here: only a running IPython counts
        shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return False
    formatter = shell.display_formatter.formatters["text/html"]
    for cls, view in VIEWS:
        formatter.for_type(cls, view)
    return True


__all__ = ["VIEWS", "register_display"]
