"""Files memfit writes: whole or not at all.

`write_json_atomic` writes to a temporary file in the target's folder and moves it into place with
`os.replace` (atomic on POSIX and Windows), so a reader, another process or a crash never sees a
half-written file; on any failure the temporary file (memfit's own) is removed and the error raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

__all__ = ["write_json_atomic"]


def write_json_atomic(path: str | os.PathLike[str], obj: Any, **dump_kwargs: Any) -> None:
    """Write `obj` as JSON to `path` atomically; `dump_kwargs` go to `json.dump` (e.g. indent, default)."""
    folder = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, **dump_kwargs)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # memfit's own temporary file
        raise
