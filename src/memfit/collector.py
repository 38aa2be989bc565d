"""Python's cyclic garbage collector paused while memfit imports torch/transformers and simulates.

A cold `memfit estimate` imports torch, transformers and the model's code (hundreds of thousands
of long-lived objects) and then creates tens of thousands of short-lived ones (FakeTensors,
trace records, allocator blocks). Every 700 net allocations CPython runs a collection of the
young generation, every 10 of those one of the middle one, and a full collection of every
tracked object whenever the objects promoted since the last full one exceed a quarter of the
old generation (CPython 3.11 Modules/gcmodule.c `collect_generations`, `long_lived_pending`).
While the heap is being built by the imports that condition keeps coming true. Measured on
2026-12-01 (2-core machine, load average ~3.5): the first seed-case estimate in a fresh process spent
2.2 s of 9.7 s in 8 full collections and 0.4 s in young ones (`gc.callbacks`); that estimate plus a
BERT one took 9.85 s with the collector and 5.71 s with it off, with identical reports and traces.

Pausing it changes no result: a simulated storage is freed when its last reference goes
(reference counting, the `weakref.finalize` of memfit.sim.tracker), never by the cyclic
collector; `tests/cli/test_collector.py` checks that no tracked storage is left to it, by collecting
after a simulation run with the collector paused and finding no further free. Garbage in
reference cycles made meanwhile is collected once the collector is back on.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["paused"]


@contextmanager
def paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the previous state (on or off) restored after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
