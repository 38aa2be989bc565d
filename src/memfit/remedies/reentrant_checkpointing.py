"""Reentrant checkpointing for an 8-bit base: `gradient_checkpointing_kwargs={"use_reentrant": True}`.

bitsandbytes 0.50 autograd/_functions.py `MatMul8bitLt.forward` keeps its input for the backward as an attribute
of the autograd context (`ctx.tensors = (CAt, subA, A)`), not through `ctx.save_for_backward`. Non-reentrant
checkpointing (transformers 5's default, `use_reentrant=False`) frees a checkpointed layer's activations through
the saved-tensor hooks (torch/utils/checkpoint.py `_checkpoint_hook`), which never see `ctx.tensors`: every 8-bit
layer's input stays on the GPU and checkpointing saves little. Reentrant checkpointing runs the checkpointed
forward under `torch.no_grad()` (`CheckpointFunction.forward`), which creates no autograd context at all, so
those inputs are not kept. Same numerics and the same recomputation (one more forward per layer either way);
memfit simulates the variant with bitsandbytes' own layers (memfit.models.quantization), never assumes it.
Only for an 8-bit base (`load_in_8bit`); 4-bit `MatMul4Bit` saves through `save_for_backward`.
"""

from __future__ import annotations

from typing import Any

from memfit.remedies.base import Applicability, Remedy
from memfit.remedies.checkpoint_offload import CheckpointKwargs, _has_hf_checkpointing


def _check(setup, gpu):
    if not setup.load_in_8bit:
        return Applicability(False, "8-bit bases only (bitsandbytes' MatMul8bitLt keeps its input outside the "
                                    "saved-tensor hooks; other layers save through them)")
    kw = setup.gradient_checkpointing_kwargs or {}
    if kw.get("use_reentrant"):
        return Applicability(False, "already reentrant")
    if kw.get("offload"):
        return Applicability(False, "checkpoint offload's save_on_cpu hooks are non-reentrant checkpointing's")
    if not _has_hf_checkpointing(setup):
        return Applicability(False, "the model has no Hugging Face gradient checkpointing to pass `use_reentrant` to")
    return Applicability(True, "non-reentrant checkpointing leaves each 8-bit layer's input on the GPU "
                               "(MatMul8bitLt's ctx.tensors)")


def _variants(setup, gpu) -> list[dict[str, Any]]:
    # with checkpointing on: the planner puts it on the checkpointing axis with gradient_checkpointing=True
    # (memfit.planner.search `_candidate_axes`), as checkpoint offload
    if not _check(setup, gpu).applies:
        return []
    return [{"gradient_checkpointing_kwargs": CheckpointKwargs({**(setup.gradient_checkpointing_kwargs or {}),
                                                               "use_reentrant": True})}]


def _owns(changes, setup) -> bool:
    """Its change: `use_reentrant` turned on (checkpoint offload changes `offload` in the same field)."""
    new = changes.get("gradient_checkpointing_kwargs") or {}
    return bool(new.get("use_reentrant")) and not (setup.gradient_checkpointing_kwargs or {}).get("use_reentrant")


def _apply(changes, setup, **_):
    kw = dict(changes["gradient_checkpointing_kwargs"])
    return ({"gradient_checkpointing_kwargs": kw}, {},
            ["# reentrant checkpointing: bitsandbytes' 8-bit layers keep their inputs under the non-reentrant kind"])


REMEDY = Remedy(
    name="reentrant_checkpointing", title="reentrant checkpointing (8-bit base)",
    saves="each 8-bit layer's input, which MatMul8bitLt keeps outside non-reentrant checkpointing's hooks",
    costs="none (same recomputation); reentrant checkpointing needs an input that requires grad (peft's kbit prep "
          "and transformers' enable_input_require_grads see to it)",
    check=_check, variants=_variants, apply=_apply, fields=("gradient_checkpointing_kwargs",), owns=_owns,
)
