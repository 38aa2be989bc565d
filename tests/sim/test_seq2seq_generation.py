"""Seq2SeqTrainer's predict_with_generate evaluation: the closed-form cache against transformers' real
`generate` on CPU, and the eval peak of a simulated tiny Whisper growing with generation_max_length."""

import pytest
import torch
import transformers

from memfit.errors import MemfitError
from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.sim.seq2seq_generation import generation_max_length, seq2seq_generation
from memfit.train_setup import TrainSetup


def _config(decoder_layers=2):
    # the tiny Whisper of tests/sim/test_media_exactness.py: 1 s window of 100 mel frames, 50 encoder positions
    return transformers.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=decoder_layers, encoder_attention_heads=2,
                                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                      vocab_size=100, max_source_positions=50, max_target_positions=32,
                                      num_mel_bins=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=1, architectures=["WhisperForConditionalGeneration"])


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    # 6 decoder layers: the caches, not the encoder's forward, set the eval peak of this tiny model
    folder = tmp_path_factory.mktemp("whisper")
    _config(6).save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("beams", [1, 2])
def test_cache_equals_real_generate(beams):
    """The self- and cross-attention caches of a real CPU `generate` (transformers' EncoderDecoderCache) at its
    last decoder step have the bytes of the closed form, for a fixed number of new tokens (min_length)."""
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(_config()).eval()
    batch, length = 3, 12
    seen = []

    def nbytes(c):
        return sum(t.nbytes for layer in c.layers for t in (layer.keys, layer.values))

    def after_decoder(module, args, kwargs, output):  # the cache as the step left it (beam search reorders it later)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((nbytes(cache.self_attention_cache), nbytes(cache.cross_attention_cache)))

    model.model.decoder.register_forward_hook(after_decoder, with_kwargs=True)
    with torch.no_grad():
        out = model.generate(input_features=torch.randn(batch, 16, 100), max_length=length, min_length=length,
                             num_beams=beams, do_sample=False, return_dict_in_generate=True)
    gen = seq2seq_generation(model.config, batch=batch, beams=beams, max_length=length, encoder_positions=50,
                             cache_dtype_bytes=4, encoder_output_dtype_bytes=4)
    assert out.sequences.shape[-1] == gen.max_length == length + 1  # Whisper: max_length past its start token
    assert max(seen) == (gen.self_attention_cache_bytes, gen.cross_attention_cache_bytes)


def test_eval_peak_grows_with_generation_max_length(whisper_dir):
    def eval_peak(**kw):
        setup = TrainSetup(model=whisper_dir, audio_seconds=0.6, max_length=8, eval_strategy="steps", eval_samples=4,
                           per_device_eval_batch_size=4, predict_with_generate=True, **kw)
        return peaks(simulate(setup, train=False, splice=False).trace, round_to=1).by_phase["eval"].bytes

    # from 24 tokens on, generation (not the loss forward) sets the eval peak of this model
    short, long_ = eval_peak(generation_max_length=24), eval_peak(generation_max_length=32)
    grown = seq2seq_generation(_config(6), batch=4, beams=1, max_length=32, encoder_positions=50, cache_dtype_bytes=4,
                               encoder_output_dtype_bytes=4).self_attention_cache_bytes \
        - seq2seq_generation(_config(6), batch=4, beams=1, max_length=24, encoder_positions=50, cache_dtype_bytes=4,
                             encoder_output_dtype_bytes=4).self_attention_cache_bytes
    assert long_ - short >= grown > 0


def test_default_max_length_is_the_models():
    """None: the config's max_length (whisper-small's bundled config: 448, as its generation_config.json), else
    its max_target_positions."""
    import json
    from pathlib import Path

    import memfit.models

    path = Path(memfit.models.__file__).parent / "configs" / "openai--whisper-small.json"
    small = transformers.WhisperConfig.from_dict(json.loads(path.read_text()))
    assert generation_max_length(small, None) == 448
    assert generation_max_length(_config(), None) == 32
    assert generation_max_length(_config(), 225) == 225


def test_predict_with_generate_only_for_seq2seq():
    with pytest.raises(MemfitError, match="drop --predict-with-generate"):
        TrainSetup(model="gpt2", task="causal-lm", predict_with_generate=True)


def test_read_from_seq2seq_training_arguments(tmp_path):
    args = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True,
                                                 generation_max_length=225, generation_num_beams=2)
    setup = TrainSetup.from_training_args(args, model="openai/whisper-small")
    assert (setup.predict_with_generate, setup.generation_max_length, setup.generation_num_beams) == (True, 225, 2)
