"""QLoRA (opt-in `qlora`): the frozen base weights in 4 bits (bitsandbytes NF4, double quantization),
LoRA adapters trained on top.

Weights shrink to about 0.5 byte per parameter plus the block statistics (memfit.models.quantization);
the layers that stay unquantized (the LM head, norms) stay in their dtype, and peft's
`prepare_model_for_kbit_training` casts them to float32 (modelled, unless `kbit_prep` is off). Each
quantized matmul dequantizes its weight (a temporary of the layer's size) in the forward and again in
the backward: slower steps. It changes the method (a quantized base model, adapters instead of full
fine-tuning), so it is only proposed with `--allow qlora`, which allows LoRA too (a quantized base
trains only through adapters: transformers' Trainer refuses a purely quantized model, and so does memfit).
"""

import importlib.util

from memfit.remedies.base import Applicability, Remedy
from memfit.train_setup import TASKS


def _check(setup, gpu):
    if setup.load_in_4bit or setup.load_in_8bit:
        return Applicability(False, f"already {'4' if setup.load_in_4bit else '8'}-bit")
    if getattr(setup, "peft_config", None):  # peft methods: the remedy adds LoRA, the setup has its own
        return Applicability(False, "the setup trains another peft method; QLoRA here adds LoRA adapters")
    if gpu is not None and getattr(gpu, "vendor", "nvidia") != "nvidia":
        return Applicability(False, "bitsandbytes' 4-bit CUDA kernels are modelled for NVIDIA GPUs only")
    if importlib.util.find_spec("bitsandbytes") is None:
        return Applicability(False, "bitsandbytes is not installed here, so memfit cannot simulate it "
                                    "(pip install bitsandbytes, or memfit[llm])")
    return Applicability(True, "base weights at ~0.5 byte/parameter; only the adapters train")


def _variants(setup, gpu):
    cc = tuple(gpu.compute_capability) if gpu is not None else tuple(setup.compute_capability)
    compute = "bf16" if cc >= (8, 0) else "fp16"
    return [{"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": compute,
             "bnb_4bit_use_double_quant": True}]


def _apply(changes, setup, **_):
    compute = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}[
        changes.get("bnb_4bit_compute_dtype") or "fp32"]
    code = [
        "# pip install bitsandbytes",
        "from transformers import BitsAndBytesConfig",
        f'bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{changes.get("bnb_4bit_quant_type", "nf4")}", '
        f"bnb_4bit_compute_dtype={compute}, bnb_4bit_use_double_quant={changes.get('bnb_4bit_use_double_quant', True)})",
        f"model = {TASKS[setup.task]}.from_pretrained(..., quantization_config=bnb)",
    ]
    if setup.kbit_prep:
        code += ["from peft import prepare_model_for_kbit_training",
                 "model = prepare_model_for_kbit_training(model)  # float32 norms/head, gradient checkpointing"]
    return {}, {}, code  # the adapters (lora_r) are described by memfit.remedies.lora


REMEDY = Remedy(
    name="qlora", title="QLoRA (4-bit base weights)", opt_in=True,
    saves="about 3/4 of the weights (bf16) or 7/8 (fp32), and the base model's gradients and optimizer state",
    costs="a different method (quantized frozen base, adapters); dequantization makes steps slower",
    check=_check, variants=_variants, apply=_apply,
    fields=("load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant"),
)
