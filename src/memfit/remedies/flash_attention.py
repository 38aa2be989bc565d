"""A memory-efficient attention kernel: FlashAttention-2 instead of eager or SDPA's math path.

Eager attention keeps the S x S probabilities of every layer for the backward; SDPA's flash and
memory-efficient backends keep only the output and a float32 logsumexp, but PyTorch picks its math
path in some cases (an explicit mask on some GPUs, fp32). FlashAttention-2 (the flash-attn package,
`attn_implementation="flash_attention_2"` in `from_pretrained`) never materialises S x S and also
takes padding-free (varlen) batches. It needs compute capability 8.0+ (Ampere or newer) and fp16/bf16
(flash-attn csrc/flash_attn/flash_api.cpp `mha_fwd` checks; memfit.sim.kernels.flash_attn). Its effect
is simulated like every remedy: the variant runs transformers' flash path with the kernels emulated.
"""

from memfit.remedies.base import Applicability, Remedy
from memfit.train_setup import TASKS

_FLASH = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2", "kernels-community/vllm-flash-attn3")


def _cc(setup, gpu):
    return tuple(gpu.compute_capability) if gpu is not None else tuple(setup.compute_capability)


def _check(setup, gpu):
    if setup.attn_implementation in _FLASH:
        return Applicability(False, f"already {setup.attn_implementation}")
    if gpu is not None and getattr(gpu, "vendor", "nvidia") != "nvidia":
        return Applicability(False, "flash-attn's CUDA kernels are for NVIDIA GPUs (ROCm has its own build, not modelled)")
    cc = _cc(setup, gpu)
    if cc < (8, 0):
        return Applicability(False, f"FlashAttention-2 needs compute capability 8.0+ (Ampere or newer); this GPU has "
                                    f"{cc[0]}.{cc[1]}")
    return Applicability(True, "no S x S attention matrix kept for the backward, whatever the mask")


def _variants(setup, gpu):
    # fp32 runs cannot use it: the variant is combined with the mixed-precision axis by the planner,
    # and a combination with fp32 fails its simulation with memfit's MemfitError (then it is skipped)
    return [{"attn_implementation": "flash_attention_2"}]


def _apply(changes, setup, **_):
    impl = changes["attn_implementation"]
    return {}, {}, [
        "# pip install flash-attn --no-build-isolation",
        f'model = {TASKS[setup.task]}.from_pretrained(..., attn_implementation="{impl}")',
    ]


REMEDY = Remedy(
    name="flash_attention", title="FlashAttention-2",
    saves="the attention probabilities (S x S per head and layer) and SDPA's math-path temporaries",
    costs="none (usually faster); needs the flash-attn package, an Ampere or newer GPU and fp16/bf16",
    check=_check, variants=_variants, apply=_apply,
    fields=("attn_implementation",), advice=("flash_attention",),
)
