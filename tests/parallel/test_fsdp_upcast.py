"""FSDP under mixed precision keeps fp32 master weights: accelerate upcasts the trainable parameters of a model
loaded in bf16 (FSDP1: each unit's FlatParameter in `Accelerator.prepare_model`; FSDP2: each parameter in
`fsdp2_prepare_model`), so each rank holds fp32 shards, fp32 gradients and fp32 AdamW states, and the units
compute in the mixed-precision param dtype."""

import inspect

import pytest

HIDDEN, INTER, LAYERS, VOCAB = 64, 128, 2, 256


def test_installed_accelerate_upcasts_under_mixed_precision():
    """The rule memfit copies, read from the installed accelerate: a change there fails here."""
    from accelerate import Accelerator
    from accelerate.utils import fsdp_utils

    fsdp1 = inspect.getsource(Accelerator.prepare_model)
    assert 'if self.mixed_precision != "no"' in fsdp1
    assert "param.data = param.data.to(torch.float32)" in fsdp1
    assert "module._handle._orig_param_dtype = torch.float32" in fsdp1
    fsdp2 = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert 'accelerator.mixed_precision != "no"' in fsdp2
    assert "param.requires_grad and param.dtype != torch.float32" in fsdp2
    assert "param.data = param.data.to(torch.float32)" in fsdp2


def _tiny_llama(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    # embed + lm_head, per layer q/o (H*H), k/v (H*H/2), gate/up/down (H*I), two norms (H), the final norm (H)
    params = 2 * VOCAB * HIDDEN + LAYERS * (2 * HIDDEN**2 + HIDDEN**2 + 3 * HIDDEN * INTER + 2 * HIDDEN) + HIDDEN
    return str(tmp_path), params


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_rank_holds_fp32_masters_under_bf16_mixed_precision(tmp_path, version):
    """A model loaded in bf16, two ranks: under bf16 mixed precision the optimizer step sees 4-byte shards, their
    4-byte gradients and two 4-byte AdamW states per element (8 B: 2 B each in bf16); without mixed precision
    the bf16 load is kept (2 B each). Every dimension is even, so a rank's shard is half the parameters."""
    from memfit import TrainSetup, estimate
    from memfit.parallel.setup import ParallelSetup

    model, params = _tiny_llama(tmp_path)
    shard = params // 2
    slack = 512 * 2 * 32  # the allocator's 512-byte rounding of each state tensor (at most 32 of them here)
    par = ParallelSetup(world_size=2, strategy="fsdp", fsdp_version=version)
    got = {}
    for precision in ("bf16", "fp32"):
        setup = TrainSetup(model=model, task="causal-lm", precision=precision, weights_dtype="bf16",
                           per_device_train_batch_size=2, max_length=16, optim="adamw_torch", eval_strategy="no")
        got[precision] = estimate(setup, parallel=par)
    for precision, element_bytes in (("bf16", 4), ("fp32", 2)):
        at_step = got[precision].phase_breakdowns["optimizer"]
        assert 0 <= at_step["gradients"] - element_bytes * shard <= slack, (precision, at_step)
        assert 0 <= at_step["optimizer_state"] - 2 * element_bytes * shard <= slack, (precision, at_step)
        assert at_step["weights"] >= element_bytes * shard
    assert any("fp32 master weights" in n for n in got["bf16"].notes)
    assert not any("fp32 master weights" in n for n in got["fp32"].notes)
