"""Tests for memfit.sim.kernels.sdpa (CPU only)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.sim.kernels.sdpa import SdpaChoice, choose_backend, emulated_sdpa


def _choose(q=(2, 8, 128, 64), k=None, v=None, dtype=torch.float16, has_mask=False, dropout_p=0.0,
            is_causal=False, enable_gqa=False, requires_grad=True, cc=(8, 0), **kw) -> SdpaChoice:
    k = k or q
    v = v or k
    return choose_backend(q_shape=q, k_shape=k, v_shape=v, dtype=dtype, has_mask=has_mask,
                          mask_dtype=torch.bool if has_mask else None, dropout_p=dropout_p,
                          is_causal=is_causal, enable_gqa=enable_gqa, requires_grad=requires_grad,
                          compute_capability=cc, **kw)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(), "flash"),  # A100 fp16, no mask
        (dict(dtype=torch.bfloat16), "flash"),
        (dict(has_mask=True), "efficient"),  # flash: no attn_mask support
        (dict(dtype=torch.float32), "efficient"),  # flash: fp16/bf16 only
        (dict(cc=(7, 0)), "efficient"),  # V100: flash needs sm80
        (dict(cc=(7, 5), dtype=torch.bfloat16), "math"),  # T4 bf16: mem-eff has no bf16 < sm80
        (dict(cc=(7, 5), dtype=torch.float32), "efficient"),
        (dict(cc=(6, 1)), "efficient"),
        (dict(cc=(3, 7)), "math"),  # K80: below sm50
        (dict(dropout_p=0.1), "flash"),  # both fused kernels support dropout
        (dict(dropout_p=0.1, has_mask=True), "efficient"),
        (dict(q=(2, 8, 128, 512)), "efficient"),  # flash <= 256; mem-eff has no upper bound
        (dict(q=(2, 8, 128, 512), dtype=torch.float64), "math"),
        (dict(q=(2, 8, 128, 260)), "math"),  # > 256 and not a multiple of 8
        (dict(q=(2, 8, 128, 60)), "flash"),  # flash pads head dim to a multiple of 8
        (dict(q=(2, 8, 128, 60), has_mask=True), "math"),  # mem-eff: 60 % 8 != 0 for fp16
        (dict(q=(2, 8, 128, 60), has_mask=True, dtype=torch.float32), "efficient"),  # fp32 alignment 4
        (dict(q=(2, 8, 128, 64), k=(2, 8, 256, 64), is_causal=True), "efficient"),  # causal, Lq != Lk
        (dict(q=(2, 8, 128, 64), k=(2, 2, 128, 64), enable_gqa=True), "flash"),
        (dict(q=(2, 8, 128, 64), k=(2, 2, 128, 64), enable_gqa=False), "math"),
        (dict(q=(2, 8, 128, 64), k=(2, 3, 128, 64), enable_gqa=True), "math"),  # 3 does not divide 8
        (dict(q=(2, 8, 128, 64), k=(2, 2, 128, 64), enable_gqa=True, has_mask=True), "efficient"),
        (dict(q=(2, 8, 128, 224), cc=(8, 6)), "efficient"),  # sm86 training with head dim in (192, 224]
        (dict(q=(2, 8, 128, 224), cc=(8, 6), requires_grad=False), "flash"),
        (dict(q=(2, 8, 128, 256), cc=(8, 6)), "flash"),  # > 224 without dropout is fine
        (dict(q=(2, 8, 128, 256), cc=(8, 6), dropout_p=0.1), "efficient"),
        (dict(cc=(9, 0)), "cudnn"),  # H100: cuDNN first in the default order (cuDNN > 9.15)
        (dict(cc=(9, 0), has_mask=True, mask_shape=(2, 1, 128, 128)), "cudnn"),
        (dict(cc=(9, 0), dtype=torch.float32), "efficient"),
        (dict(cc=(9, 0), cudnn_version=91002), "flash"),  # older cuDNN: not preferred
        (dict(cc=(9, 0), deprioritize_cudnn=True), "flash"),  # TORCH_CUDNN_SDPA_DEPRIORITIZED=1
        (dict(cc=(8, 9)), "flash"),  # L4 / Ada: cuDNN not preferred
        (dict(cc=(12, 0)), "flash"),
        (dict(cc=(10, 0)), "cudnn"),
        (dict(cc=(9, 0), dropout_p=0.1), "flash"),  # cuDNN dropout must be a multiple of 1/16
        (dict(cc=(9, 0), dropout_p=0.125), "cudnn"),
        (dict(storage_offsets=(0, 4, 8), has_mask=True), "math"),  # mem-eff 16-byte pointer alignment
    ],
)
def test_backend_choice_table(kwargs, expected):
    choice = _choose(**kwargs)
    assert choice.backend == expected, choice.reasons


def test_reasons_explain_rejections():
    choice = _choose(has_mask=True)
    assert choice.backend == "efficient"
    assert any(r.startswith("flash:") and "attn_mask" in r for r in choice.reasons)
    choice = _choose(cc=(7, 5), dtype=torch.bfloat16)
    assert any(r.startswith("flash:") for r in choice.reasons)
    assert any(r.startswith("efficient:") for r in choice.reasons)


def _hf_qkv(B, L, H, D, dtype, Hkv=None, requires_grad=True):
    """q, k, v as HF passes them: (B, H, L, D) views of contiguous (B, L, H, D) projections."""
    Hkv = Hkv or H
    leaves = [torch.empty(B, L, h * D, dtype=dtype, requires_grad=requires_grad) for h in (H, Hkv, Hkv)]
    views = [t.view(B, L, h, D).transpose(1, 2) for t, h in zip(leaves, (H, Hkv, Hkv))]
    return leaves, views


@pytest.mark.parametrize(
    "dtype, mask, cc, Hkv, gqa, D",
    [
        (torch.float16, False, (8, 0), None, False, 64),  # flash
        (torch.bfloat16, False, (8, 0), 2, True, 64),  # flash GQA
        (torch.float16, False, (8, 0), None, False, 60),  # flash, padded head dim
        (torch.float16, True, (8, 0), None, False, 64),  # efficient, bool mask
        (torch.float32, False, (8, 0), None, False, 64),  # efficient fp32
        (torch.float16, True, (8, 0), 2, True, 64),  # efficient GQA
        (torch.float16, False, (8, 0), None, False, 512),  # efficient, big head dim
        (torch.bfloat16, False, (7, 5), None, False, 64),  # math
        (torch.float16, False, (9, 0), None, False, 64),  # cudnn
        (torch.float16, False, (9, 0), 2, True, 64),  # cudnn GQA
    ],
)
@pytest.mark.parametrize("fake", [True, False])
def test_forward_backward_shapes(dtype, mask, cc, Hkv, gqa, D, fake):
    B, L, H = 2, 40, 4
    ctx = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
    if not fake:
        ctx = torch.enable_grad()
    with ctx:
        leaves, (q, k, v) = _hf_qkv(B, L, H, D, dtype, Hkv)
        m = torch.ones(B, 1, L, L, dtype=torch.bool) if mask else None
        out = emulated_sdpa(q, k, v, m, enable_gqa=gqa, compute_capability=cc)
        assert out.shape == (B, H, L, D)
        assert out.dtype == dtype
        if cc != (7, 5) and D % 8 == 0:
            # fused kernels: (B, H, L, D) view of a contiguous (B, L, H, D) buffer
            assert out.transpose(1, 2).is_contiguous()
        elif D % 8:
            # flash padded the head dim to 64 and post_process_flash_output sliced it back
            assert out.untyped_storage().nbytes() == B * H * L * 64 * out.element_size()
        out.sum().backward()
        for leaf in leaves:
            assert leaf.grad is not None
            assert leaf.grad.shape == leaf.shape
            assert leaf.grad.dtype == dtype


@pytest.mark.parametrize("backend_cc_dtype", [((8, 0), torch.float16), ((8, 0), torch.float32), ((9, 0), torch.float16)])
def test_grad_strides_of_fused_backends(backend_cc_dtype):
    cc, dtype = backend_cc_dtype
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(2, 4, 40, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        out = emulated_sdpa(q, k, v, compute_capability=cc)
        gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
        for g in (gq, gk, gv):
            assert g.shape == (2, 4, 40, 64) and g.dtype == dtype


def test_float_mask_gets_gradient():
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(2, 4, 40, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
        bias = torch.empty(2, 4, 40, 40, dtype=torch.float16, requires_grad=True)
        out = emulated_sdpa(q, k, v, bias)
        (gb,) = torch.autograd.grad(out.sum(), (bias,))
        assert gb.shape == bias.shape and gb.dtype == torch.float16


def test_real_tensors_math_matches_torch():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = emulated_sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(got, ref)


# --------------------------------------------------------------------------------------
# Byte accounting
# --------------------------------------------------------------------------------------


class _AllocRecorder(TorchDispatchMode):
    """Records every new storage produced by an aten op (identity + nbytes)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, int] = {}
        self.order: list[tuple[str, tuple, torch.dtype, int]] = []
        self._keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = id(s) if not hasattr(s, "_cdata") else s._cdata
                if key not in self.seen:
                    self.seen[key] = s.nbytes()
                    self.order.append((str(func), tuple(t.shape), t.dtype, s.nbytes()))
                    self._keep.append(t)
        return out


