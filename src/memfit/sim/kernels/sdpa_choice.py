"""Which fused kernel CUDA's `scaled_dot_product_attention` picks (memfit.sim.kernels.sdpa emulates it).

Re-implements `select_sdp_backend` of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
the default priority order and the filters `can_use_cudnn_attention`,
`can_use_flash_attention`, `can_use_mem_efficient_attention`, for a GPU of a given compute
capability. Known limitations: see memfit.sim.kernels.sdpa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from memfit.gpus.catalog import FALLBACK_SM_COUNT

if TYPE_CHECKING:  # pragma: no cover
    from memfit.gpus.catalog import GpuSpec

__all__ = ["SdpaChoice", "choose_backend", "num_sms", "ASSUMED_CUDNN_VERSION", "Backend"]

Backend = Literal["flash", "efficient", "math", "cudnn"]

#: cuDNN runtime version assumed for the CUDA wheels of a recent torch (9.19 -> 91900).
#: Only its comparisons against the thresholds in sdp_utils.cpp matter.
ASSUMED_CUDNN_VERSION = 91900


def num_sms(gpu: "GpuSpec | int | None") -> int:
    """The `multiProcessorCount` the emulated kernels size their work by: the GpuSpec's `sm_count`
    (or the count given); `FALLBACK_SM_COUNT` (the A100's 108) where the GPU or its count is unknown.

    Flash-attention's forward picks its split-KV count, and so the fp32 split accumulators it
    allocates, from it (flash-attention csrc/flash_attn/flash_api.cpp `set_params_splitkv`:
    `num_splits_heuristic(batch * heads * m_blocks, dprops->multiProcessorCount * 2, n_blocks, 128)`,
    vendored by PyTorch as aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp);
    Liger's RMSNorm backward allocates one fp32 row per SM.
    """
    count = gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else getattr(gpu, "sm_count", None)
    return int(count) if count else FALLBACK_SM_COUNT


_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaChoice:
    backend: Backend
    reasons: tuple[str, ...]  # why faster backends were rejected, e.g. "flash: attn_mask given"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(x: int, m: int) -> int:
    return _ceil_div(x, m) * m


def _parse_version(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):  # pragma: no cover - odd version strings
        return (2, 13)


# ---------------------------------------------------------------------------------------
# Backend choice (sdp_utils.cpp / sdp_utils_cpp.h)
# ---------------------------------------------------------------------------------------


def _sm_in(cc: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    # sdp_utils.cpp: check_sm_version<lower, upper> (inclusive on both ends)
    return lo <= tuple(cc) <= hi


def _minimum_gemm_alignment(dtype: torch.dtype, cc: tuple[int, int]) -> int:
    # sdp_utils.cpp: use_tensor_cores + minimum_gemm_alignment
    is_half = dtype in _HALF
    use_tc = cc[0] >= 8 or (cc[0] >= 7 and is_half)
    align = 4 if cc[0] >= 8 else 1
    if use_tc:
        align = max(align, 128 // (16 if is_half else 32))
    return align


def _common_dense_checks(name, q, k, v, enable_gqa, supports_gqa, requires_same_num_heads, reasons) -> bool:
    # sdp_utils_cpp.h: check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>
    if not (q[0] == k[0] == v[0]):
        reasons.append(f"{name}: q/k/v batch sizes differ")
        return False
    if enable_gqa and supports_gqa:
        # check_grouped_query_attention<requires_same_num_heads>
        if requires_same_num_heads and k[1] != v[1]:
            reasons.append(f"{name}: key/value num_heads differ")
            return False
        if q[1] % k[1] != 0 or (not requires_same_num_heads and q[1] % v[1] != 0):
            reasons.append(f"{name}: kv heads do not divide q heads")
            return False
        return True
    if not (q[1] == k[1] == v[1]):
        reasons.append(f"{name}: num_heads differ without GQA support")
        return False
    return True


def _mask_shape_ok(mask_shape, q, k) -> bool:
    # sdp_utils_cpp.h: check_attn_mask_shape (used by cuDNN only)
    if mask_shape is None:
        return True

    def ok(m, t):
        return m == t or m == 1

    if not (ok(mask_shape[-2], q[2]) and ok(mask_shape[-1], k[2])):
        return False
    if len(mask_shape) == 2:
        return True
    if len(mask_shape) == 4:
        return ok(mask_shape[0], q[0]) and ok(mask_shape[1], q[1])
    return False


def choose_backend(
    *,
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    v_shape: Sequence[int],
    dtype: torch.dtype,
    has_mask: bool,
    mask_dtype: torch.dtype | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    requires_grad: bool,
    compute_capability: tuple[int, int],
    torch_version: str = torch.__version__,
    mask_shape: Sequence[int] | None = None,
    mask_requires_grad: bool = False,
    last_dim_strides: tuple[int, int, int] = (1, 1, 1),
    mask_last_stride: int = 1,
    storage_offsets: tuple[int, int, int] = (0, 0, 0),
    cudnn_version: int = ASSUMED_CUDNN_VERSION,
    cuda_major: int = 12,
    deprioritize_cudnn: bool = False,
) -> SdpaChoice:
    """The backend ``select_sdp_backend`` (sdp_utils.cpp) picks on a GPU of ``compute_capability``.

    Assumes all backends enabled (``torch.backends.cuda.enable_*_sdp`` defaults), dense
    inputs on CUDA, non-deterministic mode.  ``requires_grad`` means "an input requires
    grad and grad mode is on" (sdp_utils_cpp.h: input_requires_grad).
    """
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    q, k, v = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    reasons: list[str] = []
    del mask_dtype  # bool masks are converted before the kernels; dtype does not affect the choice
    del torch_version  # rules below are those of torch >= 2.5 (sm121 / cuDNN 9.15 era sdp_utils.cpp)

    # --- priority order: sdp_utils.cpp priority_order + check_prefer_cudnn_attention ---
    major, minor = cc
    prefer_cudnn = (
        not deprioritize_cudnn
        and cudnn_version > 91500
        and major in (9, 10)
        and (cuda_major >= 13 or minor in (0, 3))
    )
    order: list[Backend] = (
        ["cudnn", "flash", "efficient", "math"] if prefer_cudnn else ["flash", "efficient", "math", "cudnn"]
    )
    # Note: the default order of at::Context (ATen/Context.h, sdp_priority_order; checked in the
    # installed 2.13 headers) is flash, efficient, math, cudnn, overrideable: cuDNN after math is
    # never reached unless check_prefer_cudnn_attention moved it first.

    four_d = len(q) == 4 and len(k) == 4 and len(v) == 4  # sdp_utils_cpp.h: check_tensor_shapes
    stride_ok = all(s == 1 for s in last_dim_strides)

    def can_flash() -> bool:
        # sdp_utils.cpp: can_use_flash_attention
        if not four_d:
            reasons.append("flash: q/k/v not 4-D")
            return False
        if has_mask:  # check_for_attn_mask
            reasons.append("flash: attn_mask given")
            return False
        # check_head_dim_size_flash: all head dims equal and <= 256
        if not (q[-1] == k[-1] == v[-1] and q[-1] <= 256):
            reasons.append("flash: head dims differ or > 256")
            return False
        if not _sm_in(cc, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
            reasons.append(f"flash: needs sm80..sm121, got sm{major}{minor}")
            return False
        # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
        if requires_grad and (_sm_in(cc, (8, 6), (8, 9)) or _sm_in(cc, (12, 0), (12, 1))):
            hd = q[-1]
            if not (hd <= 192 or (dropout_p == 0.0 and hd > 224)):
                reasons.append("flash: training with head_dim in (192, 224] (or >224 with dropout) on sm86-89/sm120")
                return False
        # check_flash_causal_non_square_seqlens
        if is_causal and q[-2] != k[-2]:
            reasons.append("flash: is_causal with seqlen_q != seqlen_k")
            return False
        # check_dtypes_flash_attention -> check_dtypes_low_precision (FA3 fp8 not modelled)
        if dtype not in ((torch.float16, torch.bfloat16) if major >= 8 else (torch.float16,)):
            reasons.append(f"flash: dtype {dtype} not fp16/bf16")
            return False
        # dense: check_batch_size_and_num_heads_dense<true, true>, nonzero seqlens, last-dim stride
        if not _common_dense_checks("flash", q, k, v, enable_gqa, True, True, reasons):
            return False
        if q[-2] == 0 or k[-2] == 0:
            reasons.append("flash: zero sequence length")
            return False
        if not (stride_ok or q[-1] == 1) or (has_mask and mask_last_stride != 1):
            reasons.append("flash: last dim stride != 1")
            return False
        return True

    def can_efficient() -> bool:
        # sdp_utils.cpp: can_use_mem_efficient_attention
        if not _sm_in(cc, (5, 0), (12, 1)):  # check_mem_efficient_hardware_support
            reasons.append(f"efficient: needs sm50..sm121, got sm{major}{minor}")
            return False
        if not four_d:
            reasons.append("efficient: q/k/v not 4-D")
            return False
        # check_head_dim_size_mem_efficient (no upper bound on CUDA)
        align = _minimum_gemm_alignment(dtype, cc)
        if not (q[-1] == k[-1] and q[-1] % align == 0 and q[-1] > 0 and v[-1] % align == 0 and v[-1] > 0):
            reasons.append(f"efficient: head dims must match (q,k) and be multiples of {align}")
            return False
        # check_data_ptr_alignment_mem_efficient (sm80+ only)
        if major >= 8:
            el = dtype.itemsize
            ab = align * el
            if any((off * el) % ab for off in storage_offsets):
                reasons.append(f"efficient: storage offsets not {ab}-byte aligned")
                return False
        if q[-2] == 0 or k[-2] == 0:  # check_nonzero_sequence_lengths_dense
            reasons.append("efficient: zero sequence length")
            return False
        # check_last_dim_stride_equals_1_dense<false>
        if not stride_ok or (has_mask and mask_last_stride != 1):
            reasons.append("efficient: last dim stride != 1")
            return False
        if not _common_dense_checks("efficient", q, k, v, enable_gqa, True, True, reasons):
            return False
        allowed = (torch.float16, torch.float32, torch.bfloat16) if major >= 8 else (torch.float16, torch.float32)
        if dtype not in allowed:  # check_tensor_dtype
            reasons.append(f"efficient: dtype {dtype} not supported on sm{major}{minor}")
            return False
        return True

    def can_cudnn() -> bool:
        # sdp_utils.cpp: can_use_cudnn_attention
        if cudnn_version < 90000:
            reasons.append("cudnn: cuDNN < 9.0")
            return False
        if dropout_p > 0.0 and 91100 < cudnn_version < 91400:
            reasons.append("cudnn: dropout unsupported on cuDNN 9.11-9.13")
            return False
        if not four_d:
            reasons.append("cudnn: q/k/v not 4-D")
            return False
        if dtype not in ((torch.float16, torch.bfloat16) if major >= 8 else (torch.float16,)):
            reasons.append(f"cudnn: dtype {dtype} not fp16/bf16")  # check_dtypes_low_precision
            return False
        if has_mask and (mask_requires_grad or not _mask_shape_ok(mask_shape, q, k)):
            reasons.append("cudnn: attn_mask requires grad or has unsupported shape")  # check_attn_mask_shape
            return False
        if not _sm_in(cc, (8, 0), (12, 1)):  # check_cudnn_hardware_support
            reasons.append(f"cudnn: needs sm80..sm121, got sm{major}{minor}")
            return False
        if dropout_p * 16.0 != math.floor(dropout_p * 16.0):  # check_cudnn_dropout
            reasons.append("cudnn: dropout not a multiple of 1/16")
            return False
        if q[-2] == 0 or k[-2] == 0:
            reasons.append("cudnn: zero sequence length")
            return False
        if not (stride_ok or q[-1] == 1) or (has_mask and mask_last_stride != 1):
            reasons.append("cudnn: last dim stride != 1")
            return False
        # check_batch_size_and_num_heads_dense<true, false>
        if not _common_dense_checks("cudnn", q, k, v, enable_gqa, True, False, reasons):
            return False
        # check_cudnn_tensor_shapes
        if q[0] > 65535 or q[1] > 65535:
            reasons.append("cudnn: batch or heads > 65535")
            return False
        d_qk, d_v = q[3], v[3]
        sm90_10x = (major == 9 and minor == 0) or major == 10
        unsupported_107 = major == 10 and minor == 7 and cudnn_version <= 92500
        limit = 128
        if sm90_10x and not unsupported_107 and cudnn_version > 92200:
            limit = 256
        elif sm90_10x and cudnn_version >= 91100 and d_qk == 192 and d_v == 128:
            limit = 192
        if not (d_qk <= limit and d_v <= limit):
            reasons.append(f"cudnn: head_dim > {limit}")
            return False
        if d_qk % 8 or d_v % 8:
            reasons.append("cudnn: head_dim not a multiple of 8")
            return False
        if k[2] == 1:
            reasons.append("cudnn: seq_len_kv == 1")
            return False
        if dropout_p != 0.0 and q[2] == 1:
            reasons.append("cudnn: seq_len_q == 1 with dropout")
            return False
        # check_cudnn_d256_bprop_head_dim
        if requires_grad and sm90_10x and not unsupported_107 and cudnn_version > 92200:
            if not ((d_qk <= 128 and d_v <= 128) or (d_qk == 192 and d_v == 128) or (d_qk == 256 and d_v == 256)):
                reasons.append("cudnn: backward unsupported for these head dims")
                return False
        return True

    checks = {"flash": can_flash, "efficient": can_efficient, "cudnn": can_cudnn}
    for backend in order:
        if backend == "math":
            return SdpaChoice("math", tuple(reasons))
        if checks[backend]():
            return SdpaChoice(backend, tuple(reasons))
    return SdpaChoice("math", tuple(reasons))  # pragma: no cover


