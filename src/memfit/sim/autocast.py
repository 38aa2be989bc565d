"""CUDA's autocast policy, applied to CPU (fake) tensors during a simulation.

CPU autocast casts a different set of ops than CUDA autocast, so simulating AMP with
`torch.autocast("cpu")` would save the wrong tensors for backward. While a simulation
runs, memfit replaces every AutocastCPU kernel by one that applies the CUDA policy.

Op lists: `AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`
and `AT_FORALL_PROMOTE` in aten/src/ATen/autocast_mode.h (torch 2.13; the installed
header is compared with these lists in tests/sim/test_autocast.py). Cast rules and the weight
cache: `cached_cast`, `is_eligible`, `set_opt_dtype` and `WrapFunction_` in
aten/src/ATen/autocast_mode.{h,cpp}.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from memfit.sim import _torch_adapter as adapter
from memfit.sim.patching import patched

__all__ = ["LOWER_PRECISION_OPS", "FP32_OPS", "FP32_SET_OPT_DTYPE_OPS", "PROMOTE_OPS", "cuda_autocast", "cuda_autocast_policy"]

LOWER_PRECISION_OPS = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE_OPS = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
PROMOTE_OPS = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)


def _overload(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


def _eligible(t: object) -> bool:
    # autocast_mode.h `is_eligible`: a defined floating-point tensor that is not float64.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


class _Policy:
    def __init__(self, low: torch.dtype) -> None:
        self.low = low
        # autocast_mode.cpp `cached_casts`: fp32 leaf tensors that require grad (the weights), cast
        # to the low dtype, are cached until autocast exits; the cache holds the casts alive.
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, t: object, dtype: torch.dtype) -> object:
        if isinstance(t, (list, tuple)):
            return type(t)(self.cast(x, dtype) for x in t)
        if not _eligible(t) or t.dtype is dtype:
            return t
        can_cache = (
            dtype is self.low and t.dtype is torch.float32 and t.requires_grad and t.is_leaf and not adapter.is_view(t)
        )
        if can_cache:
            hit = self.cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        out = t.to(dtype)
        if can_cache:
            self.cache[id(t)] = (t, out)
        return out

    def kernel(self, name: str, kind: str):
        op = _overload(name)
        dtype_index = None
        if kind == "set_opt_dtype":
            names = adapter.op_argument_names(op)
            dtype_index = names.index("dtype") if "dtype" in names else None

        def run(*args, **kwargs):
            with adapter.exclude_autocast_cpu():
                if kind == "low":
                    args = tuple(self.cast(a, self.low) for a in args)
                    kwargs = {k: self.cast(v, self.low) for k, v in kwargs.items()}
                elif kind == "fp32":
                    args = tuple(self.cast(a, torch.float32) for a in args)
                    kwargs = {k: self.cast(v, torch.float32) for k, v in kwargs.items()}
                elif kind == "set_opt_dtype":
                    # `set_opt_dtype(at::kFloat, args)` when the first tensor arg is eligible.
                    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                    if first is not None and _eligible(first) and dtype_index is not None:
                        if len(args) > dtype_index:
                            if args[dtype_index] is None:
                                args = args[:dtype_index] + (torch.float32,) + args[dtype_index + 1 :]
                        elif kwargs.get("dtype") is None:
                            kwargs = {**kwargs, "dtype": torch.float32}
                elif kind == "promote":
                    tensors = [a for a in list(args) + list(kwargs.values()) if _eligible(a)]
                    if tensors:
                        widest = tensors[0].dtype
                        for t in tensors[1:]:
                            widest = torch.promote_types(widest, t.dtype)
                        args = tuple(self.cast(a, widest) for a in args)
                        kwargs = {k: self.cast(v, widest) for k, v in kwargs.items()}
                return op(*args, **kwargs)

        return run


@contextlib.contextmanager
def cuda_autocast_policy(dtype: torch.dtype | None) -> Iterator[_Policy | None]:
    """Install the CUDA policy at AutocastCPU for the whole enclosed code (a simulation run).

    The kernels act only where CPU autocast is enabled. Installing them for the whole run, not
    just the forward, matters for gradient checkpointing: the recomputation in the backward
    re-enters `torch.autocast("cpu", ...)` (torch/utils/checkpoint.py `recompute_fn` /
    `_checkpoint_hook`), and must see CUDA's policy there too, not CPU's. The policy's cast
    cache is dropped whenever autocast drops its own: on leaving the outermost region
    (`autocast.__exit__` -> `torch.clear_autocast_cache()`), the forward's or a recomputation's.
    """
    global _ACTIVE
    if dtype is None or _ACTIVE is not None:
        yield _ACTIVE if dtype is not None else None
        return
    policy = _Policy(dtype)
    kernels: dict[str, object] = {}
    # Neutralise CPU-only autocast rules: every op with an AutocastCPU kernel runs unchanged...
    for full in adapter.autocast_cpu_op_names():
        name = full.removeprefix("aten::")
        try:
            kernels[full] = policy.kernel(name, "none")
        except AttributeError:
            continue
    # ...except the ops CUDA's policy names.
    for kind, names in (("low", LOWER_PRECISION_OPS), ("fp32", FP32_OPS),
                        ("set_opt_dtype", FP32_SET_OPT_DTYPE_OPS), ("promote", PROMOTE_OPS)):
        for name in names:
            try:
                kernels["aten::" + name] = policy.kernel(name, kind)
            except AttributeError:  # op absent from this torch build
                continue
    plain_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        policy.cache.clear()
        plain_clear()

    _ACTIVE = policy
    try:
        with patched(torch, "clear_autocast_cache", clear_autocast_cache), adapter.override_autocast_cpu(kernels):
            yield policy
    finally:
        _ACTIVE = None
        policy.cache.clear()


_ACTIVE: _Policy | None = None


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None) -> Iterator[_Policy | None]:
    """Run the enclosed code as `torch.autocast("cuda", dtype)` would on a GPU.

    Must be entered inside a simulation (fake or real CPU tensors). `dtype=None` is a
    no-op (fp32 training). The cast cache is dropped on exit, like autocast's
    `clear_cache()` when the outermost autocast region ends. Uses the policy installed by
    `cuda_autocast_policy` when one is (the engine installs it for a whole run).
    """
    if dtype is None:
        yield None
        return
    with cuda_autocast_policy(dtype) as policy, torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        try:
            yield policy
        finally:
            policy.cache.clear()