def _saved_bytes(fn):
    """Unique storage bytes saved for backward by fn() (via saved_tensors_hooks)."""
    storages: dict[int, int] = {}
    shapes = []

    def pack(t):
        s = t.untyped_storage()
        storages[s._cdata] = s.nbytes()
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), shapes, out


@pytest.mark.parametrize("L", [256, 512])
def test_flash_saves_linear_math_saves_quadratic(L):
    B, H, D = 1, 4, 64
    with FakeTensorMode(allow_non_fake_inputs=True):
        leaves, (q, k, v) = _hf_qkv(B, L, H, D, torch.float16)
        flash_bytes, flash_shapes, _ = _saved_bytes(lambda: emulated_sdpa(q, k, v, compute_capability=(8, 0)))
        leaves, (q, k, v) = _hf_qkv(B, L, H, D, torch.bfloat16)
        # T4 (sm75) + bf16 -> math backend
        math_bytes, math_shapes, _ = _saved_bytes(lambda: emulated_sdpa(q, k, v, compute_capability=(7, 5)))
    # flash: q, k, v, out (each B*L*H*D fp16) + lse (B, H, L) fp32 + 2 x int64 scalars
    qkvo = B * L * H * D * 2
    assert flash_bytes == 4 * qkvo + B * H * L * 4 + 2 * 8
    assert not any(len(s) == 4 and s[-1] == L and s[-2] == L for s in flash_shapes)
    # math (fp32 upcast by default): saves (B, H, L, L) attention probabilities
    assert any(len(s) == 4 and s[-2:] == (L, L) for s in math_shapes)
    assert math_bytes > B * H * L * L * 4


