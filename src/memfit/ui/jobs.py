"""One memfit verb run for the web app in a child process: the CLI's own code (`memfit.process.main`) on an
argument list, its `--html` page, its printed text and its one-line error, with a way to stop it.

Why a child process: a simulation cannot be interrupted from another thread, and a cancelled one must not go
on holding a CPU; the child is killed instead. It is forked (the parent has imported memfit, and after
`warm_up` torch and transformers too, so a run does not import them again), runs nothing but the verb, and
sends back plain data (str, int) over a pipe. Nothing the user uploaded is executed: uploads reach the
verb as JSON files it reads with its own readers (memfit.files, memfit.commands._args).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Outcome", "Job", "warm_up"]


@dataclass(frozen=True)
class Outcome:
    """What a verb left: its exit code, its page (the `--html` file), its stdout and its error line."""

    code: int  #: the CLI's exit code: 0 done, 1 done with a negative answer (does not fit, no OOM found), 2 user error
    html: str | None
    text: str
    error: str | None  #: the one-line error the CLI prints (`memfit estimate: error: ...`), None when there is none


def _child(argv: list[str], html_path: str, conn) -> None:
    """Run `memfit <argv>` here with stdout/stderr captured; send an Outcome's fields; exit at once."""
    out, err = io.StringIO(), io.StringIO()
    code = 2
    try:
        from memfit.process import main, quiet_import_noise

        quiet_import_noise()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as exc:  # noqa: BLE001 - an internal error is one line in the page, not a traceback
        err.write(f"memfit {argv[0] if argv else ''}: internal error: {type(exc).__name__}: {exc}\n")
        code = 3
    page = None
    try:
        page = Path(html_path).read_text(encoding="utf-8")
    except OSError:
        pass
    errors = [ln for ln in err.getvalue().splitlines() if ": error:" in ln]
    try:
        conn.send((code, page, out.getvalue(), errors[-1] if errors else None))
    finally:
        conn.close()
        os._exit(0)  # no atexit, no flush of the parent's buffers: the child shares them after the fork


class Job:
    """`memfit <argv> --html <a fresh file>` in a forked child. `poll()` until it returns an Outcome; `cancel()`
    kills the child, also while another thread polls (the app's cancel button)."""

    def __init__(self, argv: list[str]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="memfit-ui-")
        self.html_path = str(Path(self._dir.name) / "view.html")
        self.argv = [*argv, "--html", self.html_path]
        self.started_s = time.monotonic()
        ctx = mp.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(self.argv, self.html_path, send), daemon=True)
        self._proc.start()
        send.close()
        self.outcome: Outcome | None = None
        self._cancelled = False  #: set before the child is killed, so that a poll meanwhile reads a cancel

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s

    def poll(self, timeout_s: float = 0.5) -> Outcome | None:
        """The Outcome once the child is done (None while it runs)."""
        if self.outcome is not None:
            return self.outcome
        if self._cancelled:
            return None  # cancel() is ending the child and sets the outcome
        try:
            ready = self._recv.poll(timeout_s)
        except (OSError, ValueError):  # the pipe closed by cancel() from another thread meanwhile
            return self.outcome
        if ready:
            try:
                code, page, text, error = self._recv.recv()
            except EOFError:  # the child died without an answer (killed, out of host memory)
                if self._cancelled:  # killed by cancel(), which sets the outcome
                    return self.outcome
                code, page, text, error = 3, None, "", "memfit: the simulation stopped without an answer"
            self.outcome = Outcome(code, page, text, error)
        elif self._cancelled:
            return self.outcome
        elif not self._proc.is_alive():
            self.outcome = Outcome(3, None, "", f"memfit: the simulation ended with exit code {self._proc.exitcode}")
        if self.outcome is not None:
            self._finish()
        return self.outcome

    def cancel(self) -> None:
        """Stop the child (SIGKILL if it does not end on SIGTERM within a second)."""
        if self.outcome is not None:
            return
        self._cancelled = True
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(1.0)
            if self._proc.is_alive():
                self._proc.kill()
        if self.outcome is None:
            self.outcome = Outcome(130, None, "", "cancelled")
        self._finish()

    def _finish(self) -> None:
        self._proc.join(1.0)
        self._recv.close()
        self._dir.cleanup()


def warm_up() -> None:
    """Import what every simulation needs (torch, transformers, memfit's estimator) in this process, so that the
    children forked later start with it (seconds per run otherwise)."""
    from memfit.process import quiet_import_noise

    quiet_import_noise()
    import memfit.estimator  # noqa: F401
    import memfit.planner.search  # noqa: F401
    import memfit.diagnosis.verb  # noqa: F401
