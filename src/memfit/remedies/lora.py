"""LoRA (opt-in `lora`): train low-rank adapters (peft); the base model is frozen.

Gradients and optimizer state shrink to the adapters'; activations mostly stay. The adapters go where peft puts
them by default (a vision-language model: memfit.models.peft_methods.VLM_LORA_TARGETS, the language model's
q_proj / v_proj); for a model type peft has no default for (Whisper, ViT, Wav2Vec2, XLNet, ...), on every linear
layer but the output head (peft's `all-linear`, as QLoRA's recipe trains them).
"""

from memfit.remedies.base import Applicability, Remedy, model_type


def _check(setup, gpu):
    if setup.lora_r is not None:
        return Applicability(False, f"already LoRA r={setup.lora_r}")
    if getattr(setup, "peft_config", None):  # peft methods
        return Applicability(False, f"already a peft method ({setup.peft_config.get('peft_type')})")
    return Applicability(True, "gradients and optimizer state only for the adapters")


def _variants(setup, gpu):
    from memfit.models._peft_adapter import has_default_lora_targets

    own = setup.lora_target_modules or setup.task == "image-text-to-text"  # a VLM: memfit's own default targets
    if own or has_default_lora_targets(model_type(setup)):
        return [{"lora_r": 16}]
    # peft's shorthand as a string (TrainSetup makes it ["all-linear"]): a variant's values key the planner's fits
    return [{"lora_r": 16, "lora_target_modules": "all-linear"}]


def _apply(changes, setup, **_):
    r = changes["lora_r"]
    targets = ', target_modules="all-linear"' if changes.get("lora_target_modules") in ("all-linear", ["all-linear"]) \
        else ""
    return {}, {}, [
        "from peft import LoraConfig, get_peft_model",
        f"model = get_peft_model(model, LoraConfig(r={r}, lora_alpha={2 * r}{targets}, task_type=...))",
    ]


REMEDY = Remedy(
    name="lora", title="LoRA", opt_in=True,
    saves="gradients and optimizer state of the base model", costs="a different method (adapters, not full fine-tuning)",
    check=_check, variants=_variants, apply=_apply,
    fields=("lora_r", "lora_target_modules"), advice=("lora",),
)
