"""The `lora` remedy's adapters go where peft puts them by default, or on every linear layer (peft's `all-linear`)
for a model type peft has no default for: a LoRA variant the planner proposes always runs."""

from __future__ import annotations

import pytest
import transformers

from helpers import tiny_config
from memfit.estimator import estimate
from memfit.models.resolve import resolve
from memfit.remedies import REGISTRY
from memfit.train_setup import TrainSetup


def _whisper(folder) -> TrainSetup:
    transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                               max_source_positions=50, max_target_positions=64, num_mel_bins=16,
                               decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                               architectures=["WhisperForConditionalGeneration"]).save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(folder)
    return resolve(TrainSetup(model=str(folder), audio_seconds=1, max_length=8, per_device_train_batch_size=1,
                              eval_strategy="no"))


def test_a_model_type_without_peft_defaults_gets_all_linear(tmp_path):
    lora = REGISTRY["lora"]
    llama = resolve(TrainSetup(model=tiny_config("llama"), task="causal-lm"))
    assert lora.variants(llama, None) == [{"lora_r": 16}]  # peft's default q_proj / v_proj
    whisper = _whisper(tmp_path)
    (variant,) = lora.variants(whisper, None)
    assert variant == {"lora_r": 16, "lora_target_modules": "all-linear"}  # a string: it keys the planner's fits
    assert whisper.replace(**variant).lora_target_modules == ["all-linear"]
    report = estimate(whisper.replace(**variant), gpu="T4")  # peft takes it: the variant is simulated, not refused
    assert 0 < report.trainable_params < report.params
    assert any('target_modules="all-linear"' in line for line in lora.apply(variant, whisper)[2])
    # a vision-language model keeps memfit's own default (the language model's q_proj / v_proj)
    vlm = TrainSetup(model=tiny_config("llama"), task="causal-lm").replace(task="image-text-to-text")
    assert lora.variants(vlm, None) == [{"lora_r": 16}]
    # a user's own target modules are kept
    assert lora.variants(whisper.replace(lora_target_modules=["q_proj"]), None) == [{"lora_r": 16}]


@pytest.mark.slow
def test_a_plan_with_lora_allowed_runs_for_a_model_peft_has_no_default_for():
    """XLNet (the seed case's model) is not in peft's mapping: the plan tries LoRA on all linear layers, and its
    fitted model keys the variant's values (a list there was an unhashable key: a traceback)."""
    from memfit.planner.search import plan

    setup = TrainSetup(model=tiny_config("xlnet"), task="seq-cls", per_device_train_batch_size=2, max_length=16,
                       eval_strategy="no")
    result = plan(setup, gpu="T4", allow=("lora",))
    assert any(c.setup_changes.get("lora_target_modules") == "all-linear" for c in result.searched)
