"""FlexAttention (`--attn flex_attention`; memfit.sim.kernels.flex_attn): why it is emulated,
the saved-tensor and allocation rules read from the installed torch (so an upgrade that changes them fails
here), the emulated kernels' allocations, and transformers' own flex path running them on a Llama."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import LlamaConfig

from memfit.errors import MemfitError
from memfit.sim import _torch_adapter as adapter
from memfit.sim.kernels import flex_attn
from memfit.sim.tracker import StorageTracker
from memfit.train_setup import TrainSetup


def test_torch_refuses_flex_backward_on_cpu():
    """The real code path cannot run here: hence the emulation."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    with FakeTensorMode():
        q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 2, 256, 256, device="cpu")
        with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
            flex_attention(q, k, v, block_mask=mask)


def test_saved_tensor_rule_from_installed_source():
    """The backward op reads q, k, v, out, logsumexp and the block mask, not max_scores (what the compiled graph
    saves); the eager autograd function saves max_scores too."""
    from torch._higher_order_ops.flex_attention import FlexAttentionAutogradOp

    fwd = inspect.getsource(FlexAttentionAutogradOp.forward)
    saved = fwd[fwd.index("save_values_for_backward("):]
    saved = [n.strip().rstrip(",") for n in saved[: saved.index("),\n")].splitlines()[3:]]
    assert saved[:6] == ["query", "key", "value", "out", "logsumexp", "max_scores"], saved
    bwd = inspect.getsource(FlexAttentionAutogradOp.backward)
    call = bwd[bwd.index("flex_attention_backward("):]
    args = [a.strip().rstrip(",") for a in call[: call.index(")\n")].splitlines()[1:]]
    assert args[:7] == ["query", "key", "value", "out", "logsumexp", "grad_out", "grad_logsumexp"], args
    assert "max_scores" not in args


def test_kernel_allocation_rule_from_installed_source():
    """inductor's Triton lowering: out like the query, logsumexp and max_scores fp32 (B, Hq, Sq); backward delta
    fp32, grad_query like the query, grad key/value of the key/value's (B, Hkv, Skv, D)."""
    from torch._inductor.kernel.flex import flex_attention as lowering

    fwd = inspect.getsource(lowering.flex_attention)
    assert "out_size = [B, Hq, seq_len_q, v_head_dim]" in fwd and "query.get_dtype()," in fwd
    assert fwd.count("dtype=torch.float32") == 2 and "logsumexp_shape = [B, Hq, seq_len_q]" in fwd
    bwd = inspect.getsource(lowering.flex_attention_backward)
    assert "delta = lowerings[prims.convert_element_type](delta, torch.float32)" in bwd
    assert "query_size = [Bq, Hq, seq_len_q, qk_head_dim]" in bwd
    assert "key_size = [Bq, Hkv, seq_len_kv, qk_head_dim]" in bwd and "value_size = [Bq, Hkv, seq_len_kv, v_head_dim]" in bwd
    assert "grad_key = broadcasted_grad_key" in bwd


def test_transformers_compiles_flex_and_skips_the_lse_on_cpu():
    from transformers.integrations import flex_attention as hf_flex

    assert "torch.compile(" in inspect.getsource(hf_flex.WrappedFlexAttention.__init__)
    assert 'return_lse = query.device.type != "cpu"' in inspect.getsource(hf_flex.flex_attention_forward)
    from transformers import masking_utils

    assert "_compile=True" in inspect.getsource(masking_utils.flex_attention_mask)


def _allocs(tracker, start):
    return sorted(rec.size_bytes for action, rec, _, _ in tracker.events[start:] if action == "alloc")


