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

The workers die with the planner, whatever signal ends it, so that a pipeline reading `memfit plan`'s stdout
(which the workers inherit) sees its end:

- each worker asks the kernel for SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, prctl(2);
  it fires when the *thread* that forked it ends, and concurrent.futures forks the workers from the thread that
  first submits, the planner's main thread) and ends at once if the parent is already gone (the race prctl(2)
  describes: `getppid()` no longer the planner);
- the planner, while the pool runs, handles SIGTERM (`kill`'s default, which otherwise ends it without running
  any Python cleanup): it kills its workers, then lets the signal end it as before (the previous handler, or
  the default action, so the exit status is still "terminated by SIGTERM");
- a worker resets SIGTERM to its default action (the planner's handler is not inherited); Ctrl-C in a terminal
  reaches the whole process group, workers included, as before.

Internal to memfit.planner.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

from memfit.errors import MemfitError

__all__ = ["MAX_WORKERS", "WorkerPool", "die_with_parent", "worker_count"]

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


#: prctl(2) option: the signal this process gets when its parent (thread) dies (linux/prctl.h `PR_SET_PDEATHSIG`)
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies (module docstring); end now if it already has.
    Returns whether the kernel took the request (False off Linux or without a usable libc)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol table (a static build): the parent's SIGTERM handler remains
        armed = False
    if os.getppid() != parent_pid:  # the parent died before prctl: no signal will come (prctl(2))
        os._exit(1)
    return armed


def _worker_init(parent_pid: int) -> None:
    """In each worker: die with the planner (module docstring), SIGTERM's default action, and one intra-op
    thread (two processes with a thread pool each would oversubscribe the cores; torch.utils.data's
    workers do the same, torch/utils/data/_utils/worker.py `_worker_loop`)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent_pid)
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
        self._owner_pid = os.getpid()
        self._previous_sigterm: Any = None
        self._handling_sigterm = False
        if workers > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # fork: the workers inherit the imported modules and warm caches (no spawn, no imports). Not
            # multiprocessing.Pool: when one of its workers dies its task's result never comes
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_worker_init, initargs=(os.getpid(),))
            self._install_sigterm()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A handle whose `get()` returns `fn(*args)` or raises what it raised."""
        if self._pool is None:
            return _Done(fn, args)
        return _Pending(self._pool.submit(fn, *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # tasks nobody read are not started
            self._pool = None
        self._restore_sigterm()

    def kill_workers(self) -> None:
        """SIGKILL every worker process now (they hold no state worth saving: simulations on fake tensors)."""
        processes = getattr(self._pool, "_processes", None) or {}  # concurrent.futures: pid -> Process
        for proc in list(processes.values()):
            try:
                proc.kill()
            except (OSError, ValueError, AttributeError):  # already gone, or already reaped
                pass

    def _install_sigterm(self) -> None:
        """While the pool runs, SIGTERM kills the workers first (module docstring); only the main thread may."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._handling_sigterm = True
        except (ValueError, OSError):  # not settable here (an embedded interpreter): PR_SET_PDEATHSIG remains
            self._handling_sigterm = False

    def _restore_sigterm(self) -> None:
        if self._handling_sigterm and os.getpid() == self._owner_pid:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:  # nobody replaced it meanwhile
                signal.signal(signal.SIGTERM, self._previous_sigterm if self._previous_sigterm is not None
                              else signal.SIG_DFL)
            self._handling_sigterm = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        previous = self._previous_sigterm
        if os.getpid() == self._owner_pid:
            self.kill_workers()
        if callable(previous):  # someone's own handler (a launcher's, a test runner's) decides what follows
            previous(signum, frame)
            return
        # the default action (or SIG_IGN, as it was): restore it and send the signal again, so that the process
        # ends as `kill` meant, with the status a shell reads as "terminated by SIGTERM"
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        self._handling_sigterm = False
        if previous != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
