"""No reference model (opt-in `no_reference`, GRPO): `beta=0`.

With `beta > 0` GRPOTrainer keeps a reference model, a second copy of the weights (with peft the adapter is
disabled instead: no copy), and scores every generation batch with it for the KL term. `beta=0` drops both:
the objective loses its KL penalty (GRPOConfig's default, `beta=0.0`, in TRL 1.16).
"""

from memfit.remedies.base import Applicability, Remedy, apply_fields
from memfit.train_setup import GENERATING_TRAINERS


def _check(setup, gpu):
    if setup.trainer not in GENERATING_TRAINERS:
        return Applicability(False, "GRPO and RLOO only")
    if setup.beta == 0:
        return Applicability(False, "beta is 0 already: no reference model")
    return Applicability(True, "beta > 0 keeps a reference model and scores with it")


def _variants(setup, gpu):
    return [{"beta": 0.0}] if _check(setup, gpu).applies else []


REMEDY = Remedy(
    name="no_reference", title="no reference model (beta=0)", opt_in=True,
    saves="the reference copy of the weights (without peft) and its scoring pass",
    costs="a different objective: no KL penalty towards the reference",
    check=_check, variants=_variants, apply=apply_fields, fields=("beta",), trainers=GENERATING_TRAINERS,
)
