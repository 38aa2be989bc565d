"""What a long command is simulating, and how far it is, on the terminal: a rich progress line on stderr while
`plan` searches (`simulation 4 of at most 14: micro-steps: fp16, batch 8, adamw_torch`), a multi-GPU estimate
simulates rank 0 (`simulating micro-step 2 of 2`) or bench/published.py runs its records (`record 12 of 40`),
with the elapsed time. The work says how far it is through memfit.progress; this module listens.

Shown only when stdout is a terminal and the output is not `--json`, and gone when the work ends (transient), so
a pipe or a script sees nothing extra. `console` (tests) draws on a given rich Console instead, as a terminal would.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from memfit.progress import Progress, listening

__all__ = ["progress", "describe"]


def describe(p: Progress, unit: str) -> str:
    """The line of one report: `simulation 4 of at most 14: <what>` (`unit` names what is counted; a total that
    is only a bound reads "at most")."""
    if p.total is None:
        return f"{unit} {p.done + 1}: {p.what}"
    return f"{unit} {min(p.done + 1, p.total)} of {'at most ' if unit == 'simulation' else ''}{p.total}: {p.what}"


@contextlib.contextmanager
def progress(what: str, *, json_output: bool = False, enabled: bool = True, unit: str = "simulation",
             details: bool = False, console: Any = None) -> Iterator[None]:
    """`with progress("planning gpt2 on T4"):` shows `⠋ planning gpt2 on T4: simulation 3 of at most 14: ...
    ━━━━━━━━━ 0:00:03` while the block runs.

    Args:
        what: what the command does, first on the line.
        json_output: `--json`: nothing shown.
        enabled: False: nothing shown.
        unit: what the reports count ("simulation", "record").
        details: show the steps inside one simulation (memfit.progress `detail=True`): a multi-GPU estimate.
        console: a rich Console to draw on (None: stderr, only when stdout is a terminal).
    """
    if not enabled or json_output or (console is None and not sys.stdout.isatty()):
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress as Bar, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20), TimeElapsedColumn(),
             console=console or Console(stderr=True), transient=console is None) as bar:
        task = bar.add_task(what, total=None)

        def heard(p: Progress) -> None:
            line = f"{what}: {p.what}" if p.detail else f"{what}: {describe(p, unit)}"
            bar.update(task, description=line, completed=p.done, total=p.total)

        with listening(heard, details=details):
            yield
