"""LoRA (opt-in `lora`): train low-rank adapters (peft); the base model is frozen.

Gradients and optimizer state shrink to the adapters'; activations mostly stay.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.lora_r is not None:
        return Applicability(False, f"already LoRA r={setup.lora_r}")
    if getattr(setup, "peft_config", None):  # peft methods
        return Applicability(False, f"already a peft method ({setup.peft_config.get('peft_type')})")
    return Applicability(True, "gradients and optimizer state only for the adapters")


def _apply(changes, setup, **_):
    r = changes["lora_r"]
    return {}, {}, [
        "from peft import LoraConfig, get_peft_model",
        f"model = get_peft_model(model, LoraConfig(r={r}, lora_alpha={2 * r}, task_type=...))",
    ]


REMEDY = Remedy(
    name="lora", title="LoRA", opt_in=True,
    saves="gradients and optimizer state of the base model", costs="a different method (adapters, not full fine-tuning)",
    check=_check, variants=lambda setup, gpu: [{"lora_r": 16}], apply=_apply,
    fields=("lora_r",), advice=("lora",),
)
