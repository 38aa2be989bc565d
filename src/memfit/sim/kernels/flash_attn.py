"""FlashAttention-2 / -3 emulated on the CPU (real or fake tensors), behind transformers' own dispatch.

flash-attn cannot run here (CUDA only, not installed). A model built with
``attn_implementation="flash_attention_2"`` calls ``transformers.integrations.flash_attention.
flash_attention_forward`` through ``ALL_ATTENTION_FUNCTIONS``; that real code (transpose to
``(B, S, H, D)``, the fp32 -> half cast of ``fa_peft_integration_check``, unpadding with
``_upad_input`` for a padded batch, the padding-free varlen path with ``cu_seq_lens_*``, ``_pad_input``)
runs unchanged. Only the kernels it gets from ``lazy_import_flash_attention`` are replaced
(``flash_patches``) by ``autograd.Function``s that allocate what flash-attn allocates and save what
its autograd nodes save. Sources read (Dao-AILab/flash-attention at 0251105a, Aug 2026):

FA2 (``flash_attn/flash_attn_interface.py`` + ``csrc/flash_attn/flash_api.cpp``):
* ``FlashAttnFunc.forward``: head dim padded to a multiple of 8 with ``F.pad`` when it is not one;
  ``mha_fwd``: ``out = empty_like(q)``, ``softmax_lse = empty({B, H, Sq}, kFloat)``,
  ``rng_state = empty({2}, kInt64)``; ``set_params_splitkv`` fp32 accumulators when splits > 1
  (no dropout). Saved: ``q, k, v, out_padded, softmax_lse, rng_state``.
* ``mha_varlen_fwd``: ``softmax_lse = empty({H, total_q}, kFloat)``; split-KV only for the decode case
  (``seqlenq_ngroups_swapped``). Saved: ``q, k, v, out_padded, softmax_lse, cu_seqlens_q, cu_seqlens_k,
  rng_state``.
* ``FlashAttnFunc.backward``: ``dq, dk, dv = empty_like(q/k/v)``; ``_flash_attn_backward``:
  ``maybe_contiguous(dout)``; ``mha_bwd``: ``softmax_d = empty({B, H, round(Sq, 128)}, kFloat)``,
  ``dq_accum = empty({B, round(Sq, 128), H, round(D, D <= 128 ? 32 : 64)}, kFloat)``
  (deterministic: ``zeros({nsplits, ...})``), GQA: ``dk_expanded / dv_expanded = empty({B, Sk, H, D})``.
  ``mha_varlen_bwd``: ``softmax_d = empty({H, total_q + 128 B})``,
  ``dq_accum = empty({total_q + 128 B, H, D_rounded})``, GQA ``empty({total_k, H, D})``.

FA3 (``hopper/flash_attn_interface.py`` + ``hopper/flash_api.cpp``): no dropout, no rng state, no
head-dim padding in Python (``head_size % 8 == 0`` is checked); ``mha_fwd``: ``out`` (B, Sq, H, Dv),
``softmax_lse = empty({B, H, Sq})`` (varlen ``{H, total_q}``) fp32. Saved: ``q, k, v, out,
softmax_lse``. ``mha_bwd``: ``softmax_d`` and ``softmax_lse_log2`` ``{B, H, round(Sq, kBlockM)}``
fp32, ``dq_accum = empty({B, H, round(Sq, kBlockM) * D_rounded})`` fp32 with ``round_up_headdim``
(64/96/128/192/256), GQA ``dk_accum/dv_accum = zeros({B, Hk, round(Sk, kBlockN) * D_rounded})`` fp32,
``dq_semaphore = empty({ceil(Sq / kBlockM), B, H}, kInt32)`` (sm90 tile sizes, below).

Which GPUs and dtypes (``check_flash_support``): FA2 ``mha_fwd``: ``TORCH_CHECK(cc_major >= 8,
"FlashAttention only supports Ampere GPUs or newer.")`` (no Turing/Volta: README "For Turing GPUs
(T4, RTX 2080), see the separate flash-attention-turing repo"), ``q_dtype == kFloat16 || kBFloat16``,
``head_size <= 256``. FA3: README "Requirements: H100 / H800 GPU" (sm90), fp16/bf16 (fp8 forward
only), head dim <= 256 and a multiple of 8.

Known limitations: FA3's scheduler metadata (``tile_count_semaphore``, a few int32) is not allocated;
deterministic mode (``FLASH_ATTENTION_DETERMINISTIC=1``) is not modelled; FA4 is not modelled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import MemfitError
from memfit.sim.kernels.sdpa_choice import _ceil_div, _round_up, num_sms
from memfit.sim.patching import patched
from memfit.train_setup import ATTN_IMPLEMENTATIONS, HUB_FLASH_KERNELS

__all__ = ["FLASH_IMPLEMENTATIONS", "HUB_FLASH_KERNELS", "ATTN_IMPLEMENTATIONS", "FlashRule", "flash_rule",
           "check_flash_support", "canonical_attn_implementation", "flash_backward_bytes", "flash_patches",
           "padding_free_kwargs", "use_flash_attention"]

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
_HALF = (torch.float16, torch.bfloat16)


def canonical_attn_implementation(name: str) -> str:
    """`name` as memfit simulates it: a hub flash kernel -> the flash version it builds; a MemfitError
    naming the choices for anything else memfit does not model."""
    if name in ATTN_IMPLEMENTATIONS:
        return name
    if name in HUB_FLASH_KERNELS:
        return HUB_FLASH_KERNELS[name]
    if isinstance(name, str) and "/" in name:
        raise MemfitError(f"attention kernel `{name}` from the hub is not modelled by memfit; use one of "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)} or a flash-attn build ({', '.join(HUB_FLASH_KERNELS)})")
    raise MemfitError(f"attn_implementation `{name}` is not one of {', '.join(ATTN_IMPLEMENTATIONS)}")


@dataclass(frozen=True)
class FlashRule:
    """What a FlashAttention version accepts (see module docstring for the sources)."""

    implementation: str
    min_compute_capability: tuple[int, int]
    max_compute_capability: tuple[int, int]
    max_head_dim: int
    gpus: str


_RULES = {
    # flash_api.cpp mha_fwd: TORCH_CHECK(cc_major >= 8, "FlashAttention only supports Ampere GPUs or newer.")
    "flash_attention_2": FlashRule("flash_attention_2", (8, 0), (12, 9), 256, "Ampere, Ada, Hopper or newer (sm80+)"),
    # hopper README "Requirements: H100 / H800 GPU"; hopper/flash_api.cpp get_max_headdim() = 256
    "flash_attention_3": FlashRule("flash_attention_3", (9, 0), (9, 0), 256, "Hopper (sm90: H100, H200, H800)"),
}


def flash_rule(implementation: str) -> FlashRule:
    return _RULES[implementation]


def check_flash_support(implementation: str, *, compute_capability: tuple[int, int], dtype: torch.dtype | None = None,
                        head_dim: int | None = None) -> None:
    """A MemfitError naming the fix when `implementation` cannot run on this GPU / dtype / head dim.

    Args:
        implementation: flash_attention_2 or flash_attention_3.
        compute_capability: the GPU's (major, minor).
        dtype: the dtype of q/k/v at the kernel (None: not checked).
        head_dim: the attention head dimension (None: not checked).
    """
    rule = _RULES[implementation]
    cc = tuple(compute_capability)
    if not rule.min_compute_capability <= cc <= rule.max_compute_capability:
        other = ("flash_attention_2 (sm80+) or sdpa" if implementation == "flash_attention_3"
                 else "sdpa (its memory-efficient kernel runs on sm50+)")
        raise MemfitError(f"{implementation} needs {rule.gpus}; this GPU has compute capability "
                          f"`{cc[0]}.{cc[1]}`. Use `--attn {other.split()[0]}` instead ({other})")
    if dtype is not None and dtype not in _HALF:
        raise MemfitError(f"{implementation} runs only in fp16 or bf16 (flash_api.cpp: \"FlashAttention only support "
                          f"fp16 and bf16 data type\"); the attention inputs are `{str(dtype).removeprefix('torch.')}`. "
                          "Train with `--precision bf16` (or fp16), or load the weights in bf16")
    if head_dim is not None and _round_up(head_dim, 8) > rule.max_head_dim:
        raise MemfitError(f"{implementation} supports head dimensions up to {rule.max_head_dim}; this model's is "
                          f"`{head_dim}`. Use `--attn sdpa`")


# ---------------------------------------------------------------------------------------
# Allocation rules (pure; the autograd functions below allocate exactly these)
# ---------------------------------------------------------------------------------------

def _fa2_d_rounded(d: int) -> int:
    # flash_api.cpp: head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64)
    return _round_up(d, 32 if d <= 128 else 64)


def _fa3_d_rounded(d: int) -> int:
    # hopper/flash_api.cpp round_up_headdim
    for r in (64, 96, 128, 192, 256):
        if d <= r:
            return r
    return d


def _fa3_bwd_blocks(d_rounded: int, causal: bool, softcap: float) -> tuple[int, int]:
    # hopper/flash_api.cpp mha_bwd, sm90: kBlockM_sm90 / kBlockN_sm90
    if d_rounded <= 64:
        bm = 96 if causal and softcap > 0.0 else 128
    elif d_rounded <= 96:
        bm = 64
    elif d_rounded <= 128:
        bm = 64 if causal or softcap > 0.0 else 80
    else:
        bm = 64
    bn = 128 if d_rounded <= 128 else (96 if d_rounded <= 192 else 80)
    return bm, bn


def flash_backward_bytes(version: int, *, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int,
                         head_dim: int, itemsize: int, causal: bool = True, softcap: float = 0.0,
                         varlen_total_q: int | None = None, varlen_total_k: int | None = None) -> dict[str, int]:
    """Bytes flash-attn's backward allocates: dq/dk/dv plus the fp32 workspaces of mha_bwd / mha_varlen_bwd.

    Args:
        version: 2 or 3.
        batch, seqlen_q, seqlen_k, heads, heads_k, head_dim: shapes (head_dim padded to a multiple of 8);
            for a varlen call `seqlen_*` are the max lengths.
        itemsize: bytes per element of q.
        causal, softcap: FA3's tile sizes depend on them.
        varlen_total_q, varlen_total_k: total tokens of a varlen call.
    """
    varlen = varlen_total_q is not None
    tq = varlen_total_q if varlen else batch * seqlen_q
    tk = varlen_total_k if varlen else batch * seqlen_k
    out = {"dq": tq * heads * head_dim * itemsize, "dk": tk * heads_k * head_dim * itemsize,
           "dv": tk * heads_k * head_dim * itemsize}
    if version == 2:
        dr = _fa2_d_rounded(head_dim)
        rows = (tq + 128 * batch) if varlen else batch * _round_up(seqlen_q, 128)
        out["softmax_d"] = heads * rows * 4
        out["dq_accum"] = rows * heads * dr * 4
        if heads_k != heads:
            out["dk_expanded"] = tk * heads * head_dim * itemsize
            out["dv_expanded"] = tk * heads * head_dim * itemsize
    else:
        dr = _fa3_d_rounded(head_dim)
        bm, bn = _fa3_bwd_blocks(dr, causal, softcap)
        rows = _round_up(tq + batch * bm, bm) if varlen else batch * _round_up(seqlen_q, bm)
        out["softmax_d"] = heads * rows * 4
        out["softmax_lse_log2"] = heads * rows * 4
        out["dq_accum"] = heads * rows * dr * 4
        if heads_k != heads:
            krows = _round_up(tk + batch * bn, bn) if varlen else batch * _round_up(seqlen_k, bn)
            out["dk_accum"] = heads_k * krows * dr * 4
            out["dv_accum"] = heads_k * krows * dr * 4
        out["dq_semaphore"] = _ceil_div(seqlen_q, bm) * batch * heads * 4
    return out


# ---------------------------------------------------------------------------------------
# The emulated kernels
# ---------------------------------------------------------------------------------------

def _contig(t: torch.Tensor) -> torch.Tensor:
    # flash_attn_interface.maybe_contiguous
    return t.contiguous() if t.stride(-1) != 1 else t


def _check_call(version: int, q: torch.Tensor, cc: tuple[int, int]) -> None:
    check_flash_support(f"flash_attention_{version}", compute_capability=cc, dtype=q.dtype, head_dim=q.size(-1))


def _alloc(like: torch.Tensor, nbytes_by_name: dict[str, int], skip: tuple[str, ...]) -> list[torch.Tensor]:
    return [like.new_empty((n,), dtype=torch.uint8) for name, n in nbytes_by_name.items() if name not in skip and n]


class _Flash(torch.autograd.Function):
    """Dense and varlen calls of FA2 / FA3 (one Function: `cu` is None for the dense call)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, softcap, version, num_sms):  # type: ignore[override]
        q, k, v = _contig(q), _contig(k), _contig(v)
        varlen = cu_q is not None
        out = torch.empty_like(q)  # mha_fwd / mha_varlen_fwd: out = empty_like(q)
        if varlen:
            lse = q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)  # {num_heads, total_q}
        else:
            B, Sq, H, D = q.shape
            lse = q.new_empty((B, H, Sq), dtype=torch.float32)  # {batch, num_heads, seqlen_q}
            if version == 2 and dropout_p == 0.0:
                # set_params_splitkv(num_splits=0): heuristic; splits > 1 only for short queries
                block_n = 256 if D <= 64 else (128 if D <= 128 else 64)
                from memfit.sim.kernels.sdpa import _num_splits_heuristic

                n = _num_splits_heuristic(B * H * _ceil_div(Sq, 64), num_sms * 2, _ceil_div(k.size(1), block_n), 128)
                if n > 1:
                    acc = [q.new_empty((n, B, H, Sq), dtype=torch.float32),
                           q.new_empty((n, B, H, Sq, _fa2_d_rounded(D)), dtype=torch.float32)]
                    del acc
        saved = [q, k, v, out, lse]
        if varlen:
            saved += [cu_q, cu_k]
        if version == 2:
            saved.append(q.new_empty((2,), dtype=torch.int64))  # rng_state = empty({2}, kInt64)
        ctx.save_for_backward(*saved)
        ctx.meta = (varlen, max_q, max_k, causal, softcap, version)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        varlen, max_q, max_k, causal, softcap, version = ctx.meta
        saved = ctx.saved_tensors  # read once: checkpointing refuses a second unpack
        q, k, v = saved[:3]
        dout = _contig(dout)  # _flash_attn_backward: maybe_contiguous(dout, q, k, v, out)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if varlen:
            cu_q = saved[5]
            batch = cu_q.numel() - 1
            sizes = flash_backward_bytes(version, batch=batch, seqlen_q=max_q, seqlen_k=max_k, heads=q.size(1),
                                         heads_k=k.size(1), head_dim=q.size(-1), itemsize=q.element_size(),
                                         causal=causal, softcap=softcap, varlen_total_q=q.size(0),
                                         varlen_total_k=k.size(0))
        else:
            sizes = flash_backward_bytes(version, batch=q.size(0), seqlen_q=q.size(1), seqlen_k=k.size(1),
                                         heads=q.size(2), heads_k=k.size(2), head_dim=q.size(-1),
                                         itemsize=q.element_size(), causal=causal, softcap=softcap)
        work = _alloc(q, sizes, skip=("dq", "dk", "dv"))
        del work
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _pad8(t: torch.Tensor) -> torch.Tensor:
    # FlashAttnFunc.forward: if head_size_og % 8 != 0: F.pad(x, [0, 8 - head_size_og % 8])
    d = t.size(-1)
    return t if d % 8 == 0 else torch.nn.functional.pad(t, [0, 8 - d % 8])


