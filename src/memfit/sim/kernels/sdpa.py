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
* Flash split-KV (``set_params_splitkv``) depends on the SM count: the GPU's (``sm_count``, from the
  catalog's GpuSpec), else ``FALLBACK_SM_COUNT`` (memfit.gpus.catalog; ``num_sms``).
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

import torch

from memfit.sim.kernels.sdpa_choice import (  # noqa: F401  (re-exported)
    _HALF, ASSUMED_CUDNN_VERSION, SdpaChoice, _ceil_div, _round_up, choose_backend, num_sms,
)

__all__ = ["SdpaChoice", "choose_backend", "emulated_sdpa", "ASSUMED_CUDNN_VERSION"]

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
    sm_count: int | None = None,
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
        out = _FlashAttention.apply(q, k, v, float(dropout_p), bool(is_causal), sm_scale, num_sms(sm_count))
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
