"""The one place that parses and formats byte sizes.

Accepts what users and PyTorch write: `16GiB`, `15.78 GiB`, `512 MiB`, `2.00 MiB`,
`16GB` (decimal, 10**9), `1024` (bytes), `12g` (binary, as `nvidia-smi` users mean it).
PyTorch's OOM message uses binary units with two decimals (`format_size` in
c10/cuda/CUDACachingAllocator.cpp); `format_bytes` mirrors that.
"""

from __future__ import annotations

import re

from memfit.errors import MemfitError

__all__ = ["KiB", "MiB", "GiB", "TiB", "parse_size", "format_bytes", "format_size_torch"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": TiB, "tib": TiB, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, *, what: str = "size") -> int:
    """Parse `16GiB`, `15.78 GiB`, `16GB`, `512MiB`, `1024` into bytes."""
    if isinstance(text, bool):
        raise MemfitError(f"{what} `{text}` is not a size; write e.g. `16GiB` or `512MiB`")
    if isinstance(text, (int, float)):
        if text < 0:
            raise MemfitError(f"{what} `{text}` is negative; give a positive size such as `16GiB`")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise MemfitError(
            f"{what} `{text}` is not a size; write a number and a unit, e.g. `16GiB`, `512MiB` or `16GB`"
        )
    return int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))


def format_bytes(n_bytes: float, *, digits: int = 2) -> str:
    """Human form with binary units: `14.31 GiB`, `2.00 MiB`, `512 B`."""
    n = float(n_bytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"


def format_size_torch(n_bytes: int) -> str:
    """Exactly as PyTorch formats sizes in OOM messages.

    Mirrors `format_size` in c10/cuda/CUDACachingAllocator.cpp: below 1 KiB `N bytes`,
    then KiB / MiB / GiB with two decimals (no TiB).
    """
    if n_bytes <= 1024:
        return f"{n_bytes} bytes"
    if n_bytes <= 1048576:
        return f"{n_bytes / 1024.0:.2f} KiB"
    if n_bytes <= 1073741824:
        return f"{n_bytes / 1048576.0:.2f} MiB"
    return f"{n_bytes / 1073741824.0:.2f} GiB"
