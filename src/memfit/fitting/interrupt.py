"""Ctrl-C (SIGINT) and SIGTERM during `memfit.fit`: finish the optimizer step, save a checkpoint, stop.

Schedulers (Slurm, Kubernetes, SageMaker spot) send SIGTERM and kill the job a grace period
later; without a handler Python dies at once (SIGTERM's default action) and Ctrl-C raises
`KeyboardInterrupt` wherever the loop is, so the steps since the last checkpoint are lost.
While `stop_on_signals()` is active, the first SIGINT or SIGTERM only records the signal; at
the end of the current optimizer step the callback asks Trainer to save a checkpoint and stop
(`TrainerControl.should_save` / `should_training_stop`, handled by `Trainer._maybe_log_save_evaluate`
and the training loop's break in transformers 5.24), and skips the evaluation of that step.
`memfit.fit` then writes its report and raises `FitInterrupted`, a `SystemExit` whose code is
the shell's convention for a process ended by that signal, 128 + the signal number (130 for
SIGINT, 143 for SIGTERM). A second signal of the same kind goes to the previous handler at
once (Python's `KeyboardInterrupt`, or SIGTERM's default action).

Handlers are installed only in the main thread (`signal.signal` works nowhere else) and only
where the previous one is Python's default (`signal.default_int_handler` for SIGINT,
`SIG_DFL` for SIGTERM): a handler of the caller's own, or an ignored signal, is left alone.
The previous handlers are restored on exit. With several processes (torchrun forwards the
signal to every rank, not necessarily at the same step) the ranks agree on the signal at every
step end (one `all_reduce` of a flag), so that all stop and save at the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger("memfit.fit")

__all__ = ["FitInterrupted", "SignalStop", "stop_on_signals", "stop_callback", "exit_code"]


def exit_code(signum: int) -> int:
    """The exit status a shell reports for a process ended by signal `signum`: 128 + signum (130, 143)."""
    return 128 + int(signum)


class FitInterrupted(SystemExit):
    """`memfit.fit` stopped on SIGINT/SIGTERM after saving a checkpoint; the report is written.

    `code` is 128 + the signal number (exit status 130 for Ctrl-C, 143 for SIGTERM) when it
    reaches the interpreter uncaught. `report`: the FitReport; `checkpoint`: the newest
    checkpoint this run wrote (None when none could be written).
    """

    def __init__(self, signal_name: str, signum: int, report: Any, checkpoint: str | None) -> None:
        super().__init__(exit_code(signum))
        self.signal_name = signal_name
        self.signum = signum
        self.report = report
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        where = f"; checkpoint {self.checkpoint}" if self.checkpoint else "; no checkpoint could be written"
        return (f"{self.signal_name} received: training stopped after optimizer step "
                f"{self.report.steps_completed}/{self.report.steps_expected}{where}")


class SignalStop:
    """The signal received while active (`received`, a signal number or None); see the module docstring."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = signals
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            logger.warning("memfit: %s received: finishing this optimizer step, then saving a checkpoint and "
                           "stopping (send it again to stop at once)", signal.Signals(signum).name)
            return
        self.restore()
        signal.raise_signal(signum)  # the previous disposition: KeyboardInterrupt, or SIGTERM's default action

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for signum in self.signals:
            current = signal.getsignal(signum)
            if current is defaults.get(signum, signal.SIG_DFL):
                signal.signal(signum, self._handle)
                self.previous[signum] = current

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def __enter__(self) -> "SignalStop":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def stop_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> SignalStop:
    """A context manager: SIGINT/SIGTERM inside it are recorded in `.received` instead of ending the process."""
    return SignalStop(signals)


def stop_callback(stop: SignalStop):
    """A TrainerCallback that saves a checkpoint and stops at the end of the step during which a signal came."""
    from transformers import TrainerCallback

    class _StopOnSignal(TrainerCallback):
        def __init__(self) -> None:
            self.stopping = False

        def on_step_end(self, args, state, control, **kwargs):
            from memfit.fitting.distributed import agree_max

            # every rank stops at the same step (a save has collectives), whichever rank got the signal
            received = agree_max(stop.received or 0)
            if received and stop.received is None:
                stop.received = received
            if stop.received is not None and not self.stopping:
                self.stopping = True
                control.should_save = True  # even with save_strategy="no": the steps would be lost otherwise
                control.should_evaluate = False
                control.should_training_stop = True

        def on_epoch_end(self, args, state, control, **kwargs):
            if self.stopping:  # the checkpoint of this step is written already; no end-of-epoch evaluation
                control.should_save = False
                control.should_evaluate = False

    return _StopOnSignal()