def test_flash_saved_bytes_scale_linearly():
    def saved(L, cc, dtype=torch.float16):
        with FakeTensorMode(allow_non_fake_inputs=True):
            _, (q, k, v) = _hf_qkv(1, L, 4, 64, dtype)
            return _saved_bytes(lambda: emulated_sdpa(q, k, v, compute_capability=cc))[0]

    f1, f2 = saved(512, (8, 0)), saved(1024, (8, 0))  # flash
    assert f2 - 16 == 2 * (f1 - 16)  # O(L)
    e1, e2 = saved(512, (6, 0)), saved(1024, (6, 0))  # sm60 fp16 -> efficient: O(L) too
    assert e2 - 16 == 2 * (e1 - 16)
    m1, m2 = saved(512, (7, 5), torch.bfloat16), saved(1024, (7, 5), torch.bfloat16)  # math
    assert m2 > 3 * m1  # O(L^2) dominates (linear terms keep it below 4x)


def test_flash_backward_allocations():
    B, L, H, D = 2, 200, 4, 64
    with FakeTensorMode(allow_non_fake_inputs=True):
        _, (q, k, v) = _hf_qkv(B, L, H, D, torch.float16)
        out = emulated_sdpa(q, k, v)
        loss = out.sum()
        rec = _AllocRecorder()
        with rec:
            loss.backward()
    allocs = [(shape, dtype, n) for _, shape, dtype, n in rec.order]
    Lr = 256  # round_up(200, 128)
    assert ((B, Lr, H, 64), torch.float32, B * Lr * H * 64 * 4) in allocs  # dq_accum
    assert ((B, H, Lr), torch.float32, B * H * Lr * 4) in allocs  # softmax_d