def _make_kernels(version: int, cc: tuple[int, int], sm_count: int | None = None):
    sms = num_sms(sm_count)

    def _run(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, softcap):
        _check_call(version, q, cc)
        og = q.size(-1)
        if version == 2:
            q, k, v = _pad8(q), _pad8(k), _pad8(v)
        out = _Flash.apply(q, k, v, cu_q, cu_k, max_q, max_k, float(dropout_p), bool(causal), float(softcap or 0.0),
                           version, sms)
        return out[..., :og] if out.size(-1) != og else out

    if version == 2:
        # flash_attn_interface.flash_attn_func / flash_attn_varlen_func signatures (transformers inspects them)
        def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
            return _run(q, k, v, None, None, None, None, dropout_p, causal, softcap)

        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
            return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
                        causal, softcap)
    else:
        # hopper/flash_attn_interface.py: no dropout_p
        def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                            v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                            pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
            return _run(q, k, v, None, None, None, None, 0.0, causal, softcap)

        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                                   seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                                   k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                                   softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                                   return_attn_probs=False):
            return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), 0.0, causal,
                        softcap)

    return flash_attn_func, flash_attn_varlen_func


# ---------------------------------------------------------------------------------------
# Data-dependent steps of transformers' flash path, on fake tensors
# ---------------------------------------------------------------------------------------

