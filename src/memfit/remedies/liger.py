"""Liger kernels (`use_liger_kernel=True`): fused linear cross-entropy, RMSNorm, RoPE, SwiGLU/GeGLU.

The fused linear cross-entropy computes the loss chunk by chunk from the hidden states, so the
B x S x V logits (and their float32 upcast in transformers' `ForCausalLMLoss`) never exist: for
vocabularies of 128k-256k tokens they are the largest activation of a step. The other kernels
save fewer tensors than the Hugging Face modules (liger_kernel/ops/*.py). Liger patches the
model types it knows (`MODEL_TYPE_TO_APPLY_LIGER_FN`); memfit runs Liger's own patching with the
Triton launches emulated (memfit.sim.kernels.liger), so the variant is simulated, not assumed.
"""

import importlib.util

from memfit.remedies.base import Applicability, Remedy, model_type


def _check(setup, gpu):
    if setup.use_liger_kernel:
        return Applicability(False, "already on")
    if gpu is not None and getattr(gpu, "vendor", "nvidia") not in ("nvidia", "amd"):
        return Applicability(False, "Liger's Triton kernels need a CUDA or ROCm GPU")
    if importlib.util.find_spec("liger_kernel") is None:
        return Applicability(False, "liger-kernel is not installed here, so memfit cannot simulate it "
                                    "(pip install liger-kernel, or memfit[llm])")
    from memfit.sim.kernels.liger import liger_supported_model_types

    mtype = model_type(setup)
    if mtype not in liger_supported_model_types():
        return Applicability(False, f"Liger has no kernels for model type `{mtype}`")
    from memfit.sim.kernels.liger import liger_import_error

    broken = liger_import_error(mtype)
    if broken is not None:
        return Applicability(False, broken)
    return Applicability(True, "no B x S x V logits with the fused linear cross-entropy; leaner norms and MLPs")


def _apply(changes, setup, **_):
    return {"use_liger_kernel": True}, {}, ["# pip install liger-kernel"]


REMEDY = Remedy(
    name="liger", title="Liger kernels",
    saves="the logits and their float32 copy (fused linear cross-entropy), norm and MLP activations",
    costs="none measured by Liger (often faster); needs the liger-kernel package (Triton)",
    check=_check, variants=lambda setup, gpu: [{"use_liger_kernel": True}], apply=_apply,
    fields=("use_liger_kernel",), advice=("liger",),
)
