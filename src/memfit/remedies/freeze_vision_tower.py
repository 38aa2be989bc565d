"""Freeze the vision tower (opt-in `freeze_vision_tower`): a vision-language model's image encoder, or an image
classifier's backbone, gets no gradient and no optimizer state (memfit.models.freezing).

The Hugging Face VLM fine-tuning recipes often train the language model (and the projector) only; the tower's
weights then stay as pretrained. Its forward still runs, and keeps what the projector's backward needs, but no
activation is kept for the tower's own weight gradients. It changes what is trained, hence opt-in.
"""

from memfit.remedies.base import Applicability, Remedy

_TASKS = ("image-text-to-text", "image-cls")


def _check(setup, gpu):
    if setup.task not in _TASKS:
        return Applicability(False, "vision-language models and image classifiers only")
    if setup.freeze_vision_tower:
        return Applicability(False, "the vision tower is frozen already")
    if setup.lora_r is not None or getattr(setup, "peft_config", None):
        return Applicability(False, "the peft method already freezes the base model, the tower with it")
    return Applicability(True, "no gradient or optimizer state for the tower's weights")


def _variants(setup, gpu):
    return [{"freeze_vision_tower": True}] if _check(setup, gpu).applies else []


def _apply(changes, setup, **_):
    line = ("model.get_encoder(modality=\"image\").requires_grad_(False)  # the vision tower" if
            setup.task == "image-text-to-text" else "model.base_model.requires_grad_(False)  # the backbone")
    return {}, {}, [line]


REMEDY = Remedy(
    name="freeze_vision_tower", title="freeze the vision tower", opt_in=True, advice=("freeze_vision_tower",),
    saves="gradients, optimizer state and activations of the vision tower", costs="the tower is not fine-tuned",
    check=_check, variants=_variants, apply=_apply, fields=("freeze_vision_tower",), incompatible=("lora",),
)
