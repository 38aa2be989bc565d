"""A shorter `generation_max_length` in the evaluation's `generate` (opt-in `shorter_generation`, Seq2SeqTrainer
`predict_with_generate`): the length halved.

Seq2SeqTrainer.prediction_step (transformers trainer_seq2seq.py) generates up to `generation_max_length` tokens
(None: the model's generation config's, 448 for Whisper): the decoder's self-attention cache grows by one position
per token fed and the generated tokens are `[batch x beams, max_length]` int64 (memfit.sim.seq2seq_generation),
so both shrink with the length; the cross-attention cache (over the encoder positions) does not. It changes what
is evaluated (a transcript longer than the cap is cut), hence opt-in. The planner offers it only where the
evaluation's `generate` sets the run's peak (memfit.planner.search `_generation_axis`).
"""

from memfit.remedies.base import Applicability, Remedy, apply_fields

#: Not planned shorter: a few words of a transcript (Whisper's 30 s windows hold up to ~200 tokens of speech).
_SHORTEST_TOKENS = 32


def _length(setup) -> int:
    """The length `generate` runs to: the setup's, else the model's (memfit.sim.seq2seq_generation)."""
    from memfit.models.build import resolve_config
    from memfit.sim.seq2seq_generation import generation_max_length

    config = getattr(setup.model, "config", None) or resolve_config(setup.model).config
    return generation_max_length(config, setup.generation_max_length)


def _check(setup, gpu):
    if not (setup.predict_with_generate and setup.does_eval):
        return Applicability(False, "no evaluation with predict_with_generate")
    length = _length(setup)
    if length // 2 < _SHORTEST_TOKENS:
        return Applicability(False, f"generation_max_length {length} is already short")
    return Applicability(True, "the self-attention cache grows with every generated token")


def _variants(setup, gpu):
    if not _check(setup, gpu).applies:
        return []
    return [{"generation_max_length": _length(setup) // 2}]


REMEDY = Remedy(
    name="shorter_generation", title="shorter generation in evaluation", opt_in=True,
    saves="the evaluation's self-attention cache and generated tokens, per token not generated",
    costs="transcripts longer than the cap are cut: a different reported metric",
    check=_check, variants=_variants, apply=apply_fields, fields=("generation_max_length",),
)
