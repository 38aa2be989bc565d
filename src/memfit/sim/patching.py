"""`patched`: the one primitive of every process-global patch a simulation makes (memfit.sim.cuda_patches, the
kernels, autocast, offload): `owner.name` replaced for the enclosed code, the original back on exit, also
when the code raises."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["patched"]


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Set `owner.name = replacement` for the enclosed code; yields the original."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, original)
