"""The `memfit` console script and `python -m memfit`: `entry` runs the command (memfit.process.main) in a
`memfit serve` child where one runs for this environment, else in this process, and ends the process with it.
`main` is memfit.process.main, the command line without the process's end (tests, scripts).
"""

from __future__ import annotations

import os
import sys
import threading

from memfit.process import COMPUTE_VERBS, finish_process, main, run_here

__all__ = ["main", "entry"]


def entry() -> None:
    """The `memfit` console script and `python -m memfit`: `main()` in a process that ends with it.

    For the verbs that only compute and print (memfit.process.COMPUTE_VERBS) the collector stays off to the end
    and the process ends without tearing the interpreter down: a simulation leaves millions of small objects
    (fake tensors, traces), and collecting and freeing them at exit cost 0.9 s of a 4.9 s `memfit estimate` (and
    re-enabling the collector after the verb another 0.3 s: one full collection), measured on the 2-core
    machine (bench/README.md). What an exit must still do is done first: output flushed, atexit
    handlers run (logging, multiprocessing, tempfile); with a non-daemon thread still running the normal exit
    is taken, as it would join it. `train` exits normally: its run owns files and processes. Where a
    `memfit serve` of this environment runs, a compute verb runs in a child of it (memfit.server).
    """
    argv = sys.argv[1:]
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb not in COMPUTE_VERBS:
        sys.exit(main(argv))
    try:
        from memfit.server import run_served  # a `memfit serve` of this environment runs it warm, if one runs

        code = run_served(argv)
    except KeyboardInterrupt:  # before a served child could be told
        print("memfit: interrupted", file=sys.stderr)
        _exit_now(130)
    _exit_now(run_here(argv) if code is None else code)


def _exit_now(code: int) -> None:
    """End the process with `code` after what Python's own exit would do that anyone can see (see `entry`)."""
    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if not hasattr(__import__("atexit"), "_run_exitfuncs") or busy:
        sys.exit(code)
    finish_process()
    os._exit(code)


if __name__ == "__main__":
    entry()
