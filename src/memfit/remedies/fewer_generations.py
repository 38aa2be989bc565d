"""Fewer completions per prompt (opt-in `fewer_generations`, GRPO): `num_generations` halved, for the same prompts.

The generation batch and the completions per optimizer step shrink with it (same prompts per step), so do the KV
cache, the scoring buffers and the training micro-steps. It changes GRPO's objective: the advantages are
normalised over smaller groups (TRL grpo_trainer.py: the rewards' mean and std per group of `num_generations`).
"""

from memfit.remedies.base import Applicability, Remedy, apply_fields
from memfit.train_setup import GENERATING_TRAINERS


def _check(setup, gpu):
    if setup.trainer not in GENERATING_TRAINERS:
        return Applicability(False, "GRPO and RLOO only")
    if setup.num_generations // 2 < 2 or setup.num_generations % 2:
        return Applicability(False, f"num_generations `{setup.num_generations}` cannot be halved to 2 or more")
    return Applicability(True, "half the completions per prompt: half the generation batch")


def _variants(setup, gpu):
    return [{"num_generations": setup.num_generations // 2}] if _check(setup, gpu).applies else []


REMEDY = Remedy(
    name="fewer_generations", title="fewer completions per prompt", opt_in=True,
    saves="the generation batch: KV cache, scoring buffers, completions per optimizer step",
    costs="a different objective: advantages over smaller groups, fewer completions per step",
    check=_check, variants=_variants, apply=apply_fields, fields=("num_generations",), trainers=GENERATING_TRAINERS,
)
