"""Files memfit reads and writes: JSON read with one-line errors, written whole or not at all.

`read_json_object` (on `read_user_text`) reads a JSON object a user named (an `--args` file, a saved plan, a DeepSpeed
JSON, an FSDP config); everything that can be wrong with it (missing, a folder, unreadable, not
UTF-8, not JSON, nested too deeply, not an object) is a one-line MemfitError naming the file, what
it should be and how to get one. A UTF-8 byte-order mark (what Windows editors write) is accepted.

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

from memfit.errors import MemfitError

__all__ = ["read_user_text", "read_json_object", "write_json_atomic"]


def read_user_text(path: str | os.PathLike[str], what: str, hint: str) -> str:
    """The UTF-8 text of a file the user named (a byte-order mark dropped), or a one-line MemfitError.

    Args:
        path: the file the user named.
        what: what the file is, for the message (e.g. "arguments file", "accelerate config").
        hint: how to get a right one, ending the message (e.g. "pass a JSON file of TrainingArguments kwargs").
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError as err:
        raise MemfitError(f"{what} `{path}` does not exist; {hint}") from err
    except IsADirectoryError as err:
        raise MemfitError(f"{what} `{path}` is a directory; {hint}") from err
    except OSError as err:
        raise MemfitError(f"cannot read {what} `{path}` ({err.strerror or err}); {hint}") from err
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise MemfitError(f"{what} `{path}` is not UTF-8 text (byte {err.start}); save it as UTF-8") from err


def read_json_object(path: str | os.PathLike[str], what: str, hint: str) -> dict[str, Any]:
    """The JSON object in the file at `path`, or a one-line MemfitError (arguments as `read_user_text`)."""
    text = read_user_text(path, what, hint)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise MemfitError(f"{what} `{path}` is not valid JSON ({err.msg} at line {err.lineno}); fix the file") from err
    except RecursionError as err:
        raise MemfitError(f"{what} `{path}` is nested too deeply to read; {hint}") from err
    if not isinstance(data, dict):
        raise MemfitError(f"{what} `{path}` must hold a JSON object, not `{type(data).__name__}`; {hint}")
    return data


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
