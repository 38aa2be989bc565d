"""Mixture-of-experts layers in a simulation: the grouped matmul CUDA runs, and the routing figures.

transformers 5.24 builds every MoE model it decorates with `@use_experts_implementation`
(Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, DeepSeek-V2/V3, ...) with
`experts_implementation="grouped_mm"` unless told otherwise
(modeling_utils.py, `PreTrainedModel.get_correct_experts_implementation`). Its forward
(integrations/moe.py, `grouped_mm_experts_forward`) has no data-dependent shape: the S = T * k
(token, expert) pairs are sorted by expert, gathered as one (S, hidden) tensor, multiplied by
`torch.nn.functional.grouped_mm` against *all* expert weights with per-expert offsets
(`torch.histc` + `cumsum`, E bins), and summed back per token. Every temporary has S rows whatever
the router chose; the routing only moves the offsets, i.e. which rows each expert's GEMM reads.
So one fake run gives the memory of every routing: the expected tokens per expert (T * k / E under
uniform routing) and the worst case (all T tokens to the same k experts: T each) give the same
allocations. `routing_figures` states both figures for the report.

What does not run on fake CPU tensors is the grouped matmul itself: torch's meta kernel
(torch/_meta_registrations.py, `_meta_grouped_mm_common`) accepts bfloat16 only, while the CUDA
kernel (aten/src/ATen/native/cuda/GroupedBlas.cpp, `_grouped_mm_cuda`) takes its CUTLASS fast
path for bf16 and `_grouped_mm_fallback` (a loop of `mm_out` into one preallocated output) for
float32 / float16, which is what an AMP run with float32 master weights gets (transformers casts the
input to the weight dtype, `integrations/moe.py::_grouped_mm`). The CPU kernel also refuses
expanded gradients in backward. `cuda_grouped_mm` replaces `F.grouped_mm` for the run with the
allocations of the CUDA op on both paths:

* forward: one (S, N) output in `out_dtype` or the input dtype; autograd saves `mat_a`, `mat_b` and
  `offs` (`GroupedMmBackward0` in torch/csrc/autograd/generated/Functions.h);
* backward (tools/autograd/derivatives.yaml, `_grouped_mm`): `_grouped_mm_mat1_backward` -> one
  tensor of `mat_a`'s size and strides, `_grouped_mm_mat2_backward` -> one of `mat_b`'s (E, K, N),
  each only when that input needs a gradient.

The eager experts (`experts_implementation="eager"`: a Python loop over `nonzero()` of the router's
choices) has data-dependent shapes that fake tensors cannot give; `check_experts_implementation`
says so in one line rather than letting the fake run fail.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.sim.patching import patched

__all__ = ["RoutingFigures", "routing_figures", "routing_note", "mxfp4_note", "cuda_grouped_mm", "check_experts_implementation"]

#: Expert implementations whose allocations do not depend on the routing (integrations/moe.py):
#: `grouped_mm` (sort + one grouped GEMM over S rows) and `batched_mm` (gathers S expert weight
#: matrices, `self.gate_up_proj[expert_ids]`: S x 2I x H elements).
_ROUTING_FREE = ("grouped_mm", "batched_mm")


@dataclass(frozen=True)
class RoutingFigures:
    """Tokens per expert of one MoE layer for one micro-batch."""

    tokens: int  # T = batch x sequence
    experts: int  # E routed experts per layer
    top_k: int  # k experts per token
    expected_tokens_per_expert: float  # T * k / E, uniform routing
    worst_tokens_per_expert: int  # T: every token picks the same k experts (a token picks k distinct ones)
    dispatched_rows: int  # S = T * k, the rows of every dispatch temporary whatever the routing
    experts_implementation: str
    moe_layers: int


def _moe_numbers(config: Any) -> tuple[int, int] | None:
    """(experts, top_k) of a config, or None for a dense model. Config field names per model family:
    Mixtral / gpt-oss `num_local_experts`, Qwen-MoE / OLMoE `num_experts`, DeepSeek-V2/V3 `n_routed_experts`."""
    experts = None
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            experts = value
            break
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts is None or not isinstance(top_k, int) or top_k < 1:
        return None
    return experts, top_k


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """The expert collections `@use_experts_implementation` decorated (they carry `has_gate` and `is_transposed`)."""
    return [m for m in model.modules() if hasattr(m, "is_transposed") and hasattr(m, "has_gate")
            and hasattr(m, "num_experts")]


def routing_figures(model: nn.Module, *, tokens: int) -> RoutingFigures | None:
    """The expected and worst-case tokens per expert of `model`'s MoE layers, or None for a dense model.

    Args:
        model: the built model (its config names the experts and top-k).
        tokens: tokens of one micro-batch (batch x sequence length) each MoE layer routes.
    """
    config = getattr(model, "config", None)
    numbers = _moe_numbers(config) if config is not None else None
    layers = _experts_modules(model)
    if numbers is None or not layers:
        return None
    experts, top_k = numbers
    impl = getattr(config, "_experts_implementation", None) or "grouped_mm"
    return RoutingFigures(
        tokens=tokens, experts=experts, top_k=top_k, expected_tokens_per_expert=tokens * top_k / experts,
        worst_tokens_per_expert=tokens, dispatched_rows=tokens * top_k, experts_implementation=impl,
        moe_layers=len(layers),
    )


def routing_note(figures: RoutingFigures) -> str:
    """The report's sentence about the routing the estimate assumes."""
    return (
        f"MoE: {figures.moe_layers} expert layers, {figures.experts} experts, top-{figures.top_k}; "
        f"tokens per expert per micro-batch: {figures.expected_tokens_per_expert:g} expected (uniform routing), "
        f"{figures.worst_tokens_per_expert} worst case (all tokens to the same {figures.top_k} experts); "
        f"transformers' `{figures.experts_implementation}` experts allocate {figures.dispatched_rows} "
        "dispatched rows whatever the routing, so both give this estimate"
    )