def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _fake_mask_counts(mask: torch.Tensor) -> tuple[int, int]:
    """(valid tokens, longest example) of a padding mask the simulator built.

    memfit.sim.engine._make_batch pads the last example by one token (so that transformers takes the
    padded branch a real padded batch takes); the values of a FakeTensor cannot be read, so that
    rule is used here: B * S - 1 valid tokens, longest S.
    """
    batch, seq = int(mask.shape[0]), int(mask.shape[-1])
    return batch * seq - 1, seq


def _padding_free_error() -> MemfitError:
    return MemfitError("a padding-free (packed) batch reached flash attention with `position_ids` only; under "
                       "memfit's simulation pass `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q`, `max_length_k` "
                       "too (memfit.sim.kernels.flash_attn.padding_free_kwargs(lengths))")


@contextlib.contextmanager
def flash_patches(*, compute_capability: tuple[int, int], log: list[str] | None = None,
                  sm_count: int | None = None) -> Iterator[None]:
    """Give transformers' flash path the emulated kernels (and fake-safe unpadding) for the enclosed code.

    Args:
        compute_capability: the emulated GPU's (major, minor); decides whether the kernels may run.
        log: receives `flash_attention_2` / `flash_attention_3` (varlen calls: `...:varlen`) per call.
        sm_count: the GPU's SMs (FA2's split-KV heuristic); None: `FALLBACK_SM_COUNT` (sdpa_choice.num_sms).
    """
    from transformers import masking_utils
    from transformers import modeling_flash_attention_utils as mfau

    cc = (int(compute_capability[0]), int(compute_capability[1]))
    kernels = {2: _make_kernels(2, cc, sm_count), 3: _make_kernels(3, cc, sm_count)}
    calls = log if log is not None else []

    loaded: dict[str, Any] = {}  # lazy_import_flash_attention caches what it loaded; so does this

    def lazy_import(implementation, attention_wrapper=None, allow_all_kernels=False):
        name = canonical_attn_implementation(implementation or "flash_attention_2")
        if name not in loaded:
            loaded[name] = _load(name)
        return loaded[name]

    def _load(name):
        version = 3 if name == "flash_attention_3" else 2
        fn, varlen_fn = kernels[version]

        def logged(f, tag):
            def call(*args, **kwargs):
                calls.append(tag)
                return f(*args, **kwargs)
            call.__signature__ = inspect.signature(f)  # transformers reads the kernel's parameters
            return call

        varlen_logged = logged(varlen_fn, f"{name}:varlen")
        return ((logged(fn, name), varlen_logged, None, mfau._pad_input, mfau._unpad_input),
                (mfau._lazy_define_process_function(varlen_logged), dict))

    plain_unpad_data = mfau._get_unpad_data
    plain_packed = mfau._is_packed_sequence
    plain_mask = masking_utils.flash_attention_mask

    def get_unpad_data(attention_mask):
        if not _is_fake(attention_mask):
            return plain_unpad_data(attention_mask)
        # same ops as _get_unpad_data, with the data-dependent sizes from _fake_mask_counts
        nnz, longest = _fake_mask_counts(attention_mask)
        seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
        flat = attention_mask.flatten()
        indices = flat.new_empty((nnz, 1), dtype=torch.int64).flatten()  # torch.nonzero(flat).flatten()
        del flat
        top = seqlens.max()  # seqlens_in_batch.max().item(): a device scalar, read on the host
        del top
        cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
        return indices, cu, longest

    def is_packed(position_ids, batch_size):
        if position_ids is not None and _is_fake(position_ids) and batch_size == 1 and position_ids.shape[-1] > 1:
            # a batch of one without a mask: memfit's batches are one example, not packed ones
            return False
        return plain_packed(position_ids, batch_size)

    def flash_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
        if attention_mask is not None and _is_fake(attention_mask):
            # `attention_mask.all()` runs (a bool scalar) but cannot be read; the simulator's batches have one pad
            # token (see above), so the mask is returned as a padded batch's is
            sliced = attention_mask[:, -kv_length:]
            everything = sliced.all()
            del everything
            return sliced
        extra = {} if mask_function is None else {"mask_function": mask_function}
        return plain_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                          **extra, **kwargs)

    registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    saved_masks = {k: registry[k] for k in ("flash_attention_2", "flash_attention_3") if k in registry}
    try:
        for k in saved_masks:
            registry[k] = flash_mask
        with patched(mfau, "lazy_import_flash_attention", lazy_import), \
                patched(mfau, "_get_unpad_data", get_unpad_data), patched(mfau, "_is_packed_sequence", is_packed):
            yield
    finally:
        registry.update(saved_masks)


