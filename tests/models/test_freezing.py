"""memfit.models.freezing in bytes: a frozen part's parameters get no gradient and no optimizer state, so the
simulated step's gradients and Adam state shrink by exactly that part's parameters (4 and 8 bytes each in fp32),
while its weights stay."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import tiny_qwen2_5_vl_dir

from memfit.errors import MemfitError
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup


def _bytes(trace, category):
    """The most bytes of `category` alive at once in the simulation (the gradients before zero_grad, the
    optimizer state after its first step)."""
    live, most = {}, 0
    for ev in trace:
        if ev.category != category:
            continue
        if ev.action == "alloc":
            live[ev.id] = ev.size_bytes
            most = max(most, sum(live.values()))
        elif ev.action == "free":
            live.pop(ev.id, None)
    return most


def _state(setup):
    sim = simulate(setup, splice=False)
    return sim, _bytes(sim.trace, "gradients"), _bytes(sim.trace, "optimizer_state")


def _count(model, prefix):
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))


def _save(folder, config, processor):
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    config = transformers.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                        vocab_size=100, max_source_positions=50, max_target_positions=32,
                                        num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=1, architectures=["WhisperForConditionalGeneration"])
    return _save(tmp_path_factory.mktemp("whisper"), config,
                 transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1))


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, architectures=["ViTForImageClassification"])
    return _save(tmp_path_factory.mktemp("vit"), config, transformers.ViTImageProcessor(size={"height": 32,
                                                                                              "width": 32}))


def _states_drop_by(setup, frozen, part_params):
    _, grads, adam = _state(setup)
    sim, grads_f, adam_f = _state(setup.replace(**{frozen: True}))
    assert grads - grads_f == 4 * part_params  # fp32 gradients
    assert adam - adam_f == 8 * part_params  # Adam's exp_avg and exp_avg_sq (fp32; its step tensors stay per param)
    return sim


def test_freeze_encoder_drops_whispers_encoder_gradients_and_adam_state(whisper_dir):
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig.from_pretrained(whisper_dir))
    # the encoder's own parameters but its positions, which Whisper never trains (`embed_positions` requires_grad off)
    encoder = sum(p.numel() for p in model.model.encoder.parameters() if p.requires_grad)
    setup = TrainSetup(model=whisper_dir, audio_seconds=0.6, max_length=8, per_device_train_batch_size=2,
                       eval_strategy="no", optim="adamw_torch")
    sim = _states_drop_by(setup, "freeze_encoder", encoder)
    assert sim.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad) - encoder


def test_freeze_vision_tower_of_an_image_classifier_is_a_linear_probe(vit_dir):
    model = transformers.ViTForImageClassification(transformers.ViTConfig.from_pretrained(vit_dir))
    backbone = _count(model, "vit.")
    setup = TrainSetup(model=vit_dir, image_size="64x48", per_device_train_batch_size=2, eval_strategy="no",
                       optim="adamw_torch")
    sim = _states_drop_by(setup, "freeze_vision_tower", backbone)
    head = sum(p.numel() for p in model.classifier.parameters())
    assert sim.trainable_params == head


def test_freeze_vision_tower_and_projector_of_a_vision_language_model(tmp_path):
    folder = tiny_qwen2_5_vl_dir(tmp_path / "qwen")
    config = transformers.Qwen2_5_VLConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    tower = _count(model, "model.visual.")
    merger = _count(model, "model.visual.merger.")
    assert 0 < merger < tower
    setup = TrainSetup(model=folder, image_size="100x80", max_length=8, per_device_train_batch_size=1,
                       eval_strategy="no", optim="adamw_torch")
    _states_drop_by(setup, "freeze_vision_tower", tower)  # the tower holds its merger
    _states_drop_by(setup, "freeze_projector", merger)


def test_a_freeze_flag_for_another_kind_of_model_is_one_line(vit_dir):
    from memfit.models.resolve import resolve

    with pytest.raises(MemfitError, match="--freeze-encoder.* is set but the run is `image-cls`"):
        resolve(TrainSetup(model=vit_dir, freeze_encoder=True))