#: Model types whose hub checkpoints store the experts in MXFP4 (config `quantization_config.quant_method`).
_MXFP4_TYPES = frozenset({"gpt_oss"})


def mxfp4_note(model: nn.Module) -> str | None:
    """What memfit models of gpt-oss's MXFP4 experts, for the report (None for other models).

    transformers 5.24 cannot train the MXFP4 experts: `Mxfp4HfQuantizer.is_trainable` is False
    ("consider dequantizing the model first by passing quantization_config=Mxfp4Config(dequantize=True)",
    quantizers/quantizer_mxfp4.py), and Trainer refuses a quantized model that is not trainable. With
    `dequantize=True` the blocks and scales are converted while loading "to the dtype of the parameter they
    load into" (integrations/mxfp4.py, `Mxfp4Dequantize.convert`), and the model is the plain `GptOssExperts`
    with (E, H, 2I) / (E, I, H) weights: what memfit builds, at the weights dtype of the setup.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _MXFP4_TYPES:
        return None
    dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).removeprefix("torch.")
    return (
        "gpt-oss: the hub checkpoint's MXFP4 experts cannot be trained by transformers (Mxfp4HfQuantizer.is_trainable "
        "is False); fine-tuning loads them with Mxfp4Config(dequantize=True), which dequantizes into the parameters' "
        f"dtype: the experts are simulated dequantized, in {dtype} (OpenAI's fine-tuning recipe loads bf16: "
        "--weights-dtype bf16)"
    )


def check_experts_implementation(model: nn.Module) -> None:
    """Refuse, in one line, an experts implementation whose shapes depend on the routing values."""
    config = getattr(model, "config", None)
    if config is None or not _experts_modules(model):
        return
    impl = getattr(config, "_experts_implementation", None) or "grouped_mm"
    if impl not in _ROUTING_FREE:
        raise MemfitError(
            f"experts_implementation `{impl}` loops over the experts the router picked (shapes depend on the "
            f"data), which memfit cannot simulate; use `{_ROUTING_FREE[0]}` (transformers' default) or "
            f"`{_ROUTING_FREE[1]}`"
        )


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """`t`'s strides when they describe a dense tensor (a transposed weight), else contiguous strides."""
    if t.is_contiguous() or t.transpose(-2, -1).is_contiguous():
        return tuple(t.stride())
    return tuple(torch.empty(t.shape, device="meta").stride())


class _CudaGroupedMM(torch.autograd.Function):
    """`aten::_grouped_mm` as CUDA allocates it (see the module docstring), on any tensor."""

    @staticmethod
    def forward(ctx, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor,
                out_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.save_for_backward(mat_a, mat_b, offs)
        return mat_a.new_zeros((mat_a.shape[0], mat_b.shape[-1]), dtype=out_dtype or mat_a.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mat_a, mat_b, _ = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = mat_a.new_empty_strided(mat_a.shape, _dense_strides(mat_a)).zero_()
        if ctx.needs_input_grad[1]:
            grad_b = mat_b.new_empty_strided(mat_b.shape, _dense_strides(mat_b)).zero_()
        return grad_a, grad_b, None, None


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                _original: Any = None) -> torch.Tensor:
    if bias is not None or offs is None or mat_a.dim() != 2 or mat_b.dim() != 3:  # not transformers' call: the real op
        return _original(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    return _CudaGroupedMM.apply(mat_a, mat_b, offs, out_dtype)


@contextlib.contextmanager
def cuda_grouped_mm():
    """Replace `F.grouped_mm` (what transformers' grouped_mm experts call) for the enclosed run."""
    if not hasattr(F, "grouped_mm"):  # torch < 2.10: transformers calls torch._grouped_mm
        with patched(torch, "_grouped_mm", _make(torch._grouped_mm)):
            yield
        return
    with patched(F, "grouped_mm", _make(F.grouped_mm)):
        yield


def _make(original: Any):
    def grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
        return _grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype, _original=original)

    return grouped_mm
