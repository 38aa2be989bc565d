"""Memory remedies, one registered unit per module.

Each remedy says whether it applies to a setup (and if not, why), which variants of the
setup it proposes (TrainSetup field changes), what a user changes to apply one (the
TrainingArguments kwargs, environment variables and code), how memfit.fit applies it to a live
Trainer, under which advice ids diagnose recommends it, and what it cannot be combined with. Its
effect is never assumed: the planner simulates every variant it proposes
(memfit.planner.search). REGISTRY's order is the order a plan lists its remedies in.

A remedy has one id (`Remedy.name`, its module's name): the registry, `--allow`, the planner's
plans, diagnose's advice and memfit.fit all use it. Adding a remedy is writing its module and
naming it in `_MODULES`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, NamedTuple

from memfit.errors import MemfitError

from memfit.remedies.base import Remedy, Applicability

__all__ = ["Remedy", "Applicability", "REGISTRY", "OPT_IN", "ALIASES", "remedy_id", "remedy_for_field",
           "remedy_for_advice", "conflict", "Implied", "implied_changes"]

#: The remedy modules (memfit.remedies.<id>, each with its `REMEDY`), in the order a plan lists them.
_MODULES = ("mixed_precision", "gradient_checkpointing", "checkpoint_offload", "reentrant_checkpointing", "optimizer", "micro_batch",
            "truncation", "lora", "freeze", "offload", "eval_settings", "allocator", "padding", "flash_attention",
            "liger", "qlora", "vllm_share", "fewer_generations", "shorter_completions", "no_reference",
            "freeze_vision_tower", "smaller_images", "no_pan_and_scan", "fewer_beams", "shorter_generation")


def _load(module: str) -> Remedy:
    r: Remedy = importlib.import_module(f"memfit.remedies.{module}").REMEDY
    bad = [a for a in r.advice if a != r.name and not a.startswith(f"{r.name}.")]
    if r.name != module or bad:  # one id: the module's name, and the advice under it
        raise AssertionError(f"remedy module `{module}`: its REMEDY is named `{r.name}` and advises {bad}; a "
                             f"remedy is named as its module and its advice ids are `{module}` or `{module}.<variant>`")
    return r


REGISTRY: dict[str, Remedy] = {m: _load(m) for m in _MODULES}
#: The remedies that change the method and need the user's consent: their ids are the `--allow` names.
OPT_IN: tuple[str, ...] = tuple(name for name, r in REGISTRY.items() if r.opt_in)
#: Earlier names of remedies, accepted wherever a remedy is named (`allow`, `exclude`) with a warning: name -> id.
ALIASES: dict[str, str] = {"sequence_length": "truncation"}

_BY_FIELD: dict[str, Remedy] = {}
for _r in REGISTRY.values():  # a field two remedies share (gradient_checkpointing_kwargs): the first one's, whose
    for _f in _r.fields:      # apply_to_trainer sets the field whole (memfit.fit)
        _BY_FIELD.setdefault(_f, _r)
_BY_ADVICE = {a: r for r in REGISTRY.values() for a in r.advice}


def remedy_id(name: str) -> str:
    """The id of the remedy `name` names: `name` itself, or the id an alias of `ALIASES` stands for (with a
    FutureWarning that names the id)."""
    if name in ALIASES:
        warnings.warn(f"memfit: remedy `{name}` is called `{ALIASES[name]}`; `{name}` is accepted as its earlier "
                      "name", FutureWarning, stacklevel=3)
        return ALIASES[name]
    return name


def remedy_for_field(name: str) -> Remedy | None:
    """The remedy whose variants change the TrainSetup field `name` (None: no remedy does)."""
    return _BY_FIELD.get(name)


def remedy_for_advice(advice_id: str) -> Remedy | None:
    """The remedy a diagnose advice id recommends (None: advice that is not a remedy, e.g. stopping
    another process)."""
    return _BY_ADVICE.get(advice_id)


def conflict(names: list[str] | tuple[str, ...]) -> str | None:
    """Why remedies `names` cannot be combined (a remedy's `incompatible` names another), else None."""
    for a in names:
        for b in REGISTRY[a].incompatible:
            if b in names:
                return f"{a} cannot be combined with {b}"
    return None


class Implied(NamedTuple):
    """A candidate's changes without those its other changes already bring about."""

    changes: dict[str, Any]  #: the changes a user makes
    implied: dict[str, str]  #: field -> why it is already in effect (TrainSetup's note)


def implied_changes(base: Any, changes: dict[str, Any]) -> Implied:
    """Drop from `changes` the fields that TrainSetup's normalisation already sets from the other changes.

    A quantized model with `kbit_prep` gets gradient checkpointing from peft's
    `prepare_model_for_kbit_training` (memfit.train_setup `_check_quantization`), so a plan that adds QLoRA must
    not also propose "enable gradient checkpointing": the user would change nothing, and the reason it is on is
    kbit prep. Generic: a field is implied when `base.replace(**other changes)` already has its value; the why is
    the note that normalisation added (or a plain sentence when it added none).

    Args:
        base: the TrainSetup as it is.
        changes: TrainSetup field changes of a candidate.
    """
    kept = dict(changes)
    implied: dict[str, str] = {}
    for key in list(changes):
        if getattr(base, key) == changes[key]:
            continue
        others = {k: v for k, v in kept.items() if k != key}
        try:
            without = base.replace(**others)
        except MemfitError:  # the other changes alone are not a valid setup (QLoRA without its adapters): needed
            continue
        if getattr(without, key) == changes[key]:
            new_notes = [n for n in without.notes if n not in base.notes]
            implied[key] = new_notes[0] if new_notes else f"`{key}` is already `{changes[key]!r}` with the other changes"
            del kept[key]
    return Implied(kept, implied)
