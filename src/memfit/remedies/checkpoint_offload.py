"""Checkpoint offload: gradient checkpointing with the checkpointed inputs in pinned host memory,
`gradient_checkpointing_kwargs={"offload": True}`.

transformers 5.24 `PreTrainedModel._activation_checkpointing_enable(offload=True)` wraps each checkpointed
layer call in `torch.autograd.graph.save_on_cpu(pin_memory=True)`: the one input checkpointing keeps per layer
(the hidden states, B x S x d) goes to the host in the forward and comes back in the backward, so the GPU
keeps none of them, only the layer being recomputed (memfit.sim.offload simulates it). Same numerics; it costs
a device-to-host and a host-to-device copy of those bytes per micro-step on the compute stream
(memfit.planner.throughput charges them over the GPU's PCIe link) and that much pinned host memory. Only for
models with Hugging Face's checkpointing (memfit's own per-block wrapper takes no kwargs).
"""

from __future__ import annotations

from typing import Any

from memfit.remedies.base import Applicability, Remedy


class CheckpointKwargs(dict):
    """`gradient_checkpointing_kwargs` as a variant value: a dict (TrainSetup and TrainingArguments read it as
    one) that the planner can hash, as it hashes every candidate's changes. Never mutated."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _has_hf_checkpointing(setup) -> bool:
    """Whether the model class has Hugging Face's checkpointing (`supports_gradient_checkpointing`)."""
    model = setup.model
    if hasattr(model, "supports_gradient_checkpointing"):  # an nn.Module / PreTrainedModel
        return bool(model.supports_gradient_checkpointing)
    try:
        import transformers

        from memfit.models.build import resolve_config
        from memfit.train_setup import TASKS

        config = resolve_config(model).config
        cls = getattr(transformers, TASKS[setup.task])._model_mapping[type(config)]
    except Exception:  # an unresolvable model or task fails the estimate itself with a clear error
        return False
    return bool(getattr(cls, "supports_gradient_checkpointing", False))


def _check(setup, gpu):
    kw = setup.gradient_checkpointing_kwargs or {}
    if setup.gradient_checkpointing and kw.get("offload"):
        return Applicability(False, "already offloaded")
    if setup.activation_offloading:
        return Applicability(False, "TRL's activation offloading already keeps the saved tensors in host memory")
    if setup.trainer in ("grpo", "rloo", "distill"):
        # Trainer pops `offload` before it enables checkpointing (transformers trainer.py `train`), but TRL turns it
        # off around generation and back on with the whole kwargs (trl/models/utils.py
        # `disable_gradient_checkpointing`: `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)`)
        return Applicability(False, "TRL re-enables checkpointing after each generation with these kwargs, which hands "
                                    "`offload` to torch.utils.checkpoint (a ValueError at the first step)")
    if not _has_hf_checkpointing(setup):
        return Applicability(False, "the model has no Hugging Face gradient checkpointing; memfit's own "
                                    "per-block checkpointing keeps its inputs on the GPU")
    return Applicability(True, "no checkpointed block inputs on the GPU")


def _variants(setup, gpu) -> list[dict[str, Any]]:
    # only with checkpointing on: the planner puts it on the checkpointing axis with gradient_checkpointing=True
    # (memfit.planner.search `_candidate_axes`), which the checkpointing remedy owns and describes
    kw = CheckpointKwargs({**(setup.gradient_checkpointing_kwargs or {}), "offload": True})
    return [{"gradient_checkpointing_kwargs": kw}]


def _owns(changes, setup) -> bool:
    """Its change: `offload` turned on (reentrant checkpointing changes `use_reentrant` in the same field)."""
    new = changes.get("gradient_checkpointing_kwargs") or {}
    return bool(new.get("offload")) and not (setup.gradient_checkpointing_kwargs or {}).get("offload")


def _apply(changes, setup, **_):
    kw = dict(changes["gradient_checkpointing_kwargs"])
    return ({"gradient_checkpointing_kwargs": kw}, {},
            ["# checkpointed inputs in pinned host memory: a copy each way per micro-step over PCIe"])


def _apply_to_trainer(trainer, changes, log, adapter):
    kw = dict(changes["gradient_checkpointing_kwargs"])
    args = trainer.args
    # transformers 5.24 Trainer reads `activation_checkpointing(_kwargs)`; the `gradient_checkpointing*` names
    # only mirror them after TrainingArguments.__post_init__ (training_args.py), so set both
    args.activation_checkpointing = args.gradient_checkpointing = True
    args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = kw
    log.append(f"gradient_checkpointing_kwargs -> {kw}"
               + (" (checkpointed inputs offloaded to host memory)" if kw.get("offload") else ""))
    return {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": kw}


REMEDY = Remedy(
    name="checkpoint_offload", title="checkpoint offload",
    saves="the checkpointed block inputs (B x S x d per layer), kept in pinned host memory",
    costs="a device-to-host and a host-to-device copy of them per micro-step over PCIe; pinned host memory",
    check=_check, variants=_variants, apply=_apply,
    fields=("gradient_checkpointing_kwargs",), apply_to_trainer=_apply_to_trainer, owns=_owns,
)