def padding_free_kwargs(lengths: list[int], *, device: Any = None) -> dict[str, Any]:
    """The keyword arguments a padding-free (packed) batch of examples of `lengths` tokens gives the model
    for flash attention's varlen path (transformers `FlashAttentionKwargs`, what TRL's padding-free
    collator builds): `cu_seq_lens_q/k` int32 (len(lengths) + 1) and `max_length_q/k` ints, plus
    `position_ids` (1, sum(lengths)) restarting at 0 for each example.

    Args:
        lengths: token count of each packed example (all positive).
        device: where the tensors are made (None: the current default).
    """
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in lengths):
        raise MemfitError(f"padding-free lengths must be positive token counts; got `{lengths!r}`")
    total = sum(lengths)
    # TRL DataCollatorForLanguageModeling(padding_free=True) / transformers DataCollatorWithFlattening:
    # position_ids restart at 0 per example; cu_seq_lens is their cumulative sum from 0.
    cu = torch.empty((len(lengths) + 1,), dtype=torch.int32, device=device)
    pos = torch.empty((1, total), dtype=torch.long, device=device)
    if not _is_fake(cu):
        cu.copy_(torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32))
        pos.copy_(torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0))
    return {"position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
            "max_length_k": max(lengths)}


def _cumsum(xs: list[int]) -> Iterator[int]:
    s = 0
    for x in xs:
        s += x
        yield s


def use_flash_attention(model: torch.nn.Module, implementation: str, *, compute_capability: tuple[int, int],
                        amp_dtype: torch.dtype | None) -> str:
    """Switch a model built with sdpa to `implementation` (flash-attn is not installed here, so transformers'
    own `_check_and_adjust_attn_implementation` would refuse to build it); check the GPU, dtype and head dim.
    Returns the canonical implementation name.

    Args:
        model: the (meta) model, before peft wraps it.
        implementation: flash_attention_2 / flash_attention_3 or a hub flash kernel.
        compute_capability: the target GPU's.
        amp_dtype: the autocast dtype (None: no mixed precision; the weights' dtype reaches the kernel).
    """
    name = canonical_attn_implementation(implementation)
    if not getattr(model, "_supports_flash_attn", False):
        raise MemfitError(f"`{type(model).__name__}` does not support flash attention in transformers (its class "
                          "sets no `_supports_flash_attn`); use `--attn sdpa`")
    config = model.config
    dtype = amp_dtype
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    check_flash_support(name, compute_capability=compute_capability, dtype=dtype, head_dim=head_dim)
    config._attn_implementation = name  # the setter propagates to sub-configs
    return name
