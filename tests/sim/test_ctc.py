"""CTC speech models (wav2vec2, HuBERT): the step on FakeTensors allocates what the same step on real CPU tensors
does, event for event, and the wrapper memfit puts around the model's forward (memfit.sim._ctc_adapter) allocates
what the unwrapped model allocates.

Each tiny model (two transformer layers, width 32, a three-layer convolution stack) is saved with its feature
extractor settings, as a fine-tuning checkpoint is. The real run's `ctc_loss` is memfit's emulation of CUDA's
(memfit.sim.kernels.ctc) on real tensors; the fidelity test runs PyTorch's own CPU `ctc_loss` through
transformers' own `ForCTCLoss` instead, with and without the wrapper.
"""

from __future__ import annotations

import contextlib

import pytest
import transformers
from helpers import like_fake, real_and_fake, trace_key

from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup


def _config(model_type: str, norm: str, **kw):
    cls = transformers.HubertConfig if model_type == "hubert" else transformers.Wav2Vec2Config
    arch = "HubertForCTC" if model_type == "hubert" else "Wav2Vec2ForCTC"
    layer = norm == "layer"
    return cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               conv_dim=[16, 16, 16], conv_kernel=[10, 3, 2], conv_stride=[5, 2, 2], num_feat_extract_layers=3,
               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=12, pad_token_id=0,
               feat_extract_norm=norm, do_stable_layer_norm=layer, conv_bias=layer, mask_time_length=2,
               architectures=[arch], **kw)


MODELS = {
    # wav2vec2-base: group norm, no attention mask, SpecAugment on the projection's dropout output
    "w2v-group": (_config("wav2vec2", "group", mask_time_prob=0.05, feat_proj_dropout=0.1, layerdrop=0.1), False),
    # wav2vec2-large-lv60: layer norm, the extractor's attention mask, SpecAugment on the projection's view
    "w2v-layer": (_config("wav2vec2", "layer", mask_time_prob=0.05, mask_feature_prob=0.1, mask_feature_length=4),
                  True),
    "hubert": (_config("hubert", "layer", mask_time_prob=0.05), True),
    # no SpecAugment and no LayerDrop: the unwrapped model's step is deterministic (the fidelity test)
    "w2v-plain": (_config("wav2vec2", "group", mask_time_prob=0.0, layerdrop=0.0), False),
}

