"""`memfit.diagnose`: read an OOM message or log, say where it happened (phase), why (causes) and what
helps (advice), in English and Chinese (strings).

Modules, one topic each: verb (`diagnose`, the orchestrator), phase (the traceback-frame table and phase
detection, shared with memfit.fit), operations (what allocated), causes (the message's arithmetic), advice
(ranking; an advice id that recommends a remedy is the remedy's id), gpu_match (the GPU a message
describes, and its plan), strings (the texts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.diagnosis.causes import CAUSE_KINDS, Cause
    from memfit.diagnosis.gpu_match import gpu_from_message
    from memfit.diagnosis.operations import Operation, detect_operation
    from memfit.diagnosis.phase import detect_phase
    from memfit.diagnosis.strings import LANGS, t
    from memfit.diagnosis.verb import Diagnosis, diagnose, read_log

__all__ = ["Cause", "CAUSE_KINDS", "Diagnosis", "diagnose", "read_log", "detect_phase", "detect_operation",
           "Operation", "gpu_from_message", "LANGS", "t"]

_LAZY = {"Cause": "causes", "CAUSE_KINDS": "causes", "Diagnosis": "verb", "diagnose": "verb", "read_log": "verb",
         "detect_phase": "phase", "detect_operation": "operations", "Operation": "operations",
         "gpu_from_message": "gpu_match", "LANGS": "strings", "t": "strings"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.diagnosis.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
