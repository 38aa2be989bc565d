"""What a remedy is (see memfit.remedies): one unit that owns everything memfit knows about it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Remedy", "Applicability", "TrainerAdapter", "apply_fields", "model_type"]


@dataclass(frozen=True)
class Applicability:
    applies: bool
    reason: str


#: What `apply_to_trainer` gets to change a live Trainer: memfit.fitting._trainer, passed in so
#: that remedies never import the Trainer wrapper (a layer above them).
TrainerAdapter = Any


@dataclass(frozen=True)
class Remedy:
    """One memory remedy.

    `name` is its one id: the name of its module's remedy in memfit.remedies.REGISTRY, the `--allow` name of
    an opt-in, the name a plan lists, the advice id under which diagnose recommends it and the name
    memfit.fit applies. The planner asks `check` and `variants` and describes a chosen variant with `apply`;
    memfit.fit changes a live Trainer with `apply_to_trainer`; diagnose recommends it under the ids in
    `advice`; `incompatible` names remedies it must never be combined with (the planner skips such
    combinations).
    """

    name: str  #: its id
    title: str
    saves: str  #: what memory it saves
    costs: str  #: what it costs (speed, accuracy, method)
    #: setup, gpu -> Applicability
    check: Callable[..., Applicability]
    #: setup, gpu -> list of TrainSetup field changes to simulate
    variants: Callable[..., list[dict[str, Any]]]
    #: its own changes, setup -> (TrainingArguments kwargs, env vars, code lines)
    apply: Callable[..., tuple[dict[str, Any], dict[str, str], list[str]]]
    #: the TrainSetup fields its variants change (the planner and memfit.fit find the remedy by them)
    fields: tuple[str, ...] = ()
    #: trainer, its own changes, log, adapter -> the changes applied; None: never applied automatically
    #: (it changes the training method or needs code the user writes)
    apply_to_trainer: Callable[[Any, dict[str, Any], list[str], TrainerAdapter], dict[str, Any]] | None = None
    #: memfit.diagnosis's advice ids that recommend this remedy: `name`, or `name.<variant>` where diagnose gives
    #: several pieces of advice for it (texts: memfit.diagnosis.strings ``advice.<id>``)
    advice: tuple[str, ...] = ()
    opt_in: bool = False  #: it changes the method: only with the user's consent (`--allow <name>`)
    incompatible: tuple[str, ...] = field(default_factory=tuple)
    #: the trainers (TrainSetup.trainer) it is for; empty: every trainer. A remedy of one trainer (GRPO's vLLM
    #: share) is not listed as "not applicable" in the plans of the others.
    trainers: tuple[str, ...] = ()
    #: own changes, setup -> whether these changes of its `fields` are this remedy's, where remedies share a field
    #: (checkpoint offload and reentrant checkpointing both change `gradient_checkpointing_kwargs`); None: all are
    owns: Callable[[dict[str, Any], Any], bool] | None = None

    def serves(self, trainer: str) -> bool:
        """Whether this remedy is one for `trainer`'s runs (`trainers` empty: every trainer's)."""
        return not self.trainers or trainer in self.trainers


def apply_fields(changes: dict[str, Any], setup: Any, **_: Any) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """`Remedy.apply` of a remedy whose variant is only TrainingArguments / config fields: the change is the
    variant itself, with no environment variable and no code line."""
    return dict(changes), {}, []


def model_type(setup: Any) -> str:
    """The config's `model_type` of the setup's model, for the checks of remedies that depend on it (Liger's kernels,
    peft's default LoRA targets); "" when the model does not resolve (the estimate itself fails with a clear error)."""
    from memfit.models.build import resolve_config

    try:
        return str(getattr(resolve_config(setup.model).config, "model_type", ""))
    except Exception:
        return ""
