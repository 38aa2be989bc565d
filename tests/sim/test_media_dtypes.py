"""16-bit weights meeting a processor's float32 inputs without autocast: the change that runs, per GPU, and the
estimate's one-line error naming its flags (a tiny Whisper whose config says float16, as whisper-large-v3's)."""

from __future__ import annotations

import pytest
import torch
import transformers

from memfit.errors import MemfitError
from memfit.estimator import estimate
from memfit.models.processors import MediaInputs
from memfit.models.resolve import resolve
from memfit.sim.media_dtypes import dtype_fix, setup_dtype_fix
from memfit.train_setup import TrainSetup

T4, A100 = (7, 5), (8, 0)
FEATURES = MediaInputs({"input_features": ((16, 100), torch.float32)}, {})


def tiny_whisper(folder, dtype: str | None = "float16") -> str:
    """A 1 s Whisper (100 mel frames, 50 encoder positions) saved with `dtype` as its config's."""
    config = transformers.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                        vocab_size=100, max_source_positions=50, max_target_positions=32,
                                        num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=1, architectures=["WhisperForConditionalGeneration"])
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(("weights", "cc", "changes"), [
    (torch.float16, T4, {"weights_dtype": "fp32", "precision": "fp16"}),  # no bf16 on a T4; fp16 weights: GradScaler
    (torch.float16, A100, {"weights_dtype": "fp32", "precision": "bf16"}),
    (torch.bfloat16, A100, {"precision": "bf16"}),  # bf16 autocast casts the inputs, no GradScaler
    (torch.bfloat16, T4, {"weights_dtype": "fp32", "precision": "fp16"}),
])
def test_the_change_depends_on_the_weights_and_the_gpu(weights, cc, changes):
    fix = dtype_fix(weights, FEATURES, "fp32", cc)
    assert fix.changes == changes and fix.input_name == "input_features"
    assert fix.flags == " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())
    assert "first convolution fails" in fix.cause


def test_no_fix_where_the_run_starts():
    assert dtype_fix(torch.float32, FEATURES, "fp32", T4) is None  # fp32 weights
    assert dtype_fix(torch.float16, FEATURES, "fp16", T4) is None  # autocast casts the inputs
    assert dtype_fix(torch.float16, None, "fp32", T4) is None  # a text model
    ints = MediaInputs({"input_ids": ((8,), torch.long)}, {})
    assert dtype_fix(torch.float16, ints, "fp32", T4) is None


@pytest.mark.slow
def test_estimate_names_the_exact_flags(tmp_path):
    model = tiny_whisper(tmp_path)
    setup = TrainSetup(model=model, audio_seconds=1, max_length=8, compute_capability=T4)
    with pytest.raises(MemfitError, match=r"^the weights are float16 but precision is fp32.*use `--weights-dtype fp32 "
                                          r"--precision fp16` .*compute capability 8\.0 and this GPU has 7\.5") as err:
        estimate(setup)
    assert "\n" not in str(err.value)
    fix = setup_dtype_fix(resolve(setup), T4)  # what the planner starts from: the same change
    assert fix is not None and fix.changes == {"weights_dtype": "fp32", "precision": "fp16"}
    report = estimate(setup.replace(**fix.changes))  # and it runs
    assert report.peak_allocated_bytes > 0
    assert setup_dtype_fix(resolve(setup.replace(**fix.changes)), T4) is None


def test_fp32_checkpoint_has_no_fix(tmp_path):
    setup = resolve(TrainSetup(model=tiny_whisper(tmp_path, dtype=None), audio_seconds=1, max_length=8))
    assert setup_dtype_fix(setup, T4) is None
