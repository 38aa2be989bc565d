"""Shorter completions (opt-in `shorter_completions`, GRPO): `max_completion_length` halved.

The KV cache, the scoring log-probs and every training micro-step shrink with the completion; completions
that would run longer are cut (TRL masks them with `mask_truncated_completions`, or scores them truncated).
"""

from memfit.remedies.base import Applicability, Remedy, apply_fields
from memfit.train_setup import GENERATING_TRAINERS

_SHORTEST = 64  #: completions are not planned shorter than this (tokens)


def _check(setup, gpu):
    if setup.trainer not in GENERATING_TRAINERS:
        return Applicability(False, "GRPO and RLOO only")
    if setup.max_completion_length // 2 < _SHORTEST:
        return Applicability(False, f"completions are already short ({setup.max_completion_length} tokens)")
    return Applicability(True, "KV cache, log-probs and activations grow with the completion")


def _variants(setup, gpu):
    return [{"max_completion_length": setup.max_completion_length // 2}] if _check(setup, gpu).applies else []


REMEDY = Remedy(
    name="shorter_completions", title="shorter completions", opt_in=True,
    saves="KV cache, log-probs and activations of the completions", costs="longer completions are cut",
    check=_check, variants=_variants, apply=apply_fields, fields=("max_completion_length",), trainers=GENERATING_TRAINERS,
)
