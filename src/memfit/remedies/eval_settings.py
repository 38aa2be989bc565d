"""Evaluation settings: eval batch size, moving predictions off the GPU, reducing logits.

Trainer evaluates with `per_device_eval_batch_size` (default 8, often larger than the
training micro-batch) and keeps every prediction on the GPU until `eval_accumulation_steps`
(default: the end of evaluation). For LM heads the logits are batch x length x vocab;
`preprocess_logits_for_metrics` (e.g. argmax) shrinks them before they pile up.
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if not setup.does_eval:
        return Applicability(False, "no evaluation (eval_strategy='no')")
    return Applicability(True, "evaluation has its own peak")


def _variants(setup, gpu):
    out = []
    for eb in sorted({1, setup.per_device_train_batch_size, max(1, setup.per_device_eval_batch_size // 2)}):
        if eb < setup.per_device_eval_batch_size:
            out.append({"per_device_eval_batch_size": eb})
    if setup.eval_accumulation_steps is None:
        out.append({"eval_accumulation_steps": 1})
    return out


def _apply(changes, setup, **_):
    code = []
    if "eval_accumulation_steps" in changes and setup.task in ("causal-lm", "mlm", "seq2seq-lm", "token-cls"):
        code.append("Trainer(..., preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))")
    return dict(changes), {}, code


def _apply_to_trainer(trainer, changes, log, adapter):
    for key, value in changes.items():
        old = getattr(trainer.args, key)
        setattr(trainer.args, key, value)
        log.append(f"{key} {getattr(old, 'value', old)} -> {value}")
    return dict(changes)


REMEDY = Remedy(
    name="eval_settings", title="evaluation settings",
    saves="evaluation activations and accumulated predictions", costs="evaluation a little slower",
    check=_check, variants=_variants, apply=_apply,
    fields=("per_device_eval_batch_size", "eval_accumulation_steps"), apply_to_trainer=_apply_to_trainer,
    advice=("eval_settings.batch_size", "eval_settings.accumulation_steps", "eval_settings.preprocess_logits"),
)
