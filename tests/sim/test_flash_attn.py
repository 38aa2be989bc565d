"""FlashAttention-2/3 emulation (memfit.sim.kernels.flash_attn): allocations vs flash-attn's source rules,
transformers' own flash path running the emulated kernels (padded and padding-free batches), the GPU / dtype
errors, and flash vs sdpa vs eager memory on a Llama-like model at 4k tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from memfit.errors import MemfitError
from memfit.sim import _torch_adapter as adapter
from memfit.sim.engine import simulate
from memfit.sim.kernels import flash_attn as fa
from memfit.sim.tracker import StorageTracker
from memfit.train_setup import TrainSetup
from helpers import trace_peak_bytes


def _allocs(tracker: StorageTracker, start: int) -> list[int]:
    return sorted(rec.size_bytes for action, rec, _, _ in tracker.events[start:] if action == "alloc")


def _run_kernel(version, B, S, H, Hk, D, *, cc=(8, 0), varlen_lengths=None):
    """Forward and backward allocations (bytes, sorted) of the emulated kernel on fake bf16 inputs."""
    fn, varlen_fn = fa._make_kernels(version, cc)
    tracker = StorageTracker()
    with adapter.new_fake_mode(), tracker:
        if varlen_lengths is None:
            q = torch.empty(B, S, H, D, dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(B, S, Hk, D, dtype=torch.bfloat16, requires_grad=True)
            v = torch.empty(B, S, Hk, D, dtype=torch.bfloat16, requires_grad=True)
            start = len(tracker.events)
            out = fn(q, k, v, causal=True)
        else:
            T = sum(varlen_lengths)
            q = torch.empty(T, H, D, dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(T, Hk, D, dtype=torch.bfloat16, requires_grad=True)
            v = torch.empty(T, Hk, D, dtype=torch.bfloat16, requires_grad=True)
            kw = fa.padding_free_kwargs(varlen_lengths)
            start = len(tracker.events)
            out = varlen_fn(q, k, v, kw["cu_seq_lens_q"], kw["cu_seq_lens_k"], kw["max_length_q"],
                            kw["max_length_k"], causal=True)
        fwd = _allocs(tracker, start)
        mid = len(tracker.events)
        out.sum().backward()
        bwd = _allocs(tracker, mid)
    return fwd, bwd


def test_fa2_dense_allocations_follow_flash_api():
    B, S, H, Hk, D = 2, 1100, 8, 2, 64
    fwd, bwd = _run_kernel(2, B, S, H, Hk, D)
    # mha_fwd: out = empty_like(q) (bf16), softmax_lse {B, H, S} fp32, rng_state {2} int64
    # (B*H*ceil(S/64) = 288 >= 0.8 * 2 * 108 SMs: num_splits_heuristic gives 1 split, no accumulators)
    assert fwd == sorted([B * S * H * D * 2, B * H * S * 4, 16])
    s_r = 1152  # round_multiple(1100, 128)
    # FlashAttnFunc.backward: dq, dk, dv = empty_like(q/k/v); mha_bwd: softmax_d {B, H, 1152} fp32,
    # dq_accum {B, 1152, H, round(64, 32)} fp32, GQA dk/dv_expanded {B, S, H, D} bf16.
    kernel = [B * S * H * D * 2, B * S * Hk * D * 2, B * S * Hk * D * 2, B * H * s_r * 4, B * s_r * H * 64 * 4,
              B * S * H * D * 2, B * S * H * D * 2]
    for size in kernel:
        assert size in bwd, (size, bwd)
        bwd.remove(size)
    # what remains: the seed gradient of out.sum() (2 bf16 scalars) and maybe_contiguous(dout) (an expand)
    assert bwd == [2, 2, B * S * H * D * 2]


def test_fa2_short_queries_get_split_kv_accumulators():
    B, S, H, D = 2, 300, 8, 64  # 2*8*5 = 80 m-blocks < 0.8 * 216: set_params_splitkv picks 2 splits
    fwd, _ = _run_kernel(2, B, S, H, H, D)
    # softmax_lse_accum {2, B, H, S} and out_accum {2, B, H, S, round(64, 32)} fp32, freed after the kernel
    assert fwd == sorted([B * S * H * D * 2, B * H * S * 4, 16, 2 * B * H * S * 4, 2 * B * H * S * 64 * 4])


def test_fa2_pads_head_dim_to_a_multiple_of_8_and_rounds_dq_accum():
    B, S, H, D = 1, 128, 4, 72  # 72 % 8 == 0: no pad; D_rounded = round(72, 32) = 96
    fwd, bwd = _run_kernel(2, B, S, H, H, D)
    assert B * S * H * 96 * 4 in bwd  # dq_accum with head_size_rounded 96
    B, S, H, D = 1, 128, 4, 60  # padded to 64 by F.pad in FlashAttnFunc.forward
    fwd, _ = _run_kernel(2, B, S, H, H, D)
    assert fwd.count(B * S * H * 64 * 2) == 4  # q, k, v padded copies + out_padded


def test_fa2_varlen_allocations_follow_mha_varlen():
    lengths, H, D = [100, 250, 30], 4, 64
    T, b = sum(lengths), len(lengths)
    fwd, bwd = _run_kernel(2, None, None, H, H, D, varlen_lengths=lengths)
    assert fwd == sorted([T * H * D * 2, H * T * 4, 16])  # softmax_lse {H, total_q} (unpadded lse)
    # mha_varlen_bwd: softmax_d {H, total_q + 128 b}; dq_accum {total_q + 128 b, H, 64} fp32
    assert H * (T + 128 * b) * 4 in bwd and (T + 128 * b) * H * 64 * 4 in bwd


def test_fa3_backward_workspaces_follow_hopper_flash_api():
    B, S, H, Hk, D = 1, 1000, 8, 2, 128
    fwd, bwd = _run_kernel(3, B, S, H, Hk, D, cc=(9, 0))
    assert fwd == sorted([B * S * H * D * 2, B * H * S * 4])  # no rng_state in FA3
    bm, bn = 64, 128  # hopper mha_bwd sm90, hdim 128, causal: kBlockM 64, kBlockN 128
    sq, sk = 1024, 1024  # round_multiple(1000, 64), round_multiple(1000, 128)
    for size in (B * H * sq * 4, B * H * sq * 4, B * H * sq * 128 * 4,  # softmax_d, softmax_lse_log2, dq_accum
                 B * Hk * sk * 128 * 4, B * Hk * sk * 128 * 4,  # dk_accum, dv_accum (GQA), fp32
                 -(-S // bm) * B * H * 4):  # dq_semaphore int32
        assert size in bwd, (size, bwd)
        bwd.remove(size)


@pytest.mark.parametrize("cc,impl", [((7, 0), "flash_attention_2"), ((7, 5), "flash_attention_2"),
                                     ((8, 0), "flash_attention_3"), ((8, 9), "flash_attention_3")])
def test_flash_on_a_gpu_that_cannot_run_it_is_a_clear_error(cc, impl):
    with pytest.raises(MemfitError, match=r"compute capability `\d\.\d`.*Use `--attn"):
        fa.check_flash_support(impl, compute_capability=cc)


def test_flash_in_fp32_is_a_clear_error_naming_the_fix():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, dtype="float32")
    setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=1, max_length=64,
                       attn_implementation="flash_attention_2")
    with pytest.raises(MemfitError, match=r"fp16 or bf16.*`float32`.*--precision bf16"):
        simulate(setup)


def test_flash_on_a_v100_through_simulate_is_an_error():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=1, max_length=64, precision="fp16",
                       attn_implementation="flash_attention_2", compute_capability=(7, 0))
    with pytest.raises(MemfitError, match="Ampere"):
        simulate(setup)


def test_unknown_and_hub_attention_names():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    with pytest.raises(MemfitError, match="not modelled"):
        TrainSetup(model=cfg, task="causal-lm", attn_implementation="kernels-community/metal-flash-sdpa")
    TrainSetup(model=cfg, task="causal-lm", attn_implementation="kernels-community/flash-attn2")
    assert fa.canonical_attn_implementation("kernels-community/vllm-flash-attn3") == "flash_attention_3"


_peak = trace_peak_bytes  # tests/helpers.py


def test_flash_vs_sdpa_vs_eager_at_4k_tokens_on_a_llama_like_model():
    """No S x S tensor with flash; eager has one per head; flash's peak is the smallest."""
    S, H = 4096, 8
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=H,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=S)
    out = {}
    for attn in ("eager", "sdpa", "flash_attention_2"):
        setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=1, max_length=S, precision="bf16",
                           attn_implementation=attn)
        sim = simulate(setup)
        out[attn] = (sim, _peak(sim.trace), max(e.size_bytes for e in sim.trace if e.action == "alloc"))
    sq = S * S * 2  # one bf16 S x S matrix
    flash, sdpa, eager = out["flash_attention_2"], out["sdpa"], out["eager"]
    assert flash[0].attn_kernels == ["flash_attention_2:varlen"]  # the padded batch takes _upad_input + varlen
    assert flash[2] < sq and eager[2] >= H * sq
    assert flash[1] < sdpa[1] < eager[1]
    # what flash keeps per layer instead: the fp32 logsumexp (H, total tokens) of mha_varlen_fwd
    assert any(e.size_bytes == H * (S - 1) * 4 for e in flash[0].trace if e.action == "alloc")


