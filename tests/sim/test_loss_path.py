"""The causal-LM loss path Hugging Face runs without Liger: transformers 5.24 `ForCausalLMLoss`
upcasts the logits to float32 (`logits = logits.float()`, loss/loss_utils.py) before `cross_entropy`, and
Trainer passes `num_items_in_batch` to a model whose forward takes loss kwargs (then `fixed_cross_entropy`
sums and divides, and `training_step` does not divide by the accumulation)."""

from __future__ import annotations

from transformers import LlamaConfig

from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup

S, V = 512, 32000


def _setup(**kw):
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=S, dtype="bfloat16")
    return TrainSetup(model=cfg, task="causal-lm", per_device_train_batch_size=1, max_length=S, precision="bf16", **kw)


def test_logits_are_upcast_to_fp32_and_log_softmax_is_fp32():
    sim = simulate(_setup(), optimizer_steps=1)
    fwd = [e.size_bytes for e in sim.trace if e.action == "alloc" and e.phase == "forward"]
    bwd = [e.size_bytes for e in sim.trace if e.action == "alloc" and e.phase == "backward"]
    assert fwd.count(S * V * 2) >= 1  # lm_head output, bf16 under autocast
    assert fwd.count(S * V * 4) >= 2  # logits.float() and log_softmax's fp32 output (saved for nll_loss)
    assert bwd.count(S * V * 4) >= 1 and bwd.count(S * V * 2) >= 1  # fp32 grad of the logits, then cast to bf16


def test_trainer_passes_num_items_in_batch_to_the_loss(monkeypatch):
    import transformers.loss.loss_utils as lu

    seen = []
    plain = lu.fixed_cross_entropy

    def spy(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
        seen.append(num_items_in_batch is not None)
        return plain(source, target, num_items_in_batch, ignore_index, **kwargs)

    monkeypatch.setattr(lu, "fixed_cross_entropy", spy)
    simulate(_setup(gradient_accumulation_steps=2), optimizer_steps=1)
    assert seen and all(seen)  # reduction="sum" / num_items_in_batch, as Trainer runs it
