"""Freeze the embeddings, and optionally the lower half of the blocks (opt-in `freeze`).

Frozen parameters get no gradient and no optimizer state; frozen lower blocks also keep no
activations for the weight gradients of their layers. Word embeddings are a large share of
small models (BERT-base: 23M of 110M). Freezing changes what is trained.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.freeze_embeddings and setup.freeze_layers:
        return Applicability(False, "embeddings and lower blocks already frozen")
    if setup.lora_r is not None:
        return Applicability(False, "LoRA already freezes the base model")
    if getattr(setup, "peft_config", None):  # peft methods
        return Applicability(False, "the peft method already freezes the base model")
    return Applicability(True, "no gradient or optimizer state for the embedding matrix")


def _variants(setup, gpu):
    from memfit.models.blocks import repeated_layer_lists
    from memfit.models.build import build_meta_model

    out = [{"freeze_embeddings": True}]
    stacks = repeated_layer_lists(build_meta_model(setup))
    if stacks and len(stacks[0][1]) >= 2:
        out.append({"freeze_embeddings": True, "freeze_layers": len(stacks[0][1]) // 2})
    return [v for v in out if any(getattr(setup, k) != x for k, x in v.items())]


def _apply(changes, setup, **_):
    code = ["model.get_input_embeddings().requires_grad_(False)"]
    n = changes.get("freeze_layers")
    if n:
        code.append(f"for block in <the model's layer list, e.g. model.bert.encoder.layer>[:{n}]: "
                    "block.requires_grad_(False)")
    return {}, {}, code


REMEDY = Remedy(
    name="freeze", title="freeze embeddings", opt_in=True,
    saves="gradients and optimizer state of the embeddings", costs="embeddings are not fine-tuned",
    check=_check, variants=_variants, apply=_apply,
    fields=("freeze_embeddings", "freeze_layers"),
    incompatible=("lora",),  # LoRA freezes the whole base model already: freezing parts of it adds nothing
)