def test_emulated_kernel_allocations():
    B, S, H, Hk, D = 2, 300, 8, 2, 64
    tracker = StorageTracker()
    with adapter.new_fake_mode(), tracker:
        # transformers hands (B, H, S, D) views of the (B, S, H, D) projections
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(B, S, Hk, D, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(B, S, Hk, D, dtype=torch.bfloat16, requires_grad=True)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        start = len(tracker.events)
        mask = flex_attn._create_block_mask(lambda b, h, qi, ki: qi >= ki, B, None, S, S, device="cpu")
        assert mask.kv_indices.shape == (B, 1, 3, 3) and mask.kv_indices.dtype == torch.int32
        assert mask.q_indices.shape == (B, 1, 3, 3)
        mid = len(tracker.events)
        out = flex_attn._flex_attention(qt, kt, vt, block_mask=mask, enable_gqa=True)
        fwd = _allocs(tracker, mid)
        assert out.shape == (B, H, S, D) and out.stride() == qt.stride()  # the query's layout: transpose back is free
        back = len(tracker.events)
        out.sum().backward()
        bwd = _allocs(tracker, back)
    # the block mask: int32 block tensors of (B, 1, 3) and (B, 1, 3, 3) and the q-side ones from_kv_blocks derives
    mask_allocs = [rec.size_bytes for action, rec, _, _ in tracker.events[start:mid] if action == "alloc"]
    assert mask_allocs and max(mask_allocs) <= B * 3 * 3 * 4 * 2
    # out (bf16), logsumexp and max_scores (fp32, B x H x S)
    assert fwd == sorted([B * S * H * D * 2, B * H * S * 4, B * H * S * 4])
    # delta (fp32), grad_query, grad_key, grad_value (Hkv heads); plus out.sum()'s two scalar gradients
    kernel = [B * H * S * 4, B * S * H * D * 2, B * S * Hk * D * 2, B * S * Hk * D * 2]
    assert bwd == sorted(kernel + [2, 2])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-flex")
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096).save_pretrained(path)
    return str(path)


def test_flex_runs_transformers_path_and_keeps_no_s_by_s(tiny_llama):
    from memfit.estimator import estimate

    B, S, layers, heads = 2, 1024, 2, 4
    setup = TrainSetup(model=tiny_llama, task="causal-lm", precision="bf16", per_device_train_batch_size=B,
                       max_length=S)
    flex = estimate(setup.replace(attn_implementation="flex_attention"))
    eager = estimate(setup.replace(attn_implementation="eager"))
    assert flex.emulated_kernels == ["flex_attention"] and flex.attn_implementation == "flex_attention"
    # eager keeps at least the bf16 S x S probabilities of every layer for the backward; flex none
    assert eager.breakdown["activations"] - flex.breakdown["activations"] >= layers * B * heads * S * S * 2
    assert flex.peak_allocated_bytes < eager.peak_allocated_bytes


def test_flex_with_attention_dropout_is_a_clear_error(tiny_bert_dir):
    from memfit.sim.engine import simulate

    setup = TrainSetup(model=tiny_bert_dir, task="seq-cls", attn_implementation="flex_attention")
    with pytest.raises(MemfitError, match="`flex_attention` does not support attention dropout.*--attn sdpa"):
        simulate(setup, optimizer_steps=0)


def test_flex_fake_trace_equals_a_real_cpu_run():
    """The FakeTensor answers memfit gives (the padded batch is not all ones) give the trace a real CPU run of the
    same emulation gives, event for event (the kernels allocate, never compute)."""
    from helpers import like_fake, trace_key

    from memfit.sim.engine import simulate

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    setup = TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=2, max_length=48, precision="bf16",
                       attn_implementation="flex_attention")
    fake = simulate(setup, fake=True, splice=False)
    with like_fake():
        real = simulate(setup, fake=False, splice=False)
    assert trace_key(fake.trace) == trace_key(real.trace)
    assert fake.attn_kernels == real.attn_kernels == ["flex_attention"]


def test_a_model_without_flex_attention_is_a_clear_error():
    from memfit.sim.engine import simulate

    setup = TrainSetup(model="xlnet-large-cased", attn_implementation="flex_attention", max_length=64)
    with pytest.raises(MemfitError, match=r"\(XLNetForSequenceClassification\) has no flex attention.*--attn sdpa"):
        simulate(setup, optimizer_steps=0)
