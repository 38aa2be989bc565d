"""What a remedy is (see memfit.remedies)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Remedy", "Applicability"]


@dataclass(frozen=True)
class Applicability:
    applies: bool
    reason: str


@dataclass(frozen=True)
class Remedy:
    name: str
    title: str
    saves: str  #: what memory it saves
    costs: str  #: what it costs (speed, accuracy, method)
    #: setup, gpu -> Applicability
    check: Callable[..., Applicability]
    #: setup, gpu -> list of TrainSetup field changes to simulate
    variants: Callable[..., list[dict[str, Any]]]
    #: changes, setup -> (TrainingArguments kwargs, env vars, code lines)
    apply: Callable[..., tuple[dict[str, Any], dict[str, str], list[str]]]
    opt_in: str | None = None  #: `--allow` name when the remedy changes the method
    incompatible: tuple[str, ...] = field(default_factory=tuple)
