"""The one exception type memfit raises for bad user input.

Every message says what was wrong, the offending value in backticks, and the fix,
as in accelerate's `estimate-memory`. The CLI prints it on one line and exits 2.
"""

from __future__ import annotations

__all__ = ["MemfitError", "first_line"]


class MemfitError(ValueError):
    """A user-facing error: bad input, unknown model, impossible setting."""


def first_line(err: BaseException) -> str:
    """The first non-empty line of an upstream exception's message, whole (a line is what the CLI prints) and
    without its final full stop (memfit's sentence follows), or the exception's type name when it has none."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip().rstrip(".")
    return type(err).__name__
