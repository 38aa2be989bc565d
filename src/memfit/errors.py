"""The one exception type memfit raises for bad user input.

Every message says what was wrong, the offending value in backticks, and the fix,
as in accelerate's `estimate-memory`. The CLI prints it on one line and exits 2.
"""

from __future__ import annotations

__all__ = ["MemfitError"]


class MemfitError(ValueError):
    """A user-facing error: bad input, unknown model, impossible setting."""
