"""`memfit.diagnose`: read an OOM message or log, say why it happened and what helps (causes),
in English and Chinese (strings)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.diagnosis.causes import Cause, Diagnosis, diagnose
    from memfit.diagnosis.strings import LANGS, t

__all__ = ["Cause", "Diagnosis", "diagnose", "LANGS", "t"]

_LAZY = {"Cause": "causes", "Diagnosis": "causes", "diagnose": "causes", "LANGS": "strings", "t": "strings"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.diagnosis.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
