"""Gradient checkpointing: keep each block's input, recompute its activations in the backward.

Saves most activation memory (all but one block's internals plus the block inputs); costs
one extra forward (about a third more compute, Chen et al. 2016). Where Hugging Face has no
implementation (XLNet in transformers 5), memfit.models.blocks wraps the blocks itself.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.gradient_checkpointing:
        if (setup.load_in_4bit or setup.load_in_8bit) and setup.kbit_prep and setup.kbit_use_gradient_checkpointing:
            # memfit.train_setup `_check_quantization`: peft's prepare_model_for_kbit_training enables it
            return Applicability(False, "already on: peft's prepare_model_for_kbit_training (kbit prep, on by default "
                                        "for quantized models) enables it")
        return Applicability(False, "already enabled")
    return Applicability(True, "recomputes activations in the backward")


def _apply(changes, setup, *, kind: str | None = None):
    if kind == "memfit":
        return ({}, {}, [
            "from memfit.models.blocks import enable_checkpointing",
            "enable_checkpointing(model)  # transformers has none for this model; do NOT set gradient_checkpointing=True",
        ])
    return {"gradient_checkpointing": True}, {}, []


def _apply_to_trainer(trainer, changes, log, adapter):
    if not changes.get("gradient_checkpointing"):
        return {}
    model = trainer.model
    if getattr(model, "supports_gradient_checkpointing", False):
        # transformers 5.24 Trainer reads `activation_checkpointing` (trainer.py `_inner_training_loop`);
        # `gradient_checkpointing` only mirrors it after TrainingArguments.__post_init__: set both
        trainer.args.activation_checkpointing = trainer.args.gradient_checkpointing = True
        log.append("gradient_checkpointing True (Hugging Face's)")
    else:
        from memfit.models.blocks import enable_checkpointing

        kind = enable_checkpointing(model)
        log.append(f"gradient checkpointing enabled ({kind}'s per-block wrapper: the model has none)")
    return {"gradient_checkpointing": True}


REMEDY = Remedy(
    name="gradient_checkpointing", title="gradient checkpointing",
    saves="activations of every block but the one being recomputed", costs="~33% more compute per step",
    check=_check, variants=lambda setup, gpu: [{"gradient_checkpointing": True}], apply=_apply,
    fields=("gradient_checkpointing",), apply_to_trainer=_apply_to_trainer, advice=("gradient_checkpointing",),
)
