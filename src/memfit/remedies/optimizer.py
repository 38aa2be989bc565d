"""A smaller optimizer state: 8-bit AdamW (bitsandbytes) or Adafactor (factored second moment).

AdamW keeps 8 bytes per trainable parameter; 8-bit AdamW about 2; Adafactor without
momentum about 4/sqrt(n) per matrix. Both change the optimizer (small accuracy risk).
"""

from memfit.remedies.base import Applicability, Remedy

_CHEAPER = ("adamw_bnb_8bit", "adafactor")


def _check(setup, gpu):
    if setup.optim in _CHEAPER or setup.optim == "sgd":
        return Applicability(False, f"`{setup.optim}` already has a small state")
    return Applicability(True, "8 bytes/param of AdamW state is often the largest single item")


def _variants(setup, gpu):
    return [{"optim": o} for o in _CHEAPER if o != setup.optim]


def _apply(changes, setup, **_):
    code = ["# pip install bitsandbytes"] if changes["optim"] == "adamw_bnb_8bit" else []
    return {"optim": changes["optim"]}, {}, code


def _apply_to_trainer(trainer, changes, log, adapter):
    old = trainer.args.optim
    trainer.args.optim = changes["optim"]
    log.append(f"optim {getattr(old, 'value', old)} -> {changes['optim']}")
    return {"optim": changes["optim"]}


REMEDY = Remedy(
    name="optimizer", title="smaller optimizer state",
    saves="optimizer state (8-bit AdamW: ~6 of 8 bytes/param; Adafactor: most of it)",
    costs="a different optimizer; 8-bit AdamW needs bitsandbytes and a CUDA GPU",
    check=_check, variants=_variants, apply=_apply,
    fields=("optim",), apply_to_trainer=_apply_to_trainer, advice=("optimizer_8bit",),
)
