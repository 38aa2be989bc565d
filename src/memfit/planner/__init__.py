"""`memfit.plan`: the fastest configuration that fits (search), ranked by a step-time model (throughput)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.planner.search import Plan, PlanResult, plan, DEFAULT_MARGIN
    from memfit.planner.throughput import StepCost, step_time_s

__all__ = ["Plan", "PlanResult", "plan", "DEFAULT_MARGIN", "StepCost", "step_time_s"]

_LAZY = {"Plan": "search", "PlanResult": "search", "plan": "search", "DEFAULT_MARGIN": "search", "StepCost": "throughput", "step_time_s": "throughput"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.planner.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
