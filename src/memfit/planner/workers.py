"""Worker processes for the planner's independent simulations (`memfit plan` < 10 s on 2 cores).

`memfit.plan` runs a dozen simulations whose inputs are known before any of them runs (the baseline estimate
and the partial simulations of memfit.planner.memory_model). `WorkerPool` runs them in processes forked from
the planner *after* it imported torch and transformers, so a worker pays no imports and starts from the
parent's warm caches. Results come back by value (pickled); an exception raised in a worker (a MemfitError
for a combination that cannot run) is raised again, as the same type and message, where the result is read.

`worker_count` decides how many processes: 1 (today's serial path, everything in this process) unless
forking is safe here, that is:

- the platform is Linux (macOS and Windows default to `spawn`, where a worker would import everything again;
  Python's multiprocessing docs, "Contexts and start methods": fork is unsafe on macOS);
- this process holds no CUDA context (`torch.cuda.is_initialized()`: a forked child cannot use it, torch's
  "Poison fork" note in torch/cuda/__init__.py `_lazy_init`) and no process group
  (`torch.distributed.is_initialized()`: memfit.fit under a launcher);
- no other Python thread runs (a lock held by another thread at the fork stays held in the child forever);
- `MEMFIT_WORKERS` is not `1` (`MEMFIT_WORKERS=N` caps the count; the default is the CPUs this process may
  run on, `os.sched_getaffinity`, at most `MAX_WORKERS`).

Internal to memfit.planner.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

from memfit.errors import MemfitError

__all__ = ["MAX_WORKERS", "WorkerPool", "worker_count"]

#: at most this many worker processes: a plan has about a dozen simulations, the longest (the baseline
#: estimate) a third of the work, so more workers than this only cost memory (each holds a meta model)
MAX_WORKERS = 4


def worker_count(requested: int | None = None) -> int:
    """How many processes run the planner's simulations (1: all in this one).

    Args:
        requested: a count asked for (memfit.plan's `workers`); None: `MEMFIT_WORKERS`, else the usable CPUs.
    """
    if requested is None:
        text = os.environ.get("MEMFIT_WORKERS", "").strip()
        if text:
            try:
                requested = int(text)
            except ValueError:
                raise MemfitError(f"MEMFIT_WORKERS `{text}` is not a whole number; set it to 1 (no worker "
                                  "processes) or to how many the planner may use") from None
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise MemfitError(f"workers `{requested}` must be a whole number >= 1 (1: no worker processes)")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(requested if requested is not None else cpus, MAX_WORKERS if requested is None else requested)
    if n <= 1 or not _fork_is_safe():
        return 1
    return n


def _fork_is_safe() -> bool:
    """Linux, no CUDA context, no process group, no other Python thread (see the module's docstring)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_initialized():
            return False
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return False
    return True


def _worker_init() -> None:
    """In each worker: one intra-op thread (two processes with a thread pool each would oversubscribe the
    cores; torch.utils.data's workers do the same, torch/utils/data/_utils/worker.py `_worker_loop`)."""
    import torch

    torch.set_num_threads(1)


class _Done:
    """A result computed in this process (the serial path): `get` returns it or raises its exception."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self._fn, self._args, self._ran, self._value, self._error = fn, args, False, None, None

    def get(self) -> Any:
        if not self._ran:  # lazily, in the order the planner reads results (as before the pool existed)
            self._ran = True
            try:
                self._value = self._fn(*self._args)
            except Exception as e:  # noqa: BLE001 - raised again on every get, as a worker's would be
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value


class _Pending:
    """A task in a worker: `get` waits for its result or raises what it raised."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def get(self) -> Any:
        from concurrent.futures.process import BrokenProcessPool

        try:
            return self._future.result()
        except BrokenProcessPool:  # a worker was killed (out of host memory, a signal): never wait forever
            raise MemfitError("a planner worker process died while simulating (out of host memory?); run again "
                              "with `MEMFIT_WORKERS=1` to simulate in this process") from None


class WorkerPool:
    """Runs functions (module-level, picklable arguments and results) in forked workers, or lazily here.

    Use as a context manager: leaving it stops the workers (a task nobody read is not started).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = None
        if workers > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # fork: the workers inherit the imported modules and warm caches (no spawn, no imports). Not
            # multiprocessing.Pool: when one of its workers dies its task's result never comes
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_worker_init)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A handle whose `get()` returns `fn(*args)` or raises what it raised."""
        if self._pool is None:
            return _Done(fn, args)
        return _Pending(self._pool.submit(fn, *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # tasks nobody read are not started
            self._pool = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