_SLOW = [pytest.mark.slow]
CASES = [
    ("w2v-group", dict(), []),
    ("w2v-group", dict(freeze_feature_encoder=False), []),
    ("w2v-layer", dict(freeze_feature_encoder=False), []),
    ("w2v-layer", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("w2v-layer", dict(lora_r=4, lora_target_modules=["q_proj", "v_proj"]), _SLOW),
    ("hubert", dict(precision="fp16", gradient_accumulation_steps=2, freeze_feature_encoder=False), _SLOW),
]
INPUT = dict(audio_seconds=0.5, max_length=20, per_device_train_batch_size=2, per_device_eval_batch_size=2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = {}
    for name, (config, mask) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        config.save_pretrained(folder)
        transformers.Wav2Vec2FeatureExtractor(return_attention_mask=mask).save_pretrained(folder)
        out[name] = str(folder)
    with like_fake():  # first-run effects (lazily built tables) out of the compared runs
        simulate(TrainSetup(model=out["w2v-group"], **INPUT), fake=False, splice=False)
    return out


@pytest.mark.parametrize("name, kw", [
    pytest.param(n, kw, marks=marks, id=f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}")
    for n, kw, marks in CASES])
def test_real_and_fake_traces_agree_exactly(name, kw, model_dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    setup = TrainSetup(model=model_dirs[name], **INPUT, **kw)
    real, fake = real_and_fake(setup)
    assert peaks(real.trace, round_to=1) == peaks(fake.trace, round_to=1)
    assert (real.params, real.trainable_params) == (fake.params, fake.trainable_params)
    # the raw audio is an input of the trace: 8000 float32 samples an example
    assert ("alloc", 2 * 8000 * 4, "inputs", "forward") in trace_key(fake.trace)
    assert ("eval" in {ev.phase for ev in fake.trace}) == setup.does_eval


def test_ctc_buffers_are_cudas(model_dirs):
    """LossCTC.cu's log_alpha (B, T, 2 L + 1) float32 in the forward, kept for the backward, and log_beta of the
    same shape in the backward; T from the model's own conv lengths, L the transcript's characters."""
    sim = simulate(TrainSetup(model=model_dirs["w2v-group"], **INPUT), fake=True, splice=False)
    positions = sim.media_inputs["encoder_positions"]
    assert positions == 399  # 8000 samples through strides 5, 2, 2 and kernels 10, 3, 2
    assert sim.media_inputs["label_length"] == 20
    alphas = [e for e in sim.trace if e.action == "alloc" and e.shape == (2, positions, 41) and e.dtype == "float32"]
    assert [e.phase for e in alphas] == ["forward", "backward"] * 2  # two optimizer steps
    assert alphas[0].category == "activations"


@contextlib.contextmanager
def _with_transformers_loss():
    """memfit's wrapper around the forward with transformers' own ForCTCLoss and PyTorch's CPU ctc_loss."""
    from transformers.loss.loss_ctc import ForCTCLoss

    from memfit.sim import _ctc_adapter

    original = _ctc_adapter.ctc_patches

    def patches(models, **_):
        return original(models, loss=ForCTCLoss)

    _ctc_adapter.ctc_patches = patches
    try:
        yield
    finally:
        _ctc_adapter.ctc_patches = original


@contextlib.contextmanager
def _unwrapped():
    from memfit.sim import _ctc_adapter

    original = _ctc_adapter.ctc_patches
    _ctc_adapter.ctc_patches = lambda models, **_: contextlib.nullcontext()
    try:
        yield
    finally:
        _ctc_adapter.ctc_patches = original


@pytest.mark.parametrize("frozen", [True, False])
def test_the_wrapped_forward_allocates_what_the_model_does(frozen, model_dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    setup = TrainSetup(model=model_dirs["w2v-plain"], freeze_feature_encoder=frozen, **INPUT)
    with like_fake():
        with _with_transformers_loss():
            wrapped = simulate(setup, fake=False, splice=False)
        with _unwrapped():
            plain = simulate(setup, fake=False, splice=False)
    assert trace_key(wrapped.trace) == trace_key(plain.trace)


def test_freezing_the_feature_encoder_drops_its_gradients_and_adam_states(model_dirs):
    """Trainer's optimizer holds the parameters that require a gradient: frozen, the conv stack's parameters have
    no gradient (4 bytes each in fp32) and no AdamW state (8 bytes each, and a step per tensor)."""
    from memfit.models.build import build_meta_model

    trained = simulate(TrainSetup(model=model_dirs["w2v-group"], freeze_feature_encoder=False, **INPUT),
                       splice=False)
    frozen = simulate(TrainSetup(model=model_dirs["w2v-group"], **INPUT), splice=False)
    model = build_meta_model(TrainSetup(model=model_dirs["w2v-group"], **INPUT))
    params = list(model.wav2vec2.feature_extractor.parameters())
    n = sum(p.numel() for p in params)
    assert frozen.trainable_params == trained.trainable_params - n
    a = peaks(trained.trace, round_to=1).by_phase["optimizer"].breakdown
    b = peaks(frozen.trace, round_to=1).by_phase["optimizer"].breakdown
    assert a["gradients"] - b["gradients"] == 4 * n
    # exp_avg and exp_avg_sq, and the fused AdamW's float32 `step` of each parameter tensor
    assert a["optimizer_state"] - b["optimizer_state"] == 8 * n + 4 * len(params)
    assert any("feature encoder is frozen" in note for note in frozen.notes)


def test_a_trained_feature_encoder_is_named_when_it_holds_the_peak(model_dirs, monkeypatch):
    """The tiny model's 16-channel convolutions hold 15 % of its peak trained and 1 % frozen (bytes live at the
    allocated peak that the encoder's modules allocated); with the note's threshold at 10 %, only the trained
    one is named."""
    from memfit.sim import media_peak

    monkeypatch.setattr(media_peak, "NOTE_SHARE", 0.10)
    notes = {}
    for frozen in (False, True):
        sim = simulate(TrainSetup(model=model_dirs["w2v-group"], freeze_feature_encoder=frozen, **INPUT),
                       splice=False)
        held, total, phase = media_peak.feature_encoder_bytes_at_peak(sim.trace, "wav2vec2.feature_extractor")
        assert (held > 0.10 * total) == (not frozen), (frozen, held, total)
        notes[frozen] = [n for n in sim.notes if "convolutions over the raw audio" in n]
    assert len(notes[False]) == 1 and "`wav2vec2.feature_extractor`" in notes[False][0]
    assert notes[True] == []
