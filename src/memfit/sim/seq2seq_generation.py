"""Seq2SeqTrainer's `predict_with_generate` evaluation, in closed form from the model's config.

transformers trainer_seq2seq.py `Seq2SeqTrainer.prediction_step`, with `predict_with_generate=True`, calls
`model.generate(**inputs, max_length=generation_max_length, num_beams=generation_num_beams)` on each eval batch,
pads the generated tokens to `max_length` (`_pad_tensors_to_max_len`), then runs the plain forward for the loss
and returns the generated tokens (not the logits) as the predictions. While it generates, the device holds:

- the encoder output, `[batch, encoder positions, d_model]` (`_prepare_encoder_decoder_kwargs_for_generation`),
  and its copy expanded over the beams (`_expand_inputs_for_generation`: `repeat_interleave`) when beams > 1;
- the decoder's `EncoderDecoderCache` (cache_utils.py): a `DynamicCache` of self-attention keys and values,
  one `[batch x beams, heads, tokens, head_dim]` tensor each per decoder layer, grown by `torch.cat` to the
  tokens fed (`max_length - 1`: the last token is never fed back), and a second `DynamicCache` of cross-attention
  keys and values over the encoder positions, filled at the first step (`grpo_steps.kv_cache_bytes` is the same
  formula for a decoder-only model);
- the running sequences, `[batch x beams, max_length]` int64, and one step's logits: the model's output
  `[batch x beams, 1, vocab]` in the compute dtype and the processed fp32 copy (`_sample` / `_beam_search`:
  `outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)`), plus the beam scores' fp32 log-softmax with beams.

What this leaves out (each small against the caches at Whisper's sizes): the one layer's keys or values alive
twice while `torch.cat` grows it (1/(2 x layers) of the self-attention cache), the decoder's per-step
activations (one position), the first step's logits over the decoder prompt (Whisper's 1-4 forced tokens) and
the beam search's bookkeeping tensors. The encoder forward itself runs as in the plain evaluation forward,
which memfit simulates with the real code after the generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError

__all__ = ["Seq2SeqGeneration", "generation_max_length", "seq2seq_generation"]

#: Whisper's decoder prompt when generate is given no language or task: `<|startoftranscript|>` alone
#: (generation_whisper.py `_retrieve_init_tokens`); a language, a task and `<|notimestamps|>` add up to 3 more
#: tokens, that is 3 more cached positions (under 1 % of the default 448), not counted here.
WHISPER_PROMPT_TOKENS = 1

#: GenerationConfig's default `max_length` (transformers generation/configuration_utils.py).
GENERATION_CONFIG_MAX_LENGTH = 20


@dataclass(frozen=True)
class Seq2SeqGeneration:
    """The memory of one `generate` call of an encoder-decoder model on an eval batch."""

    sequences: int
    """batch x beams."""
    max_length: int
    """Length of the generated sequences, the decoder prompt included (for Whisper `generation_max_length` plus
    the prompt, capped at `max_target_positions`)."""
    self_attention_cache_bytes: int
    cross_attention_cache_bytes: int
    encoder_output_bytes: int
    """The encoder output, and its copy expanded over the beams when beams > 1."""
    generated_tokens_bytes: int
    """The running sequences (`[batch x beams, max_length]` int64)."""
    step_logits_bytes: int
    """One decode step's logits: the model's output and the fp32 copies."""

    @property
    def kv_cache_bytes(self) -> int:
        return self.self_attention_cache_bytes + self.cross_attention_cache_bytes

    def to_json(self) -> dict[str, int]:
        return {"sequences": self.sequences, "max_length": self.max_length,
                "self_attention_cache_bytes": self.self_attention_cache_bytes,
                "cross_attention_cache_bytes": self.cross_attention_cache_bytes,
                "encoder_output_bytes": self.encoder_output_bytes,
                "generated_tokens_bytes": self.generated_tokens_bytes, "step_logits_bytes": self.step_logits_bytes}


def generation_max_length(config: Any, setup_value: int | None) -> int:
    """Seq2SeqTrainer's max_length: `generation_max_length`, else the model's generation config's (which
    `GenerationConfig.from_model_config` takes from the config's `max_length`; Whisper's bundled configs say 448),
    else the decoder's `max_target_positions`, else GenerationConfig's default 20."""
    if setup_value is not None:
        return setup_value
    for name in ("max_length", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return GENERATION_CONFIG_MAX_LENGTH


def _decoder_shape(config: Any) -> tuple[int, int, int, int]:
    """(decoder layers, heads, head_dim, d_model) of a Whisper / BART-style or T5-style config."""
    layers = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None) \
        or getattr(config, "num_layers", None)
    heads = getattr(config, "decoder_attention_heads", None) or getattr(config, "num_heads", None)
    d_model = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    if not (layers and heads and d_model):
        raise MemfitError(f"`predict_with_generate`: the `{getattr(config, 'model_type', '?')}` config names no "
                          "decoder layers / heads / d_model memfit can size the KV cache from; drop "
                          "--predict-with-generate")
    head_dim = getattr(config, "d_kv", None) or d_model // heads
    return layers, heads, head_dim, d_model


def seq2seq_generation(config: Any, *, batch: int, beams: int, max_length: int, encoder_positions: int,
                       cache_dtype_bytes: int, encoder_output_dtype_bytes: int) -> Seq2SeqGeneration:
    """The sizes of one `generate` call (module docstring). `cache_dtype_bytes`: the k / v projections' output
    dtype (the autocast dtype under AMP, else the weights'); `encoder_output_dtype_bytes`: the encoder's last
    layer norm's (fp32 under autocast)."""
    layers, heads, head_dim, d_model = _decoder_shape(config)
    seqs = batch * beams
    total = max_length
    if getattr(config, "model_type", "") == "whisper":
        # WhisperGenerationMixin._set_max_new_tokens_and_length: max_length counts the new tokens past the
        # decoder prompt (here its one decoder_start_token_id), capped at max_target_positions
        total = min(max_length + WHISPER_PROMPT_TOKENS, getattr(config, "max_target_positions", total + 1))
    fed = max(total - 1, 1)
    per_token = 2 * layers * heads * head_dim * seqs * cache_dtype_bytes
    encoder = batch * encoder_positions * d_model * encoder_output_dtype_bytes * (1 + (beams > 1))
    vocab = config.vocab_size
    logits = seqs * vocab * (cache_dtype_bytes + 4 + 4 * (beams > 1))
    return Seq2SeqGeneration(sequences=seqs, max_length=total, self_attention_cache_bytes=per_token * fed,
                             cross_attention_cache_bytes=per_token * encoder_positions, encoder_output_bytes=encoder,
                             generated_tokens_bytes=seqs * total * 8, step_logits_bytes=logits)
