"""Fewer beams in the evaluation's `generate` (opt-in `fewer_beams`, Seq2SeqTrainer `predict_with_generate`):
`generation_num_beams` halved, down to greedy decoding (1).

Seq2SeqTrainer.prediction_step (transformers trainer_seq2seq.py) calls `model.generate(num_beams=
generation_num_beams)` on each eval batch: the decoder's self- and cross-attention caches, the step's logits and
the encoder output's copy (`_expand_inputs_for_generation`) are held for batch x beams sequences
(memfit.sim.seq2seq_generation sizes them in closed form), so they shrink with the beams. It changes what is
evaluated (the transcripts beam search would find, hence the WER reported), hence opt-in. The planner offers it
only where the evaluation's `generate` sets the run's peak (memfit.planner.search `_generation_axis`).
"""

from memfit.remedies.base import Applicability, Remedy, apply_fields


def _check(setup, gpu):
    if not (setup.predict_with_generate and setup.does_eval):
        return Applicability(False, "no evaluation with predict_with_generate")
    if (setup.generation_num_beams or 1) <= 1:
        return Applicability(False, "already greedy (generation_num_beams 1)")
    return Applicability(True, "the generation caches are held per beam")


def _variants(setup, gpu):
    if not _check(setup, gpu).applies:
        return []
    return [{"generation_num_beams": setup.generation_num_beams // 2}]


REMEDY = Remedy(
    name="fewer_beams", title="fewer beams in evaluation", opt_in=True,
    saves="the evaluation's generation caches (self- and cross-attention KV, logits) per beam",
    costs="different evaluation predictions (beam search finds other transcripts), a different reported metric",
    check=_check, variants=_variants, apply=apply_fields, fields=("generation_num_beams",),
)
