"""Micro-batch size vs gradient accumulation, keeping the effective batch size exactly.

Activations scale with the micro-batch; accumulation steps do not change peak memory (they
set how often the optimizer steps). A smaller micro-batch with more accumulation saves
activations at some speed; a larger one, when memory is left over, is faster.
"""

from memfit.remedies.base import Applicability, Remedy, apply_fields


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _check(setup, gpu):
    if setup.effective_batch_size == 1:
        return Applicability(False, "effective batch size is 1: the micro-batch cannot shrink")
    return Applicability(True, f"effective batch {setup.effective_batch_size} can be split differently")


def _variants(setup, gpu):
    e = setup.effective_batch_size
    return [
        {"per_device_train_batch_size": b, "gradient_accumulation_steps": e // b}
        for b in _divisors(e) if b != setup.per_device_train_batch_size
    ]


def _apply_to_trainer(trainer, changes, log, adapter):
    applied = {}
    for key, value in changes.items():
        if key == "per_device_train_batch_size":
            old = trainer.args.per_device_train_batch_size
            adapter.set_train_batch_size(trainer, value)
            log.append(f"per_device_train_batch_size {old} -> {value}")
        else:
            old = getattr(trainer.args, key)
            setattr(trainer.args, key, value)
            log.append(f"{key} {getattr(old, 'value', old)} -> {value}")
        applied[key] = value
    return applied


REMEDY = Remedy(
    name="micro_batch", title="micro-batch x accumulation",
    saves="activations, in proportion to the micro-batch", costs="smaller micro-batches use the GPU less well",
    check=_check, variants=_variants, apply=apply_fields,
    # GRPO: the generation batch is kept by steps_per_generation (or generation_batch_size) changing with the
    # micro-batch (memfit.planner.grpo_plan)
    fields=("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size"), apply_to_trainer=_apply_to_trainer,
    advice=("micro_batch",),
)
