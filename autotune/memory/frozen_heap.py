"""The garbage collector kept out of a plan's way: the objects that exist before a plan kept out of
its passes while it runs (``frozen_heap``), and automatic collection off where its timing would
change what is measured (``automatic_collection_off``).

A plan builds and drops thousands of fake modules and tensors, and each trial ends with a full
collection (``oom.free_memory``) so that what a trial freed is not counted in the next: every one
of those passes walked torch's and the user's whole heap as well (some 340,000 objects after
``import autotune``), which nothing the plan does can free. ``gc.freeze()`` moves them to the
permanent generation for the plan's duration and ``gc.unfreeze()`` gives them back, so cycles
among them are collected as before, only later. A 70B data-parallel estimate spent 6-7 of its
33-41 CPU s in the collector, 2-3 s with the heap frozen (``bench/README.md``).
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0
_froze = False


@contextlib.contextmanager
def frozen_heap():
    """Freeze the heap as it is for the block (also a decorator); nested and concurrent uses
    share the outermost one. A heap someone else froze already is left as they left it."""
    global _depth, _froze
    with _lock:
        if _depth == 0:
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _froze:
                gc.unfreeze()
                _froze = False


@contextlib.contextmanager
def automatic_collection_off():
    """Python's automatic garbage collection off for the block: what is left in reference cycles
    waits for an explicit ``gc.collect()`` (or the next collection after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


__all__ = ["automatic_collection_off", "frozen_heap"]
