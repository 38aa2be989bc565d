"""`--attn flex_attention` (issue 12 item 2) is refused, not guessed: why, pinned to the installed torch and
transformers so that an upgrade that changes a reason fails here (and flex attention can then be simulated or
emulated).

1. The real code path cannot run here: torch 2.13's flex attention refuses a backward on the CPU
   (torch/_higher_order_ops/flex_attention.py, "FlexAttention does not support backward on CPU"), and
   transformers 5.24 runs it torch.compile'd (integrations/flex_attention.py `WrappedFlexAttention`) with a
   compiled block mask (`make_flex_block_causal_mask`: `create_block_mask(..., _compile=True)`); on CUDA that is
   inductor's Triton template, whose saved tensors the AOT partitioner chooses, not a fixed allocation list.
2. What the eager autograd function keeps for the backward (`FlexAttentionAutogradOp.forward`): q, k, v, out,
   the float32 logsumexp, the float32 row max and the block mask's tensors; the refusal message says so.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from memfit.errors import MemfitError


def test_torch_refuses_flex_backward_on_cpu():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    with FakeTensorMode():
        q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 2, 256, 256, device="cpu")
        # the block mask's tensors: int32 block counts (B, H, S/128) and indices (B, H, S/128, S/128)
        assert mask.kv_indices.shape == (1, 2, 2, 2) and mask.kv_indices.dtype == torch.int32
        with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
            flex_attention(q, k, v, block_mask=mask)


def test_flex_autograd_saves_out_logsumexp_and_max():
    from torch._higher_order_ops.flex_attention import FlexAttentionAutogradOp

    src = inspect.getsource(FlexAttentionAutogradOp.forward)
    saved = src[src.index("save_values_for_backward("):]
    saved = saved[: saved.index(")\n")]
    names = [n.strip().rstrip(",") for n in saved.splitlines()[1:] if n.strip() not in ("ctx,", "(", "")]
    assert names[:6] == ["query", "key", "value", "out", "logsumexp", "max_scores"], names
    assert "*block_mask[:-1]" in names


def test_transformers_compiles_flex_attention():
    from transformers.integrations import flex_attention as hf_flex

    assert "torch.compile(" in inspect.getsource(hf_flex.WrappedFlexAttention.__init__)
    assert "_compile=True" in inspect.getsource(hf_flex.make_flex_block_causal_mask)


def test_memfit_refuses_flex_attention_with_the_reason(tiny_bert_dir):
    from memfit.sim.engine import simulate
    from memfit.train_setup import TrainSetup

    setup = TrainSetup(model=tiny_bert_dir, task="seq-cls", attn_implementation="flex_attention")
    with pytest.raises(MemfitError, match=r"`flex_attention` is not modelled yet \(torch runs its backward only on a GPU"):
        simulate(setup, optimizer_steps=0)
