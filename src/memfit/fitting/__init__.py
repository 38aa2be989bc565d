"""`memfit.fit` / `memfit.preflight`: wrap a real Trainer run. run (the orchestrator), preflight_check
(preflight), recovery (OOM in a micro-step or evaluation), optimizer_step, saving, resume (with checkpoint_files:
is a checkpoint intact), interrupt (SIGINT / SIGTERM), distributed, and _trainer (every Trainer /
accelerate internal memfit touches)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.fitting.run import fit, FitReport, apply_plan
    from memfit.fitting.preflight_check import preflight, PreflightReport, PreflightFlag
    from memfit.fitting.recovery import is_oom_error
    from memfit.fitting.interrupt import FitInterrupted

__all__ = ["fit", "FitReport", "apply_plan", "preflight", "PreflightReport", "PreflightFlag", "is_oom_error",
           "FitInterrupted"]

_LAZY = {"fit": "run", "FitReport": "run", "apply_plan": "run", "preflight": "preflight_check",
         "PreflightReport": "preflight_check", "PreflightFlag": "preflight_check", "is_oom_error": "recovery",
         "FitInterrupted": "interrupt"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.fitting.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
