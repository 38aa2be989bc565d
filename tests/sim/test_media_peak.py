"""memfit.sim.media_peak.parts_at_peak: what is live at the allocated peak, by part of an image or speech model."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import tiny_qwen2_5_vl_dir

from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.sim.media_peak import model_parts, parts_at_peak
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    folder = tiny_qwen2_5_vl_dir(tmp_path_factory.mktemp("qwen_vl"))
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig.from_pretrained(folder))
    return folder, model


def _param_bytes(model, prefix, but=None):
    """The bytes of the parameters and buffers under `prefix` (but `but`)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for n, t in named if n.startswith(prefix) and not (but and n.startswith(but)))


def test_a_vlms_parts_hold_their_own_parameters_and_add_up_to_the_peak(qwen_vl):
    folder, model = qwen_vl
    assert model_parts(model, "image-text-to-text") == [
        ("vision tower", "model.visual"), ("projector", "model.visual.merger"),
        ("language model", "model.language_model")]
    sim = simulate(TrainSetup(model=folder, image_size="100x80", max_length=8, per_device_train_batch_size=1,
                              eval_strategy="no"), splice=False)
    parts = {p["part"]: p for p in sim.media_inputs["parts_at_peak"]}
    assert list(parts) == ["vision tower", "projector", "language model", "other"]
    # the projector inside `visual` is the projector's: the tower holds the rest of its parameters
    assert parts["vision tower"]["weights_bytes"] == _param_bytes(model, "model.visual.", but="model.visual.merger.")
    assert parts["projector"]["weights_bytes"] == _param_bytes(model, "model.visual.merger.")
    # the language model's parameters and buffers; lm_head is outside every part
    assert parts["language model"]["weights_bytes"] == _param_bytes(model, "model.language_model.")
    assert parts["other"]["weights_bytes"] == _param_bytes(model, "lm_head.")
    # together: every weight live at the peak (`peaks` rounds each block; the parts count requested bytes)
    r = peaks(sim.trace, round_to=1)
    assert sum(p["weights_bytes"] for p in parts.values()) == r.overall.breakdown["weights"]


def test_the_forwards_activations_land_in_the_part_that_made_them(qwen_vl):
    folder, model = qwen_vl
    sim = simulate(TrainSetup(model=folder, image_size="100x80", max_length=8, per_device_train_batch_size=1,
                              eval_strategy="no"), splice=False)
    # at the end of the first forward everything the backward needs is live: cut the trace there
    end = max(i for i, e in enumerate(sim.trace) if e.phase == "forward" and e.category == "activations")
    parts = {p.part: p for p in parts_at_peak(sim.trace[: end + 1], model_parts(model, "image-text-to-text"))}
    assert parts["vision tower"].activations_bytes > 0 and parts["language model"].activations_bytes > 0
    assert parts["projector"].activations_bytes > 0


def test_whisper_and_a_text_model(tmp_path):
    config = transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                        vocab_size=100, max_source_positions=50, max_target_positions=32,
                                        num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=1)
    with torch.device("meta"):
        whisper = transformers.WhisperForConditionalGeneration(config)
        bert = transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    assert model_parts(whisper, "speech-seq2seq") == [("audio encoder", "model.encoder"),
                                                      ("decoder", "model.decoder")]
    assert model_parts(bert, "seq-cls") == []
    with torch.device("meta"):
        vit = transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
        ctc = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=32))
    assert model_parts(vit, "image-cls") == [("backbone", "vit"), ("head", "classifier")]
    assert model_parts(ctc, "ctc") == [("feature encoder", "wav2vec2.feature_extractor"),
                                       ("transformer", "wav2vec2.encoder")]
