"""Memory remedies, one registered unit per module.

Each remedy says whether it applies to a setup (and if not, why), which variants of the
setup it proposes (TrainSetup field changes), and what a user changes to apply one: the
TrainingArguments kwargs, environment variables and code. Its effect is never assumed:
the planner simulates every variant it proposes (memfit.planner.search).
"""

from __future__ import annotations

from memfit.remedies.base import Remedy, Applicability
from memfit.remedies import (
    allocator, checkpointing, eval_settings, freeze, lora, micro_batch, mixed_precision, offload, optimizer,
    padding, sequence_length,
)

__all__ = ["Remedy", "Applicability", "REGISTRY", "OPT_IN"]

REGISTRY: dict[str, Remedy] = {
    r.name: r
    for r in (
        checkpointing.REMEDY, mixed_precision.REMEDY, optimizer.REMEDY, micro_batch.REMEDY,
        sequence_length.REMEDY, padding.REMEDY, eval_settings.REMEDY, allocator.REMEDY,
        freeze.REMEDY, lora.REMEDY, offload.REMEDY,
    )
}
#: `--allow` names of the remedies that change the method and need the user's consent.
OPT_IN = {r.opt_in: r.name for r in REGISTRY.values() if r.opt_in}
