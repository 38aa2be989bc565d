"""The `lora` remedy's adapters go where peft puts them by default, or on every linear layer (peft's `all-linear`)
for a model type peft has no default for: a LoRA variant the planner proposes always runs."""

from __future__ import annotations

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
    assert variant == {"lora_r": 16, "lora_target_modules": ["all-linear"]}
    report = estimate(whisper.replace(**variant), gpu="T4")  # peft takes it: the variant is simulated, not refused
    assert 0 < report.trainable_params < report.params
    assert any('target_modules="all-linear"' in line for line in lora.apply(variant, whisper)[2])
    # a vision-language model keeps memfit's own default (the language model's q_proj / v_proj)
    vlm = TrainSetup(model=tiny_config("llama"), task="causal-lm").replace(task="image-text-to-text")
    assert lora.variants(vlm, None) == [{"lora_r": 16}]
    # a user's own target modules are kept
    assert lora.variants(whisper.replace(lora_target_modules=["q_proj"]), None) == [{"lora_r": 16}]
