"""memfit: make Hugging Face fine-tuning fit in GPU memory.

    from memfit import TrainSetup, estimate, plan, diagnose, preflight, fit
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainSetup", "MemoryReport", "estimate", "plan", "diagnose", "preflight", "fit", "MemfitError"]
__version__ = "0.1.0"

_LAZY = {
    "TrainSetup": "memfit.train_setup",
    "MemoryReport": "memfit.estimator",
    "estimate": "memfit.estimator",
    "diagnose": "memfit.diagnosis.causes",
    "plan": "memfit.planner.search",
    "fit": "memfit.fitting.run",
    "preflight": "memfit.fitting.run",
    "MemfitError": "memfit.errors",
}


def __getattr__(name: str) -> Any:  # PEP 562: import torch only when needed
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
