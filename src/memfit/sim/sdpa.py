"""Emulate CUDA's ``scaled_dot_product_attention`` on the CPU (real or fake tensors).

On CUDA, ``torch.nn.functional.scaled_dot_product_attention`` dispatches to one of
several fused kernels (``aten/src/ATen/native/transformers/attention.cpp``,
``scaled_dot_product_attention``; the choice is ``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``).  On the CPU the same call
takes a different path, so a CPU simulation would see the wrong allocations and the
wrong tensors saved for backward.  This module:

* ``choose_backend`` re-implements the CUDA backend choice (default priority order and
  the constraint filters of ``can_use_cudnn_attention`` / ``can_use_flash_attention`` /
  ``can_use_mem_efficient_attention``) for a GPU of a given compute capability;
* ``emulated_sdpa`` runs the composite pre-processing CUDA runs (bool-mask conversion,
  head-dim padding for flash, ``preprocess_mask`` for mem-efficient) with real aten ops,
  then an ``autograd.Function`` per fused backend whose forward/backward allocate the
  tensors the CUDA kernels allocate (values are garbage: ``new_empty``) and save what the
  CUDA autograd node saves (``tools/autograd/derivatives.yaml``).  The math backend
  simply calls ``aten::_scaled_dot_product_attention_math``, which is the very code CUDA
  runs (including the fp16/bf16 -> fp32 upcast unless
  ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``).

Layouts: flash / efficient kernels work on ``(B, L, H, D)``; ``_scaled_dot_product_*_cuda``
in ``attention.cu`` transpose their ``(B, H, L, D)`` inputs, allocate in ``(B, L, H, D)``
and return ``.transpose(1, 2)``.  This is replicated so byte counts and strides match.

Known limitations
-----------------
* cuDNN attention: the priority order (cuDNN first on sm90/sm100/sm103 when the runtime
  cuDNN is > 9.15.0, ``check_prefer_cudnn_attention``) and the filters are modelled, but
  the cuDNN *workspace* sizes (forward and backward execution plans) are not known on the
  CPU and are not allocated; only out / logsumexp / dq / dk / dv are.  The cuDNN version
  is an assumption (``ASSUMED_CUDNN_VERSION``) and the cuDNN-frontend D=256 support is
  assumed compiled in.  Whether the wheel's CUDA is < 13 (which restricts the cuDNN
  preference to sm90 / sm100 / sm103) is a parameter too (``cuda_major``).
* Memory-efficient GQA: ``sdp_utils.cpp`` accepts ``enable_gqa`` for the CUDA
  mem-efficient kernel, but the versions of ``_efficient_attention_forward/backward``
  that could be read require equal head counts; the emulation therefore expands k / v
  with ``repeat_interleave`` before the kernel (extra B*H*Lk*D copies).  Not verified.
* Memory-efficient backward kernel choice depends on ``sizeof(SharedStorage)`` versus
  ``sharedMemPerBlockOptin``; that is approximated (128x128 and 128x64/f32 kernels are
  assumed not to fit on sm86/sm87/sm89/sm120/sm121, 99 KiB parts).  The backward
  ``num_splits_key`` follows the code read (``ceil_div(num_keys, kBlockSizeJ)`` when the
  caller passes no value, which SDPA does not).  Older/newer torch may differ.
* Flash split-KV (``set_params_splitkv``) depends on the SM count; a table of common GPUs
  is used (``_NUM_SMS``), defaulting to 108.
* Deterministic mode (``torch.use_deterministic_algorithms``) is not modelled (flash's
  ``dq_accum`` would become ``(nsplits, ...)`` zeros; cuDNN would be rejected).
* Philox seed/offset tensors are CPU tensors on CUDA (not GPU memory); here they are
  created like the other tensors (16 bytes).
* Flash decoding special case (``seqlenq_ngroups_swapped`` when Lq == 1 and GQA) changes
  only views, not bytes, and is not modelled; nested tensors, ROCm, XPU, FA3 and
  the Blackwell (sm100) CUTLASS FMHA are not modelled.
* Pointer-alignment (``check_data_ptr_alignment_mem_efficient``) and last-dim stride
  checks use the actual tensors in ``emulated_sdpa``; ``choose_backend`` takes them as
  optional arguments (default: aligned / stride 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

__all__ = ["SdpaChoice", "choose_backend", "emulated_sdpa", "ASSUMED_CUDNN_VERSION"]

Backend = Literal["flash", "efficient", "math", "cudnn"]

#: cuDNN runtime version assumed for the CUDA wheels of a recent torch (9.19 -> 91900).
#: Only its comparisons against the thresholds in sdp_utils.cpp matter.
ASSUMED_CUDNN_VERSION = 91900

# multiProcessorCount of common parts, for flash's split-KV heuristic.
_NUM_SMS = {(7, 0): 80, (7, 5): 40, (8, 0): 108, (8, 6): 84, (8, 9): 128, (9, 0): 132, (10, 0): 148, (12, 0): 170}

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


# ---------------------------------------------------------------------------------------
# Composite pre-processing (attention.cpp)
# ---------------------------------------------------------------------------------------


def _convert_boolean_attn_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # attention.cpp: convert_boolean_attn_mask -> at::where(mask.logical_not(), -inf, scalar_tensor(0, dtype))
    # (convert_boolean_attn_mask_cudnn is the same with a large negative value instead of -inf)
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _aligned_tensor(t: torch.Tensor, alignment: int) -> bool:
    # attention.cpp: aligned_tensor<alignment>
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _pad_bias(bias: torch.Tensor, alignment: int) -> torch.Tensor:
    # attention.cpp: pad_bias<alignment> (pads even when already a multiple: pad_count in 1..alignment)
    last = bias.size(-1)
    pad_count = alignment - (last % alignment)
    return torch.nn.functional.pad(bias, (0, pad_count))[..., :last]


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # attention.cpp: preprocess_mask, mem_eff_alignment = 8: pad the (un-expanded) mask if its
    # strides are not 8-aligned, then expand to (B, H, Lq, Lk) (a view: stride 0 on broadcast dims).
    if not _aligned_tensor(mask, 8):
        mask = _pad_bias(mask, 8)
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    # attention.cpp: pad_last_dim<alignment, slice=false>
    last = t.size(-1)
    if last % alignment == 0:
        return t
    return torch.nn.functional.pad(t, (0, alignment - last % alignment))


def _rng_state(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # flash_api.cpp mha_fwd / attention.cu _efficient_attention_forward: seed_t, offset_t are
    # 0-dim int64 (CPU when not capturing a CUDA graph).
    return like.new_empty((), dtype=torch.int64), like.new_empty((), dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# Flash attention (attention.cu _scaled_dot_product_flash_attention_cuda, flash_api.cpp)
# ---------------------------------------------------------------------------------------


def _num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    # flash_api.cpp: num_splits_heuristic
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eligible = lambda s: s == 1 or _ceil_div(num_n_blocks, s) != _ceil_div(num_n_blocks, s - 1)  # noqa: E731
    eff = []
    for s in range(1, max_splits + 1):
        if not eligible(s):
            eff.append(0.0)
        else:
            n_waves = batch_nheads_mblocks * s / num_sms
            eff.append(n_waves / math.ceil(n_waves))
    best = max(eff, default=0.0)
    for s in range(1, max_splits + 1):
        if eligible(s) and eff[s - 1] >= 0.85 * best:
            return s
    return 1


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, is_causal, scale, num_sms):  # type: ignore[override]
        B, H, Lq, D = q.shape
        Lk = k.size(2)
        # _scaled_dot_product_flash_attention_cuda: q_t = query.transpose(1, 2) ...
        q_t = q.transpose(1, 2)
        # flash_api.cpp mha_fwd: out = at::empty_like(q_padded)  (q_padded is q_t)
        out_t = torch.empty_like(q_t)
        # mha_fwd: softmax_lse = at::empty({batch_size, num_heads, seqlen_q}, kFloat)
        lse = q.new_empty((B, H, Lq), dtype=torch.float32)
        # mha_fwd -> set_params_splitkv: transient fp32 accumulators when num_splits > 1 (no dropout)
        if dropout_p == 0.0:
            head_size_rounded = _round_up(_round_up(D, 8), 32)
            block_n = 256 if D <= 64 else (128 if D <= 128 else 64)
            n_splits = _num_splits_heuristic(B * H * _ceil_div(Lq, 64), num_sms * 2, _ceil_div(Lk, block_n), 128)
            if n_splits > 1:
                lse_accum = q.new_empty((n_splits, B, H, Lq), dtype=torch.float32)
                out_accum = q.new_empty((n_splits, B, H, Lq, head_size_rounded), dtype=torch.float32)
                del lse_accum, out_accum
        seed, offset = _rng_state(q)
        out = out_t.transpose(1, 2)
        # derivatives.yaml (_scaled_dot_product_flash_attention): query, key, value, output,
        # logsumexp, cum_seq_q/k (undefined for dense), philox_seed, philox_offset
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.meta = (dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        B, H, Lq, D = q.shape
        Hk, Lk = k.size(1), k.size(2)
        # _scaled_dot_product_flash_attention_backward_cuda: transpose everything to (B, L, H, D)
        q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # attention_backward.cu _flash_attention_backward: grad_out.contiguous(), out.contiguous()
        go_t = grad_out.transpose(1, 2).contiguous()
        out_t = out.transpose(1, 2).contiguous()
        del go_t, out_t
        # flash_api.cpp mha_bwd: dq/dk/dv = empty_like(q/k/v)
        dq = torch.empty_like(q_t)
        dk = torch.empty_like(k_t)
        dv = torch.empty_like(v_t)
        # mha_bwd: softmax_d (B, H, round_up(Lq, 128)) fp32;
        # dq_accum (B, round_up(Lq, 128), H, round_up(D, 32)) fp32 (non-deterministic)
        lq_r = _round_up(Lq, 128)
        softmax_d = q.new_empty((B, H, lq_r), dtype=torch.float32)
        dq_accum = q.new_empty((B, lq_r, H, _round_up(D, 32)), dtype=torch.float32)
        if Hk != H:
            # mha_bwd MQA/GQA: dk_expanded / dv_expanded (B, Lk, H, D) then sum_out over groups
            dk_exp = q.new_empty((B, Lk, H, D))
            dv_exp = q.new_empty((B, Lk, H, v.size(-1)))
            torch.sum(dk_exp.reshape(B, Lk, Hk, H // Hk, D), dim=3, out=dk)
            torch.sum(dv_exp.reshape(B, Lk, Hk, H // Hk, v.size(-1)), dim=3, out=dv)
            del dk_exp, dv_exp
        del softmax_d, dq_accum
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None


# ---------------------------------------------------------------------------------------
# Memory-efficient attention (attention.cu _efficient_attention_forward,
# attention_backward.cu _efficient_attention_backward, mem_eff_attention/kernel_*.h)
# ---------------------------------------------------------------------------------------

# cutlassB.h dispatch lists: (kBlockSizeI, kBlockSizeJ, kMaxK, kKeysQueriesAlignedToBlockSize, kApplyDropout)
_B_SM80_HALF = [
    (64, 64, 32, True, False), (64, 64, 32, False, False), (64, 64, 64, True, False), (64, 64, 64, False, False),
    ("k96",),  # (128, 64, 96) only on cc 86 / 89
    (128, 128, 128, True, False), (128, 128, 128, False, False), (64, 64, 128, True, False), (64, 64, 128, False, False),
    (128, 64, 65536, False, False), (64, 64, 65536, False, False),
    (64, 64, 32, False, True), (64, 64, 64, False, True), (128, 128, 128, False, True), (64, 64, 128, False, True),
    (128, 64, 65536, False, True), (64, 64, 65536, False, True),
]
_B_SM80_F32 = [
    (64, 64, 32, False, False), (64, 64, 64, False, False), (128, 64, 128, False, False), (64, 64, 128, False, False),
    (128, 64, 65536, False, False), (64, 64, 65536, False, False),
    (64, 64, 32, False, True), (64, 64, 64, False, True), (128, 64, 128, False, True), (64, 64, 128, False, True),
    (128, 64, 65536, False, True), (64, 64, 65536, False, True),
]
_B_SM70_HALF = [
    (64, 64, 32, True, False), (64, 64, 32, False, False), (64, 64, 64, True, False), (64, 64, 64, False, False),
    (128, 64, 128, True, False), (128, 64, 128, False, False), (64, 64, 128, True, False), (64, 64, 128, False, False),
    (128, 64, 65536, False, False), (64, 64, 65536, False, False),
    (64, 64, 32, False, True), (64, 64, 64, False, True), (128, 64, 128, False, True), (64, 64, 128, False, True),
    (128, 64, 65536, False, True), (64, 64, 65536, False, True),
]
_B_64 = [(64, 64, kk, False, False) for kk in (32, 64, 128, 65536)] + [(64, 64, kk, False, True) for kk in (32, 64, 128, 65536)]


def _small_smem(cc: tuple[int, int]) -> bool:
    # sharedMemPerBlockOptin ~99 KiB on sm86/87/89/120/121 (vs 163 KiB sm80, 227 KiB sm90/100)
    return (cc[0] == 8 and cc[1] != 0) or cc[0] == 12


def _efficient_bwd_workspace_bytes(*, dtype, cc, B, H, M, N, K, Kv, dropout) -> tuple[int, bool]:
    """``p.workspace_size()`` (kernel_backward.h) of the kernel ``dispatch_cutlassB`` would launch."""
    is_half = dtype in _HALF
    ccn = cc[0] * 10 + cc[1]
    if ccn >= 80:
        table, min_sm = (_B_SM80_HALF if is_half else _B_SM80_F32), 80
    elif ccn >= 70:
        table, min_sm = (_B_SM70_HALF if is_half else _B_64), 70
    else:
        table, min_sm = _B_64, 50
    max_k = max(K, Kv)
    chosen = None
    for entry in table:
        if entry == ("k96",):
            if ccn in (86, 89):
                entry = (128, 64, 96, False, False)
            else:
                continue
        bi, bj, kmax, seqaligned, drop = entry
        if kmax < max_k or (dropout and not drop):  # attention_backward.cu launchKernel filters
            continue
        if seqaligned and (M % bi or N % bj):
            continue
        if _small_smem(cc) and bi == 128 and (bj == 128 or not is_half) and kmax <= 128:
            continue  # "Uses too much shmem" (approximation, see Known limitations)
        chosen = (bi, bj, kmax)
        break
    if chosen is None:  # pragma: no cover - cutlassB: no kernel found
        chosen = (64, 64, 65536)
    bi, bj, kmax = chosen
    # kernel_backward.h flags
    enable_split_keys = min_sm >= 70
    output_in_rf = is_half and kmax <= bi
    needs_accum_q = enable_split_keys or is_half
    needs_accum_kv = (not output_in_rf) and is_half
    # attention_backward.cu: p.num_splits_key = ceil_div(num_keys, kBlockSizeJ) (no explicit value)
    num_splits_key = _ceil_div(N, bj) if enable_split_keys else 1
    num_splits_key = max(num_splits_key, 1)
    gk = num_splits_key * bj * _round_up(K, bi) if needs_accum_kv else 0
    gv = num_splits_key * bj * _round_up(Kv, bi) if needs_accum_kv else 0
    # GradQTempStorage = {int32 lock, counter, pad[2]; float buffer[kBlockSizeI * kBlockSizeJ]}
    gq = _ceil_div(M, bi) * _ceil_div(K, bj) * (16 + 4 * bi * bj) // 4 if needs_accum_q else 0
    stride_bh = _round_up(gk + gv + gq, 4)
    return B * H * stride_bh * 4, num_splits_key > 1


class _EfficientAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale, compute_lse, cc):  # type: ignore[override]
        B, H, M, K = q.shape
        Kv = v.size(-1)
        # attention.cu _efficient_attention_forward:
        # res = at::empty({B, M, num_heads, Kv}, ...)  (contiguous, independent of q's strides)
        res = q.new_empty((B, M, H, Kv))
        # logsumexp = empty({B, num_heads, compute_logsumexp ? ceil_div(M, kAlignLSE=32)*32 : 0}, kFloat)
        lse = q.new_empty((B, H, _round_up(M, 32) if compute_lse else 0), dtype=torch.float32)
        # kernel_forward.h kNeedsOutputAccumulatorBuffer: !kSingleValueIteration && output_t != float;
        # cutlassF.h: kMaxK 64/128 kernels are single-value-iteration, the 65536 one is not.
        if q.dtype in _HALF and max(K, Kv) > 128:
            out_accum = q.new_empty((B, M, H, Kv), dtype=torch.float32)
            del out_accum
        seed, offset = _rng_state(q)
        out = res.transpose(1, 2)
        # derivatives.yaml (_scaled_dot_product_efficient_attention):
        # query, key, value, attn_bias, output, log_sumexp, philox_seed, philox_offset
        if bias is None:
            ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        else:
            ctx.save_for_backward(q, k, v, out, lse, seed, offset, bias)
        ctx.meta = (dropout_p, is_causal, scale, cc, bias is not None)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        dropout_p, is_causal, scale, cc, has_bias = ctx.meta
        saved = ctx.saved_tensors
        q, k, v, out, lse, seed, offset = saved[:7]
        bias = saved[7] if has_bias else None
        B, H, M, K = q.shape
        N, Kv = k.size(2), v.size(-1)
        # _scaled_dot_product_efficient_attention_backward_cuda: transpose to (B, L, H, D);
        # _efficient_attention_backward: grad_out = grad_out_.contiguous()
        go = grad_out.transpose(1, 2).contiguous()
        # grad_q/k/v = at::empty(query/key/value.sizes()) -> contiguous (B, L, H, D)
        # (the chunked (B, M, 3, H, K) buffer was removed on CUDA: "We removed the chunk/cat
        # optimization and the multiplier is always 1"; it survives on ROCm only)
        gq = q.new_empty((B, M, H, K))
        gk = k.new_empty((B, N, k.size(1), K))
        gv = v.new_empty((B, N, v.size(1), Kv))
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[3]:
            # bias_requires_grad: empty(sz with last dim rounded up to 16).slice(-1, 0, lastDim)
            sz = list(bias.shape)
            last = sz[-1]
            sz[-1] = _round_up(last, 16)
            grad_bias = bias.new_empty(sz)[..., :last]
        # delta: kKernelComputesDelta = kIsHalf && (kOutputInRF || kMinSm != 70)
        # (approximation: sm70 half with kMaxK > kBlockSizeI computes it with aten ops)
        is_half = q.dtype in _HALF
        if is_half and not (cc[0] == 7 and max(K, Kv) > 64):
            delta = q.new_empty((B, H, M), dtype=torch.float32)
        else:
            delta = (go.float() * out.transpose(1, 2).float()).sum(-1).transpose(-2, -1).contiguous()
        size_bytes, zero = _efficient_bwd_workspace_bytes(
            dtype=q.dtype, cc=cc, B=B, H=H, M=M, N=N, K=K, Kv=Kv, dropout=dropout_p > 0.0
        )
        if size_bytes:
            workspace = q.new_empty((size_bytes,), dtype=torch.uint8)
            if zero:
                workspace.zero_()
            del workspace
        del delta, go
        return (gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2), grad_bias,
                None, None, None, None, None)


# ---------------------------------------------------------------------------------------
# cuDNN attention (attention.cu _scaled_dot_product_cudnn_attention_cuda, cudnn/MHA.cpp)
# ---------------------------------------------------------------------------------------


class _CudnnAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale, compute_lse):  # type: ignore[override]
        B, H, M, _ = q.shape
        Dv = v.size(-1)
        # MHA.cpp run_cudnn_SDP_fprop: o allocated with the layout of q ("alloc_with_matching_layout")
        q_t = q.transpose(1, 2)
        out = (torch.empty_like(q_t) if Dv == q.size(-1) else q.new_empty((B, M, H, Dv))).transpose(1, 2)
        # softmaxstats (B, H, M, 1) fp32 when compute_logsumexp; workspace: unknown (not allocated)
        lse = q.new_empty((B, H, M, 1) if compute_lse else (0,), dtype=torch.float32)
        seed, offset = _rng_state(q)
        tensors = [q, k, v, out, lse, seed, offset] + ([bias] if bias is not None else [])
        ctx.save_for_backward(*tensors)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        # MHA.cpp run_cudnn_SDP_bprop: dq/dk/dv with the layouts of q/k/v; grad_out made
        # to match o's layout.  Backward workspace: unknown (not allocated).
        dq = torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
        dk = torch.empty_like(k.transpose(1, 2)).transpose(1, 2)
        dv = torch.empty_like(v.transpose(1, 2)).transpose(1, 2)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def _requires_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def emulated_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    compute_capability: tuple[int, int] = (8, 0),
) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` that allocates what CUDA would."""
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    offsets = tuple(int(t.storage_offset()) for t in (query, key, value))
    choice = choose_backend(
        q_shape=tuple(query.shape), k_shape=tuple(key.shape), v_shape=tuple(value.shape),
        dtype=query.dtype, has_mask=attn_mask is not None,
        mask_dtype=None if attn_mask is None else attn_mask.dtype,
        dropout_p=float(dropout_p), is_causal=bool(is_causal), enable_gqa=bool(enable_gqa),
        requires_grad=_requires_grad(query, key, value), compute_capability=cc,
        mask_shape=None if attn_mask is None else tuple(attn_mask.shape),
        mask_requires_grad=attn_mask is not None and attn_mask.requires_grad,
        last_dim_strides=tuple(int(t.stride(-1)) if t.dim() else 1 for t in (query, key, value)),
        mask_last_stride=1 if attn_mask is None or attn_mask.dim() == 0 else int(attn_mask.stride(-1)),
        storage_offsets=offsets,  # type: ignore[arg-type]
    )
    backend = choice.backend
    # attention.cpp scaled_dot_product_attention: bool mask -> additive mask for every backend
    mask = _convert_boolean_attn_mask(attn_mask, query.dtype)

    if backend == "math":
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    if backend == "flash":
        og = query.size(-1)
        q, k, v = (_pad_last_dim(t, 8) for t in (query, key, value))
        # softmax scale computed from the original head dim (sdp::calculate_scale(query_, scale))
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(og)
        out = _FlashAttention.apply(q, k, v, float(dropout_p), bool(is_causal), sm_scale, _NUM_SMS.get(cc, 108))
        if out.size(-1) != og:  # post_process_flash_output
            out = out[..., :og]
        return out

    if backend == "efficient":
        q, k, v = query, key, value
        if enable_gqa and k.size(1) != q.size(1):
            # See "Known limitations": kernel needs equal head counts in the code read.
            rep = q.size(1) // k.size(1)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is not None:
            mask = _preprocess_mask(mask, q, k)
        compute_lse = _requires_grad(query, key, value)  # attention.cpp should_compute_logsumexp
        return _EfficientAttention.apply(q, k, v, mask, float(dropout_p), bool(is_causal), scale, compute_lse, cc)

    # cudnn
    compute_lse = _requires_grad(query, key, value)
    bias = None
    if mask is not None:
        bias = mask.expand(query.size(0), query.size(1), query.size(2), key.size(2)) if mask.dim() == 2 else mask
    return _CudnnAttention.apply(query, key, value, bias, float(dropout_p), bool(is_causal), scale, compute_lse)
