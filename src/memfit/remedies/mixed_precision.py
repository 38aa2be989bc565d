"""Mixed precision (AMP): matmuls in fp16/bf16, fp32 master weights, gradients and optimizer state.

It does not halve memory: fp32 weights, gradients and optimizer states stay; activations
saved in half precision shrink, and a half-precision copy of each weight is cached during
the forward (torch autocast's weight-cast cache). Faster on tensor cores. bf16 needs
compute capability 8.0+ (not V100/T4).
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.precision != "fp32":
        return Applicability(False, f"already {setup.precision}")
    return Applicability(True, "half-precision activations, tensor cores")


def _variants(setup, gpu):
    cc = tuple(gpu.compute_capability) if gpu is not None else tuple(setup.compute_capability)
    return [{"precision": "bf16"}] if cc >= (8, 0) else [{"precision": "fp16"}]


def _apply(changes, setup, **_):
    return {changes["precision"]: True}, {}, []


def _apply_to_trainer(trainer, changes, log, adapter):
    import torch

    value = changes["precision"]
    if not torch.cuda.is_available():
        log.append(f"precision {value} not applied: mixed precision is only applied on a CUDA GPU")
        return {}
    trainer.args.fp16, trainer.args.bf16 = value == "fp16", value == "bf16"
    adapter.rebuild_accelerator(trainer)
    log.append(f"mixed precision: {value}")
    return {"precision": value}


REMEDY = Remedy(
    name="mixed_precision", title="mixed precision",
    saves="half-size saved activations (weights, grads, optimizer state stay fp32)",
    costs="none on tensor-core GPUs (faster); fp16 needs loss scaling",
    check=_check, variants=_variants, apply=_apply,
    fields=("precision",), apply_to_trainer=_apply_to_trainer,
)
