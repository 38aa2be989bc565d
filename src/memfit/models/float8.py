"""torchao Float8 training: `nn.Linear` layers swapped for torchao's `Float8Linear`, as accelerate's
`mixed_precision="fp8"` with the torchao backend does it, simulated from torchao's own code under fake tensors.

How accelerate 1.15 applies it (accelerator.py `Accelerator._prepare_ao` -> utils/ao.py `convert_model_to_fp8_ao`):
`torchao.float8.convert_to_float8_training(model, module_filter_fn=..., config=AORecipeKwargs.config)`, whose default
filter (utils/ao.py `filter_linear_layers` with `find_first_last_linear_layers`) keeps the first and the last
`nn.Linear` of `model.named_modules()` in high precision (for Llama: `layers.0.self_attn.q_proj` and `lm_head`)
and every linear whose `in_features` or `out_features` is not a multiple of 16. The step runs under bf16 autocast
(accelerate utils/modeling.py `get_mixed_precision_context_manager`: `mixed_precision in ["bf16", "fp8"]`).
memfit calls accelerate's `convert_model_to_fp8_ao` itself on the meta model, with
`Float8LinearConfig.from_recipe_name(recipe)` (torchao 0.18 float8/config.py) and `pad_inner_dim=True`, as
accelerate's default `AORecipeKwargs()` sets it (`convert_float8`). For tensorwise that is accelerate's default
config but for `enable_fsdp_float8_all_gather`, which only changes FSDP2's all-gather (not modelled here).

What this changes in memory is whatever torchao's code allocates, recorded by the tracker like any other op: the
float8 casts of input / weight / grad_output with their float32 scales, and `torch._scaled_mm`'s output (its meta
kernel). What autograd keeps for backward is torchao 0.18 float8/float8_linear.py
`matmul_with_hp_or_float8_args.forward`: `ctx.save_for_backward(input_hp, weight_hp_t)`, the high-precision input
(bf16 under autocast) and a view of the float32 master weight, in all three recipes; the backward casts again.
So Float8 does not shrink the saved linear inputs; against bf16 autocast it saves the bf16 weight copy that
autocast makes for each plain `F.linear` (and that autograd keeps for backward), and adds transient float8
copies. The CPU build of `torch._scaled_mm` runs too, so tests/models/test_float8.py compares the fake trace with a real
CPU run event for event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from memfit.errors import MemfitError

if TYPE_CHECKING:  # torch is imported where it is used
    import torch.nn as nn

#: float8 GEMMs (`torch._scaled_mm`) need compute capability 8.9 or newer: torch aten/src/ATen/native/cuda/Blas.cpp
#: `_scaled_mm_allowed_device` (major >= 9, or 8.9), and the rowwise kernels exist for sm89, sm9x and sm10x
#: (aten/src/ATen/native/cuda/RowwiseScaledMM.cu `f8f8bf16_rowwise`). L4 / RTX 4090 / L40S are 8.9, H100 9.0,
#: B200 10.0.
MIN_COMPUTE_CAPABILITY = (8, 9)


def check_float8_gpu(compute_capability: tuple[int, int]) -> None:
    """A one-line MemfitError when the target GPU has no float8 GEMMs (run where the GPU is known: the engine)."""
    cc = tuple(compute_capability)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise MemfitError(f"float8 matmuls (torch._scaled_mm) need a GPU of compute capability 8.9 or newer (L4, "
                          f"RTX 4090, L40S, H100, B200); this one has `{cc}` (memfit assumes (8, 0) without a GPU); "
                          f"pass e.g. `--gpu H100-80GB`")


def convert_float8(model: nn.Module, recipe: str) -> list[str]:
    """Swap `model`'s linears for torchao Float8Linear as accelerate does (module docstring); the converted names."""
    try:
        _import_torchao_quietly()
        from accelerate.utils.ao import convert_model_to_fp8_ao
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as err:  # pragma: no cover - the `llm` extra installs torchao
        raise MemfitError(f"float8 training needs torchao (`pip install 'torchao>=0.18'`): {err}") from err
    import dataclasses

    # pad_inner_dim=True as accelerate's AORecipeKwargs default sets it (utils/dataclasses.py `AORecipeKwargs.
    # __post_init__`, ACCELERATE_FP8_PAD_INNER_DIM default True): the CUDA `_scaled_mm` needs inner dims that are
    # multiples of 16 (torch/_meta_registrations.py `meta_scaled_mm`, checked off the CPU only), and the grad_weight
    # GEMM's inner dim is the token count; torchao pads with zeros (float8/float8_ops.py `preprocess_addmm`).
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    convert_model_to_fp8_ao(model, config=config)
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def _import_torchao_quietly() -> None:
    """Import torchao with its import-time log lines silenced: on a CPU-only machine torchao/__init__.py logs
    "Failed to load ..._C_*.so" for its CUDA extensions (float8 training does not use them: Float8Linear is Python
    over `torch._scaled_mm`), and torch's pytree logs a deprecation for torchao's registered Enums."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def float8_note(recipe: str, converted: list[str], kept: list[str]) -> str:
    """The report's note: the recipe, which linears were converted and which stayed in high precision."""
    shown = ", ".join(kept[:6]) + (f" and {len(kept) - 6} more" if len(kept) > 6 else "")
    return (f"torchao Float8 training, recipe `{recipe}` (accelerate mixed_precision=\"fp8\", torchao backend): "
            f"{len(converted)} linears converted to Float8Linear; kept in high precision: {shown or 'none'} "
            "(accelerate's filter_linear_layers: the first and last linear, and dims not multiples of 16). torchao "
            "saves the bf16 input and the fp32 weight for backward, so the saved inputs do not shrink; the bf16 weight "
            "copies autocast would keep are not made")


def high_precision_linears(model: nn.Module) -> list[str]:
    """Names of the plain `nn.Linear` modules left (after `convert_float8`)."""
    import torch.nn as nn
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Float8Linear)]


@contextlib.contextmanager
def cuda_autocast_queries() -> Iterator[None]:
    """`Float8Linear.forward` as it runs on a GPU under CUDA autocast.

    torchao 0.18 float8/float8_linear.py `Float8Linear.forward` casts its input itself: `if
    torch.is_autocast_enabled(): input = input.to(torch.get_autocast_gpu_dtype())`. Both calls ask about CUDA
    autocast; a simulation runs CPU autocast with CUDA's policy (memfit.sim.autocast), where they would answer
    False / the CUDA default, and the input would stay float32 (saved for backward at twice its size). While a
    Float8Linear forward runs, they answer with the simulation's autocast state.
    """
    import torch
    from torchao.float8.float8_linear import Float8Linear

    plain_forward, plain_enabled, plain_dtype = Float8Linear.forward, torch.is_autocast_enabled, torch.get_autocast_gpu_dtype

    def enabled(device_type: str | None = None) -> bool:
        return plain_enabled("cpu" if device_type in (None, "cuda") else device_type)

    def forward(self, input):
        torch.is_autocast_enabled, torch.get_autocast_gpu_dtype = enabled, lambda: torch.get_autocast_dtype("cpu")
        try:
            return plain_forward(self, input)
        finally:
            torch.is_autocast_enabled, torch.get_autocast_gpu_dtype = plain_enabled, plain_dtype

    Float8Linear.forward = forward
    try:
        yield
    finally:
        Float8Linear.forward = plain_forward
