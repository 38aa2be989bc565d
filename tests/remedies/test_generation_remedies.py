"""The remedies of Seq2SeqTrainer's predict_with_generate evaluation (`fewer_beams`, `shorter_generation`, both
opt-in): where they apply, what each saves by the simulation against the closed form of the generation caches
(memfit.sim.seq2seq_generation), and the plan that uses them only where the evaluation sets the peak."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import transformers

from memfit.estimator import estimate
from memfit.peaks import peaks
from memfit.remedies import OPT_IN, REGISTRY, Applicability
from memfit.models.resolve import resolve
from memfit.sim.engine import simulate
from memfit.sim.seq2seq_generation import seq2seq_generation
from memfit.train_setup import TrainSetup

BEAMS, LENGTH, EVAL_BATCH = 4, 200, 16


def _config() -> transformers.WhisperConfig:
    # a 1 s Whisper (100 mel frames, 50 encoder positions) with 6 decoder layers: its caches set the eval peak
    return transformers.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=6, encoder_attention_heads=2,
                                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                      vocab_size=100, max_source_positions=50, max_target_positions=256,
                                      num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=1, architectures=["WhisperForConditionalGeneration"])


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper")
    _config().save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(folder)
    return resolve(TrainSetup(model=str(folder), audio_seconds=1, max_length=8, per_device_train_batch_size=1,
                              eval_strategy="steps", eval_samples=EVAL_BATCH, per_device_eval_batch_size=EVAL_BATCH,
                              predict_with_generate=True, generation_num_beams=BEAMS,
                              generation_max_length=LENGTH))


def _generation_bytes(**kw) -> int:
    """What `generate` holds at once (memfit.sim.seq2seq_generation), fp32 weights and no autocast."""
    args = {**dict(batch=EVAL_BATCH, beams=BEAMS, max_length=LENGTH, encoder_positions=50, cache_dtype_bytes=4,
                   encoder_output_dtype_bytes=4), **kw}
    g = seq2seq_generation(_config(), **args)
    return (g.encoder_output_bytes + g.kv_cache_bytes + g.generated_tokens_bytes + g.step_logits_bytes)


def _eval_peak(setup) -> int:
    return peaks(simulate(setup, train=False).trace, round_to=1).by_phase["eval"].bytes


def test_both_are_opt_in_and_apply_only_to_an_evaluation_that_generates(whisper):
    assert {"fewer_beams", "shorter_generation"} <= set(OPT_IN)
    for name in ("fewer_beams", "shorter_generation"):
        r = REGISTRY[name]
        assert r.check(whisper, None).applies
        for other in (whisper.replace(predict_with_generate=False), whisper.replace(eval_strategy="no")):
            assert not r.check(other, None).applies and r.variants(other, None) == []
    assert REGISTRY["fewer_beams"].variants(whisper, None) == [{"generation_num_beams": BEAMS // 2}]
    greedy = whisper.replace(generation_num_beams=1)
    assert "greedy" in REGISTRY["fewer_beams"].check(greedy, None).reason
    assert REGISTRY["shorter_generation"].variants(whisper, None) == [{"generation_max_length": LENGTH // 2}]
    assert not REGISTRY["shorter_generation"].check(whisper.replace(generation_max_length=40), None).applies
    # None: the model's length (its max_target_positions here), halved
    assert REGISTRY["shorter_generation"].variants(whisper.replace(generation_max_length=None), None) \
        == [{"generation_max_length": 128}]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "closed_form"), [("fewer_beams", {"beams": BEAMS // 2}),
                                                   ("shorter_generation", {"max_length": LENGTH // 2})])
def test_the_saving_is_the_closed_form_of_the_generation(whisper, name, closed_form):
    """The eval peak (while `generate` holds its caches) falls by what the closed form says the caches, the
    encoder output's copies, the sequences and the step's logits shrink by, to the byte."""
    [variant] = REGISTRY[name].variants(whisper, None)
    saved = _eval_peak(whisper) - _eval_peak(whisper.replace(**variant))
    assert saved == _generation_bytes() - _generation_bytes(**closed_form) > 0


def test_searched_only_where_the_evaluation_sets_the_peak(whisper):
    from memfit.planner.search import _generation_axis

    def axis(peak_phase, allow=("fewer_beams", "shorter_generation")):
        verdicts = {name: r.check(whisper, None) for name, r in REGISTRY.items()}
        out = _generation_axis(whisper, None, SimpleNamespace(peak_phase=peak_phase), verdicts, allow=allow,
                               exclude=())
        return out, verdicts

    out, verdicts = axis("eval")
    assert out == [{}, {"generation_num_beams": 2}, {"generation_max_length": 100},
                   {"generation_num_beams": 2, "generation_max_length": 100}]
    assert axis("eval", allow=())[0] == [{}]  # opt-in
    out, verdicts = axis("backward")
    assert out == [{}]
    for name in ("fewer_beams", "shorter_generation"):
        assert verdicts[name] == Applicability(False, "the evaluation's generate does not set the peak (the backward "
                                                      "does)")


@pytest.mark.slow
def test_a_plan_with_shorter_generation_saves_what_the_simulation_says(tmp_path):
    """A Whisper whose beam search caches (~100 MiB) set its peak at eval batch 1 (so no smaller eval batch
    helps), in bf16 (mixed precision, which halves the caches, is the setup's already), on a GPU between the two
    needs: without `--allow` nothing fits and the plan suggests it; with it, the plan is the shorter generation,
    and its figure is the full simulation's."""
    from memfit.gpus.catalog import CATALOG
    from memfit.planner.search import plan

    config = transformers.WhisperConfig(**{**_config().to_dict(), "d_model": 256, "decoder_layers": 16,
                                           "decoder_attention_heads": 4, "max_target_positions": 448})
    config.save_pretrained(tmp_path)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(tmp_path)
    setup = resolve(TrainSetup(model=str(tmp_path), audio_seconds=1, max_length=8, per_device_train_batch_size=1,
                               eval_strategy="steps", eval_samples=4, per_device_eval_batch_size=1,
                               eval_accumulation_steps=1, predict_with_generate=True, generation_num_beams=16,
                               generation_max_length=400, precision="bf16"))
    gpu = CATALOG["a100-80gb"]
    [variant] = REGISTRY["shorter_generation"].variants(setup, None)
    assert variant == {"generation_max_length": 200}
    before, after = estimate(setup, gpu=gpu), estimate(setup.replace(**variant), gpu=gpu)
    assert before.peak_phase == "eval"
    need = [r.required_bytes or r.peak_reserved_bytes for r in (before, after)]
    assert need[0] - need[1] > 32 * 2**20
    small = dataclasses.replace(gpu, total_bytes=int((need[1] + (need[0] - need[1]) // 4) / 0.95))
    # the remedies of the training step are left out: another optimizer fits too (the evaluation runs with the
    # optimizer state alive), and this test is about the evaluation's remedy
    others = ("optimizer", "gradient_checkpointing", "checkpoint_offload", "flash_attention")
    without = plan(setup, gpu=small, non_pytorch_bytes=0, workers=1, exclude=others)
    assert without.chosen is None and any("allow `shorter_generation`" in s for s in without.suggestions)
    result = plan(setup, gpu=small, non_pytorch_bytes=0, workers=1, allow=("shorter_generation",), exclude=others)
    assert result.chosen is not None, result.plans
    chosen = result.plans[result.chosen]
    assert chosen.setup_changes == variant and chosen.remedies == ["shorter_generation"] and chosen.verified
    assert chosen.changes == variant  # a Seq2SeqTrainingArguments field as it is
    assert chosen.peak_allocated_bytes == after.peak_allocated_bytes
    assert result.baseline.peak_allocated_bytes - chosen.peak_allocated_bytes \
        == before.peak_allocated_bytes - after.peak_allocated_bytes > 0
