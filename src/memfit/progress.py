"""How far long work is: what the planner, a multi-GPU estimate and the benchmarks are simulating now,
and how many of how many steps are done.

The work calls `report(what, done, total)`; nothing happens unless a caller listens (`listening(callback)`):
memfit's results never depend on it, and the pure functions print nothing. The CLI listens only on a
terminal (memfit.commands._progress draws a rich progress bar on stderr). A callback belongs to the process
that set it: the planner's forked workers (memfit.planner.workers) inherit it and stay silent.

`detail=True` marks the steps inside one simulation (micro-steps, optimizer steps, the evaluation): a
listener gets them only when it asks for them, so a plan's bar counts its simulations and is not reset by
the steps of each.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["Progress", "report", "listening", "is_listening"]


@dataclass(frozen=True)
class Progress:
    """One report: `done` of `total` steps are finished (total None: not known) and `what` runs now."""

    what: str
    done: int
    total: int | None
    detail: bool = False  #: a step inside one simulation


@dataclass(frozen=True)
class _Listener:
    callback: Callable[[Progress], None]
    details: bool
    pid: int


_LISTENER: ContextVar[_Listener | None] = ContextVar("memfit_progress", default=None)


def report(what: str, done: int, total: int | None = None, *, detail: bool = False) -> None:
    """Tell the listener, if any, that `what` runs now with `done` of `total` steps finished."""
    listener = _LISTENER.get()
    if listener is None or listener.pid != os.getpid() or (detail and not listener.details):
        return
    listener.callback(Progress(what, done, total, detail))


def is_listening() -> bool:
    """Whether a listener of this process hears reports (work that costs something to count asks first)."""
    listener = _LISTENER.get()
    return listener is not None and listener.pid == os.getpid()


@contextlib.contextmanager
def listening(callback: Callable[[Progress], None], *, details: bool = False) -> Iterator[None]:
    """While the block runs, `callback(Progress)` hears every report of this process (the steps inside a
    simulation too with `details=True`)."""
    token = _LISTENER.set(_Listener(callback, details, os.getpid()))
    try:
        yield
    finally:
        _LISTENER.reset(token)
