"""What helps against an out-of-memory error, ranked: the message's advice, the operation's, the phase's.

An advice id that recommends a memory remedy is that remedy's id (memfit.remedies: `Remedy.advice`,
``<remedy>`` or ``<remedy>.<variant>``), so `memfit plan`, `memfit.fit` and this advice name a remedy
the same way; the other ids (stopping other processes, the driver, DeepSpeed's and FSDP's settings, ...)
are advice no remedy of this version simulates. The texts are memfit.diagnosis.strings' ``advice.<id>``.
"""

from __future__ import annotations

import re

from memfit.diagnosis.causes import MessageCauses
from memfit.diagnosis.operations import OPERATION_ADVICE, Operation
from memfit.diagnosis.strings import t
from memfit.trace import (BACKWARD, DATA_COLLATION, EVAL, FORWARD, LOAD_BEST, MODEL_LOADING, OPTIMIZER, RESUME,
                          SAVE, UNKNOWN)

__all__ = ["PHASE_ADVICE", "rank_advice", "advice_text", "remedies_of"]

#: Advice ids per phase, most effective first.
PHASE_ADVICE: dict[str, tuple[str, ...]] = {
    FORWARD: ("truncation", "micro_batch", "gradient_checkpointing", "lora"),
    BACKWARD: ("gradient_checkpointing", "micro_batch", "truncation", "lora"),
    OPTIMIZER: ("optimizer", "lora"),
    EVAL: ("eval_settings.batch_size", "eval_settings.accumulation_steps", "eval_settings.preprocess_logits"),
    SAVE: ("save_only_model",),
    LOAD_BEST: ("load_best_fresh",),
    RESUME: ("resume_checkpoint",),
    DATA_COLLATION: ("collator_cpu", "truncation", "micro_batch"),
    MODEL_LOADING: ("smaller_model_load", "lora"),
    UNKNOWN: ("micro_batch", "truncation", "gradient_checkpointing", "optimizer"),
}

#: Advice that only helps while training: Liger's fused linear cross-entropy skips the logits only
#: in training mode with labels (liger-kernel 0.8.5 liger_kernel/transformers/model/llama.py
#: lce_forward: `skip_logits = self.training and (labels is not None or shift_labels is not None)`);
#: evaluation still materialises them.
_TRAINING_ONLY_ADVICE = {"liger"}
#: The allocator remedy (expandable segments): first when fragmentation decides the allocation, last when it
#: only contributes to a true shortfall.
_ALLOCATOR = "allocator"


def _operation_advice(op: Operation, phase: str) -> list[str]:
    """The operation's advice, then that of the operations around it (outermost last)."""
    ids = [a for name in (op.name, *op.context) for a in OPERATION_ADVICE.get(name, ())]
    if phase == EVAL:
        ids = [a for a in ids if a not in _TRAINING_ONLY_ADVICE]
    return ids


#: advice for an error inside a part of an image model (memfit.diagnosis.model_part), before the operation's
PART_ADVICE = {"vision_tower": ("smaller_images", "freeze_vision_tower"), "projector": ("smaller_images",)}


def rank_advice(found: MessageCauses, phase: str, op: Operation = Operation(), part: str = "") -> list[str]:
    """Advice ids, most effective first: cause-specific ones first (the message's arithmetic, then the
    part of the model's and the operation's); on a true shortfall the phase's remedies come before the allocator
    settings, which then only trim a contributing fragmentation. In the evaluation loop the phase's remedies (eval
    batch size, accumulation, preprocess_logits) come before the operation's. Host RAM gets its own advice only."""
    if not found.gpu_advice:
        return list(dict.fromkeys(found.first))
    late = [_ALLOCATOR] if found.shortfall and _ALLOCATOR in found.first else []
    op_ids = list(PART_ADVICE.get(part, ())) + _operation_advice(op, phase)
    phase_ids = list(PHASE_ADVICE[phase])
    middle = phase_ids + op_ids if phase == EVAL else op_ids + phase_ids
    ids = [a for a in found.first if a not in late] + middle + late
    return list(dict.fromkeys(ids)) + [a for a in found.last if a not in ids]


def _without_hf_checkpointing(log_text: str, setup: object) -> bool:
    """The model is one transformers 5 gives no gradient checkpointing (XLNet), by the log or the setup."""
    if re.search(r"modeling_xlnet\.py|does not support (?:gradient|activation) checkpointing", log_text):
        return True
    model = getattr(setup, "model", None)
    if model is None:
        return False
    name = model if isinstance(model, str) else (getattr(model, "model_type", "") or type(model).__name__)
    return "xlnet" in str(name).lower()


def advice_text(advice_id: str, lang: str, *, pids: str, tool: str, log_text: str, setup: object) -> str:
    """The text of one advice id (`pids`: the other processes, `tool`: the GPU's monitoring tool)."""
    text = t(f"advice.{advice_id}", lang, pids=pids, tool=tool)
    if advice_id == "gradient_checkpointing" and _without_hf_checkpointing(log_text, setup):
        text += t("advice.gradient_checkpointing.memfit", lang)
    return text


def remedies_of(advice_ids: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The memfit.remedies the advice recommends, in its order (the names `memfit plan` uses)."""
    from memfit.remedies import remedy_for_advice

    return tuple(dict.fromkeys(r.name for r in map(remedy_for_advice, advice_ids) if r is not None))
