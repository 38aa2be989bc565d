"""Image and speech models: the step on FakeTensors allocates what the same step on real CPU tensors does,
event for event, with the inputs their own processors made (memfit.models.processors).

Each tiny model (two blocks, width 32) is saved with its processor settings to a directory, as a user's
fine-tuning checkpoint is, and simulated twice: `fake=False` runs the Trainer step on real zero-filled CPU tensors,
`fake=True` on FakeTensors (tests/sim/test_exactness.py explains the comparison and `like_fake`).
"""

from __future__ import annotations

import pytest
import transformers
from helpers import like_fake, real_and_fake, trace_key

from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup


def _vit():
    return (transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=32, patch_size=8, architectures=["ViTForImageClassification"]),
            transformers.ViTImageProcessor(size={"height": 32, "width": 32}))


def _dinov2():
    return (transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                      image_size=28, patch_size=14, architectures=["Dinov2ForImageClassification"]),
            transformers.BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}))


def _convnext():
    return (transformers.ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                                        architectures=["ConvNextForImageClassification"]),
            transformers.ConvNextImageProcessor(size={"shortest_edge": 32}))


def _swin():
    # two blocks per stage: the second is shifted (window 4 on an 8x8 patch grid), as Swin-T's are
    return (transformers.SwinConfig(embed_dim=32, depths=[2, 2], num_heads=[2, 2], window_size=4, image_size=32,
                                    patch_size=4, mlp_ratio=2.0, architectures=["SwinForImageClassification"]),
            transformers.ViTImageProcessor(size={"height": 32, "width": 32}))


def _whisper():
    # a 1 s window (chunk_length 1: 100 mel frames of 16 bins), 50 encoder positions
    return (transformers.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                       decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                       vocab_size=100, max_source_positions=50, max_target_positions=32,
                                       num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=1, architectures=["WhisperForConditionalGeneration"]),
            transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1))


MODELS = {"vit": _vit, "dinov2": _dinov2, "convnext": _convnext, "swin": _swin, "whisper": _whisper}
INPUT = {"vit": dict(image_size="64x48"), "dinov2": dict(image_size="40x30"), "convnext": dict(image_size="50x40"),
         "swin": dict(image_size="50x40"),
         "whisper": dict(audio_seconds=0.6, max_length=8)}

#: One case of each family in the default run; the longer ones (7-15 s on the shared 2-core machine) are slow.
_SLOW = [pytest.mark.slow]
CASES = [
    ("vit", dict(), []),
    ("vit", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
    ("vit", dict(lora_r=4, lora_target_modules=["q_proj", "v_proj"]), []),
    ("dinov2", dict(precision="fp16"), []),
    ("convnext", dict(), []),
    ("convnext", dict(optim="adamw_torch", gradient_accumulation_steps=2), _SLOW),
    ("swin", dict(), []),
    ("swin", dict(precision="bf16", gradient_checkpointing=True), _SLOW),
    ("whisper", dict(), []),
    ("whisper", dict(precision="bf16", gradient_checkpointing=True, eval_strategy="steps", eval_samples=4), _SLOW),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = {}
    for name, make in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        config, processor = make()
        config.save_pretrained(folder)
        processor.save_pretrained(folder)
        out[name] = str(folder)
    with like_fake():  # first-run effects (lazily built tables) out of the compared runs
        for name in ("vit", "whisper"):
            simulate(TrainSetup(model=out[name], per_device_train_batch_size=2, **INPUT[name]), fake=False,
                     splice=False)
    return out


@pytest.mark.parametrize("arch, kw", [
    pytest.param(a, kw, marks=marks, id=f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'fp32'}")
    for a, kw, marks in CASES])
def test_real_and_fake_traces_agree_exactly(arch, kw, model_dirs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    setup = TrainSetup(model=model_dirs[arch], per_device_train_batch_size=2, per_device_eval_batch_size=2,
                       **INPUT[arch], **kw)
    real, fake = real_and_fake(setup)
    assert peaks(real.trace, round_to=1) == peaks(fake.trace, round_to=1)
    assert (real.params, real.trainable_params) == (fake.params, fake.trainable_params)
    # the batch is the processor's output: the pixel_values / input_features tensor is an input of the trace
    media = fake.media_inputs
    name = "input_features" if arch == "whisper" else "pixel_values"
    per_example = 4  # float32
    for d in media["inputs"][name]:
        per_example *= d
    assert ("alloc", 2 * per_example, "inputs", "forward") in trace_key(fake.trace)
    assert ({ev.phase for ev in fake.trace} >= {"setup", "forward", "backward", "optimizer"})
    assert ("eval" in {ev.phase for ev in fake.trace}) == setup.does_eval


def test_whisper_encoder_positions_follow_its_convolutions(model_dirs):
    """50 encoder positions of the tiny model's 100 mel frames (its stride-2 conv2), from the model's own
    `_get_feat_extract_output_lengths`; the labels are `max_length` tokens, under its 32 decoder positions."""
    sim = simulate(TrainSetup(model=model_dirs["whisper"], per_device_train_batch_size=2, **INPUT["whisper"]),
                   splice=False)
    assert sim.media_inputs["inputs"] == {"input_features": [16, 100]}
    assert sim.media_inputs["encoder_positions"] == 50
    assert sim.media_inputs["samples"] == round(0.6 * 16000)


def test_swin_needs_layer_norm_backward_laid_out_as_cuda_does(model_dirs, monkeypatch):
    """Swin's classifier pools its final `layernorm` output through `transpose(1, 2)`, so that LayerNorm's
    backward gets a transposed gradient. torch's meta decomposition of `native_layer_norm_backward` keeps those
    strides and the next `view` in the backward copies the input gradient: one temporary the CPU and CUDA kernels
    (contiguous input gradient) never allocate. memfit.sim.layouts lays it out as they do; without that the fake
    trace gains a `ViewBackward0` temporary the real one does not have."""
    from memfit.sim import layouts

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    setup = TrainSetup(model=model_dirs["swin"], per_device_train_batch_size=2, **INPUT["swin"])
    with like_fake():
        real = simulate(setup, fake=False, splice=False)
    monkeypatch.setattr(layouts, "CONTIGUOUS_OUTPUTS", {})
    fake = simulate(setup, fake=True, splice=False)
    a, b = trace_key(real.trace), trace_key(fake.trace)
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert (fake.trace[first].module, fake.trace[first].phase) == ("ViewBackward0", "backward")
    assert real.trace[first].module != "ViewBackward0"
    assert len(b) > len(a)