def test_efficient_forward_allocations_and_mask_padding():
    B, L, H, D = 2, 100, 4, 64  # L % 8 != 0 -> mask padded to 104
    with FakeTensorMode(allow_non_fake_inputs=True):
        _, (q, k, v) = _hf_qkv(B, L, H, D, torch.float16)
        mask = torch.ones(B, 1, L, L, dtype=torch.bool)
        rec = _AllocRecorder()
        with rec:
            out = emulated_sdpa(q, k, v, mask)
        allocs = [(shape, dtype) for _, shape, dtype, _ in rec.order]
        assert ((B, 1, L, L), torch.float16) in allocs  # bool -> additive mask
        assert ((B, 1, L, 104), torch.float16) in allocs  # pad_bias<8>
        assert ((B, H, 128), torch.float32) in allocs  # logsumexp ceil(100/32)*32
        assert ((B, L, H, D), torch.float16) in allocs  # output (B, M, H, Kv)
        assert not any(s == (B, H, L, L) for s, _ in allocs)  # mask only expanded (a view)
        rec = _AllocRecorder()
        with rec:
            out.sum().backward()
        names = [(shape, dtype) for _, shape, dtype, _ in rec.order]
        assert ((B, H, L), torch.float32) in names  # delta
        assert any(dt == torch.uint8 for _, dt in names)  # workspace (fp32 grad accumulators)


# --- the SM count comes from the GPU catalog (memfit.gpus.catalog), one fallback where it is unknown ---

def test_num_sms_reads_the_catalog_and_falls_back_to_one_constant():
    from memfit.gpus.catalog import CATALOG, FALLBACK_SM_COUNT, resolve_gpu
    from memfit.sim.kernels.sdpa_choice import num_sms

    assert num_sms(CATALOG["l4"]) == 58 and num_sms(CATALOG["rtx-4090"]) == 128  # both sm89
    assert num_sms(CATALOG["h100-pcie"]) == 114 and num_sms(CATALOG["h100-80gb"]) == 132  # both sm90
    assert num_sms(70) == 70
    assert num_sms(None) == num_sms(resolve_gpu("24GiB")) == FALLBACK_SM_COUNT == 108  # a size: SMs unknown


def test_the_gpus_sm_count_drives_the_flash_split_kv_choice(monkeypatch):
    """FA2's set_params_splitkv: num_splits_heuristic(..., multiProcessorCount * 2, ...); a short query
    (B*H*m_blocks = 8) splits over an L4's 58 SMs differently than over an H100's 132."""
    import memfit.sim.kernels.sdpa as sdpa

    seen = []
    real = sdpa._num_splits_heuristic
    monkeypatch.setattr(sdpa, "_num_splits_heuristic", lambda a, sms, n, m: seen.append(sms) or real(a, sms, n, m))
    q = torch.zeros(1, 8, 16, 64, dtype=torch.float16)
    k = torch.zeros(1, 8, 4096, 64, dtype=torch.float16)
    with FakeTensorMode():
        fq, fk = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k))
        for sm_count in (58, 132, None):
            emulated_sdpa(fq, fk, fk, compute_capability=(8, 9), sm_count=sm_count)
    assert seen == [116, 264, 216]
    assert real(8, 116, 16, 128) != real(8, 264, 16, 128)
