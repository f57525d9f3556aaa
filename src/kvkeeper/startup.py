"""Start-up without Python's cyclic garbage collector.

Importing PyTorch, FastAPI and the engine creates a few hundred thousand long-lived objects (modules, classes,
functions), and the collector walks all of them again each time it runs during the imports.  Measured on this
machine (2 cores, 2026-12-02, load average 14 from other jobs, 3 pairs): ``import torch, fastapi, uvicorn,
kvkeeper.api.app`` took 3.89-3.99 s with the collector on and 3.19-3.37 s with it off.

:func:`paused_gc` turns it off for a block and, at the end, moves what exists then into the collector's permanent
generation (:func:`gc.freeze`, Python's own advice for long-lived start-up objects) before turning it back on, so
that the first collection afterwards does not walk every object of the start-up either.  The price: cyclic garbage
made during the block is never freed (a start-up's few kilobytes).
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc():
    """Run the block with the cyclic collector off; then freeze the objects alive (:func:`gc.freeze`) and restore
    the collector's state (on only if it was on).  Nested use is a no-op inside."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.freeze()
            gc.enable()