def test_padding_free_batch_runs_transformers_varlen_path():
    """A packed batch (TRL padding_free): the model gets cu_seq_lens / max_length and flash runs varlen."""
    from memfit.sim.cuda_patches import cuda_patches
    from transformers import AutoModelForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    fa.use_flash_attention(model, "flash_attention_2", compute_capability=(8, 0), amp_dtype=None)
    log: list[str] = []
    tracker = StorageTracker()
    with adapter.new_fake_mode(), tracker, cuda_patches(compute_capability=(8, 0), sdpa_log=[], flash_log=log):
        model.to_empty(device="cpu")
        kw = fa.padding_free_kwargs([40, 24])
        ids = torch.zeros(1, 64, dtype=torch.long)
        start = len(tracker.events)
        out = model(input_ids=ids, labels=ids, **kw)
        out.loss.backward()
    assert log and set(log) == {"flash_attention_2:varlen"}
    lse = 4 * 64 * 4  # softmax_lse {H=4, total_q=64} fp32, one per layer
    assert sum(1 for a, rec, _, _ in tracker.events[start:] if a == "alloc" and rec.size_bytes == lse) >= 2


def test_flex_attention_is_simulated():
    """flex_attention is no longer refused: its compiled kernels are emulated (tests/sim/test_flex_attn.py)."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=1, max_length=64, precision="bf16",
                       attn_implementation="flex_attention")
    assert simulate(setup).attn_kernels == ["flex_attention"]


@pytest.mark.parametrize("liger", [False, True])
def test_flash_and_liger_fake_trace_equals_a_real_cpu_run(liger):
    """The fake-tensor unpadding rule (one pad token) and the Liger scalar placeholders give the trace a real
    CPU run of the same emulation gives, event for event."""
    pytest.importorskip("liger_kernel")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=2, max_length=48, precision="bf16",
                       attn_implementation="flash_attention_2", use_liger_kernel=liger)
    fake = simulate(setup, fake=True, splice=False)
    real = simulate(setup, fake=False, splice=False)
    key = lambda t: [(e.action, e.size_bytes, e.category, e.phase) for e in t]  # noqa: E731
    assert key(fake.trace) == key(real.trace)
    assert fake.attn_kernels == real.attn_kernels
