"""A setup that cannot start is planned from the change that runs: a Whisper checkpoint whose config says float16
(whisper-large-v3's), typed with the default fp32 precision for a T4, stops at its first convolution (float32
input_features meet float16 weights without autocast). `memfit plan` and `memfit diagnose --model` start from fp32
weights with fp16 mixed precision (no bf16 on a T4), say so, and plan from there."""

from __future__ import annotations

import pytest
import transformers

from memfit.diagnosis import diagnose
from memfit.estimator import estimate
from memfit.gpus.catalog import resolve_gpu
from memfit.planner.search import plan
from memfit.train_setup import TrainSetup

FIX = {"weights_dtype": "fp32", "precision": "fp16"}
T4_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
          "14.75 GiB of which 3.06 MiB is free. Including non-PyTorch memory, this process has 14.74 GiB memory in "
          "use. Of the allocated memory 14.50 GiB is allocated by PyTorch, and 110.00 MiB is reserved by PyTorch "
          "but unallocated.")


@pytest.fixture(scope="module")
def fp16_whisper(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper_fp16")
    config = transformers.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                        vocab_size=100, max_source_positions=50, max_target_positions=32,
                                        num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=1, architectures=["WhisperForConditionalGeneration"])
    config.dtype = "float16"  # as openai/whisper-large-v3's config.json
    config.save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(folder)
    return TrainSetup(model=str(folder), audio_seconds=1, max_length=8)


def _check_started_from_the_fix(result, setup):
    start = result.started_from
    assert start["changes"] == FIX and start["flags"] == "--weights-dtype fp32 --precision fp16"
    assert "float16" in start["cause"] and "first convolution fails" in start["cause"]
    assert "compute capability 8.0" in start["why"]  # why fp16, not bf16, on a T4
    assert not result.fits_as_is  # as given it does not run
    # the baseline is the fixed setup, its full estimate
    assert result.baseline.setup_changes == FIX
    fixed = estimate(setup.replace(**FIX), gpu=resolve_gpu("T4"))
    assert result.baseline.peak_allocated_bytes == fixed.peak_allocated_bytes
    for p in [result.baseline, *result.plans]:  # the fix comes first in every plan
        assert list(p.setup_changes)[:2] == list(FIX) and p.remedies[0] == "mixed_precision"
        assert p.changes["fp16"] is True and "dtype=torch.float32" in p.code[0]
    assert result.not_applicable["mixed_precision"].startswith("applied first")


@pytest.mark.slow
def test_plan_as_typed_starts_from_the_dtype_fix(fp16_whisper):
    result = plan(fp16_whisper, gpu="T4", workers=1)
    _check_started_from_the_fix(result, fp16_whisper)
    assert result.chosen is not None  # this tiny model fits once it runs
    assert result.plans[result.chosen].fits and result.plans[result.chosen].setup_changes.items() >= FIX.items()


@pytest.mark.slow
def test_diagnose_with_the_setup_plans_from_the_same_fix(fp16_whisper):
    d = diagnose(T4_OOM, setup=fp16_whisper)
    assert d.plan.gpu["name"] == "T4"
    _check_started_from_the_fix(d.plan, fp16_whisper)


@pytest.mark.slow
def test_a_setup_that_runs_is_planned_as_given(fp16_whisper):
    """The fix is only for a run that cannot start: typed with the fix, the plan starts from the setup itself."""
    result = plan(fp16_whisper.replace(**FIX), gpu="T4", workers=1)
    assert result.started_from is None and result.baseline.setup_changes == {}
