"""What a long command is simulating, and for how long, on the terminal: a rich spinner with the elapsed time
on stderr while `plan` searches or a multi-GPU estimate simulates its ranks. Shown only when stdout is a
terminal and the output is not `--json`, and gone when the work ends, so a pipe or a script sees nothing extra.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["progress"]


@contextlib.contextmanager
def progress(what: str, *, json_output: bool = False, enabled: bool = True) -> Iterator[None]:
    """`with progress("planning gpt2 on T4"):` shows `⠋ planning gpt2 on T4 0:00:03` while the block runs."""
    if not enabled or json_output or not sys.stdout.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        bar.add_task(what, total=None)
        yield
