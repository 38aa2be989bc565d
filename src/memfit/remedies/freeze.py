"""Freeze the embeddings (opt-in `freeze`): no gradients or optimizer state for them.

Word embeddings are a large share of small models (BERT-base: 23M of 110M). Freezing them
changes what is trained.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.freeze_embeddings:
        return Applicability(False, "embeddings already frozen")
    if setup.lora_r is not None:
        return Applicability(False, "LoRA already freezes the base model")
    return Applicability(True, "no gradient or optimizer state for the embedding matrix")


def _apply(changes, setup, **_):
    return {}, {}, ["model.get_input_embeddings().requires_grad_(False)"]


REMEDY = Remedy(
    name="freeze", title="freeze embeddings", opt_in="freeze",
    saves="gradients and optimizer state of the embeddings", costs="embeddings are not fine-tuned",
    check=_check, variants=lambda setup, gpu: [{"freeze_embeddings": True}], apply=_apply,
)
