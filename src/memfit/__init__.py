"""memfit: make Hugging Face fine-tuning fit in GPU memory.

    from memfit import TrainSetup, estimate, plan, diagnose, preflight, fit

The four verbs and their results:

* `estimate(setup, gpu=...) -> MemoryReport`: peak memory per phase and category, reserved
  memory, what `nvidia-smi` and the OOM message would show.
* `plan(setup, gpu=...) -> PlanResult`: the fastest configuration that fits, with the change.
* `diagnose(text_or_exception_or_path) -> Diagnosis`: why an OOM happened, what helps.
* `preflight(trainer) -> PreflightReport` and `fit(trainer) -> FitReport`: check and run a
  real Trainer, recovering from out-of-memory errors without lost steps.

Bad input raises `MemfitError` everywhere, with the value and the fix in its message.
Names load lazily (PEP 562), so `import memfit` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._version import __version__

if TYPE_CHECKING:
    from memfit.diagnosis.verb import Diagnosis, diagnose
    from memfit.errors import MemfitError
    from memfit.estimator import MemoryReport, estimate
    from memfit.fitting.preflight_check import PreflightReport, preflight
    from memfit.fitting.callback import MemfitCallback
    from memfit.fitting.run import FitReport, fit
    from memfit.planner.search import PlanResult, plan
    from memfit.train_setup import TrainSetup

__all__ = [
    "TrainSetup", "estimate", "plan", "diagnose", "preflight", "fit",
    "MemoryReport", "PlanResult", "Diagnosis", "PreflightReport", "FitReport", "MemfitError",
    "MemfitCallback",  # TRL
]

_LAZY = {
    "TrainSetup": "memfit.train_setup",
    "MemoryReport": "memfit.estimator",
    "estimate": "memfit.estimator",
    "Diagnosis": "memfit.diagnosis.verb",
    "diagnose": "memfit.diagnosis.verb",
    "PlanResult": "memfit.planner.search",
    "plan": "memfit.planner.search",
    "FitReport": "memfit.fitting.run",
    "fit": "memfit.fitting.run",
    "PreflightReport": "memfit.fitting.preflight_check",
    "preflight": "memfit.fitting.preflight_check",
    "MemfitError": "memfit.errors",
    "MemfitCallback": "memfit.fitting.callback",
}


def __getattr__(name: str) -> Any:  # PEP 562: import torch only when needed
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
