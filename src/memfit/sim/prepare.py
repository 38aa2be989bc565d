"""The model a simulated run trains, prepared on the meta device in the order a real run prepares it.

`from_pretrained` builds the model (with its attention implementation and, for a quantized run,
bitsandbytes' layers), peft's `prepare_model_for_kbit_training` runs, accelerate converts it to
torchao Float8, TRL adds its fused LM head, peft wraps it, parts of it are frozen, and Trainer turns
gradient checkpointing on. memfit adds one step of its own: the cut model (memfit.sim.splice), a few
blocks per repeated stack that stand for all of them. `prepare_model` runs these steps in that
order, one function each, and returns what the run needs of them (`PreparedModel`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.models.blocks import enable_checkpointing, repeated_layer_lists
from memfit.models.build import ModelSpec, build_meta_model, resolve_config
from memfit.models.limits import check_sequence_lengths
from memfit.models.quantization import (meta_safe_deepcopy, prepare_for_kbit_training, quant_spec, unquantized_experts,
                                        quantization_summary, quantize_meta_model)
from memfit.sim import trl_steps
from memfit.sim.splice import SpliceRefused, truncate_layers
from memfit.train_setup import TRL_CONFIG_CLASS_NAMES, TrainSetup
from memfit.units import format_bytes

__all__ = ["PreparedModel", "prepare_model"]


@dataclass
class PreparedModel:
    """The prepared (meta) model and what its preparation decided."""

    spec: ModelSpec
    model: nn.Module
    notes: list[str] = field(default_factory=list)
    flash_log: list[str] | None = None  #: emulated flash-attn kernels that ran; None: the model does not use flash-attn
    flex_log: list[str] | None = None  #: emulated flex-attention kernels that ran; None: not flex attention
    quant: Any = None  #: memfit.models.quantization.QuantSpec, or None when the weights are not quantized
    quant_summary: dict | None = None  #: memfit.models.quantization.quantization_summary
    ref_model: nn.Module | None = None  #: DPO's / GRPO's reference copy (memfit.sim.trl_steps.build_reference)
    ref_cut: nn.Module | None = None  #: the reference's cut model (with `cut`, when it has a reference copy)
    reward_model: nn.Module | None = None  #: GRPO's / RLOO's reward model (memfit.sim.trl_steps.build_reward_model)
    splice: bool = True  #: whether the cut model may stand for the full one
    cut: nn.Module | None = None  #: the cut model (memfit.sim.splice.truncate_layers), or None
    sizes: dict = field(default_factory=dict)  #: per repeated stack, its full number of blocks (with `cut`)
    names: dict = field(default_factory=dict)  #: per repeated stack, its attribute path (with `cut`)
    checkpointing: str | None = None  #: "huggingface", "memfit" or None


def prepare_model(setup: TrainSetup, *, splice: bool, compute_capability: tuple[int, int],
                  amp_dtype: torch.dtype | None, spec: ModelSpec | None = None) -> PreparedModel:
    """The model of `setup`, prepared step by step (module docstring).

    Args:
        setup: the run.
        splice: whether to build the cut model (memfit.sim.splice); a step may still refuse it.
        compute_capability: the target GPU's; flash-attn and Float8 training check it.
        amp_dtype: the autocast dtype of the run (None: fp32); flash-attn checks it.
        spec: the resolved model (default: `resolve_config(setup.model)`).
    """
    spec = spec or resolve_config(setup.model)
    check_flex_attention(setup, spec)
    p = build_model(setup, spec, compute_capability=compute_capability, amp_dtype=amp_dtype)
    p.splice = splice
    p.notes += check_sequence_lengths(p.model, setup, spec.name, spec.config)
    quantize(p, setup)
    convert_to_float8(p, setup, compute_capability)
    prepare_for_trl(p, setup)
    apply_peft(p, setup)
    summarize_quantization(p, setup)
    freeze(p, setup)
    cast_trainable_for_trl(p, setup)
    cut_repeated_blocks(p, setup)
    turn_on_checkpointing(p, setup)
    check_experts(p, setup)
    return p


def check_flex_attention(setup: TrainSetup, spec: ModelSpec) -> None:
    """Flex attention runs transformers' own flex path with the compiled kernels emulated: the model must have one."""
    if setup.attn_implementation == "flex_attention" and not isinstance(setup.model, nn.Module):
        from memfit.sim.kernels.flex_attn import check_flex_model
        from memfit.train_setup import TASKS

        check_flex_model(spec.config, TASKS[setup.task], spec.name)


def build_model(setup: TrainSetup, spec: ModelSpec, *, compute_capability: tuple[int, int],
          amp_dtype: torch.dtype | None) -> PreparedModel:
    """The meta model; a flash-attn model is built with sdpa, then switched to the emulated kernels."""
    attn = setup.attn_implementation
    flash = attn is not None and attn not in ("eager", "sdpa", "flex_attention")
    model = build_meta_model(setup.replace(attn_implementation="sdpa") if flash else setup, spec)
    p = PreparedModel(spec, model, flex_log=[] if attn == "flex_attention" else None)
    if flash:
        from memfit.sim.kernels.flash_attn import use_flash_attention

        name = use_flash_attention(model, attn, compute_capability=compute_capability, amp_dtype=amp_dtype)
        if name != attn:
            p.notes.append(f"`{attn}` is a build of flash-attn; simulated as {name} (the same kernels)")
        p.flash_log = []
    return p


def quantize(p: PreparedModel, setup: TrainSetup) -> None:
    """bitsandbytes layers as `from_pretrained(quantization_config=...)` builds them, then peft's
    `prepare_model_for_kbit_training`, before LoRA (memfit.models.quantization)."""
    p.quant = quant_spec(setup)
    if p.quant is None:
        return
    quantize_meta_model(p.model, p.quant)
    before = unquantized_experts(p.model)[1]
    if setup.kbit_prep:
        cast = prepare_for_kbit_training(p.model, setup.kbit_use_gradient_checkpointing)
        if cast:
            p.notes.append(
                f"peft's prepare_model_for_kbit_training was run on the model (as peft's QLoRA recipes do; "
                f"TRL 1.16's SFTTrainer does not call it: --no-kbit-prep for such a run): it cast "
                f"{cast / 1e6:,.1f} M non-quantized fp16/bf16 parameters (embeddings, norms, the LM head"
                f"{', the fused experts' if before else ''}) to "
                f"float32, +{format_bytes(cast * 2)} of weights; --no-kbit-prep estimates without it")
    experts, expert_bytes, kinds = unquantized_experts(p.model)
    if experts:  # the whole story of a QLoRA MoE run: said first, loudly
        share = expert_bytes / max(1, sum(q.numel() * q.element_size() for q in p.model.parameters()))
        dtype = str(next(q.dtype for n, q in p.model.named_parameters() if q.ndim == 3 and "expert" in n.lower()))
        count = f"{experts / 1e9:,.2f} B" if experts >= 1e9 else f"{experts / 1e6:,.2f} M"
        cast_too = (" (peft's prepare_model_for_kbit_training cast them to float32)" if expert_bytes > before else "")
        p.notes.insert(0, f"NOT QUANTIZED: {count} parameters are fused expert weights ({', '.join(kinds)}: one 3-D "
                          "tensor per layer, not nn.Linear layers), which bitsandbytes does not quantize in "
                          f"transformers 5: they are {dtype.removeprefix('torch.')}{cast_too}, "
                          f"{format_bytes(expert_bytes)}, {100 * share:.0f} % of the weights' bytes")


def convert_to_float8(p: PreparedModel, setup: TrainSetup, compute_capability: tuple[int, int]) -> None:
    """torchao Float8 training, as accelerate's `prepare()` converts the model (memfit.models.float8)."""
    if setup.float8_recipe is None:
        return
    from memfit.models.float8 import check_float8_gpu, convert_float8, float8_note, high_precision_linears

    check_float8_gpu(compute_capability)
    converted = convert_float8(p.model, setup.float8_recipe)
    p.notes.append(float8_note(setup.float8_recipe, converted, high_precision_linears(p.model)))


def prepare_for_trl(p: PreparedModel, setup: TrainSetup) -> None:
    """TRL's fused LM head (before peft) and DPO's reference model (memfit.sim.trl_steps)."""
    trl_steps.prepare_model(p.model, setup)
    p.ref_model = trl_steps.build_reference(setup, p.spec)
    p.reward_model = trl_steps.build_reward_model(setup)
    if p.reward_model is not None:
        from memfit.units import format_bytes

        params = sum(t.numel() for t in p.reward_model.parameters())
        held = sum(t.numel() * t.element_size() for t in [*p.reward_model.parameters(), *p.reward_model.buffers()])
        steps, gen = setup.grpo_sizes
        p.notes.append(f"reward model `{setup.reward_model}` ({type(p.reward_model).__name__}, {params / 1e6:,.1f} M "
                       f"parameters): {format_bytes(held)} of weights on the GPU for the whole run, and one forward "
                       f"over each generation batch ({gen} sequences of {setup.sequence_length} + "
                       f"{setup.max_completion_length} tokens, as the policy's tokenizer counts them) in scoring")
    p.notes += trl_steps.notes(setup)


def apply_peft(p: PreparedModel, setup: TrainSetup) -> None:
    """peft's `get_peft_model` on the meta model: LoRA (DoRA) or the setup's `peft_config`."""
    if setup.lora_r is None and not setup.peft_config:
        return
    from memfit.models.peft_methods import apply_peft as get_peft_model
    from memfit.models.peft_methods import peft_notes

    p.model = get_peft_model(p.model, setup)
    p.notes += peft_notes(setup)


def cast_trainable_for_trl(p: PreparedModel, setup: TrainSetup) -> None:
    """A TRL trainer with a quantized model: TRL casts the adapters to bf16 (memfit.sim.trl_steps
    .cast_quantized_trainable)."""
    cast = trl_steps.cast_quantized_trainable(p.model, setup)
    if cast:
        p.notes.append(f"{TRL_CONFIG_CLASS_NAMES[setup.trainer].replace('Config', 'Trainer')} casts the trainable "
                       f"parameters of a quantized model to bf16 ({cast:,} parameters: the adapters, their gradients "
                       "and optimizer state in bf16, not peft's fp32)")


def summarize_quantization(p: PreparedModel, setup: TrainSetup) -> None:
    """What the quantized model holds, once peft has wrapped it (memfit.models.quantization)."""
    if p.quant is not None:
        p.quant_summary = quantization_summary(p.model, p.quant, kbit_prep=setup.kbit_prep)


def freeze(p: PreparedModel, setup: TrainSetup) -> None:
    """`freeze_embeddings` and `freeze_layers` (frozen and trained blocks differ, so no block stands for the others),
    and the parts of image and speech models (memfit.models.freezing)."""
    model = p.model
    if setup.freeze_embeddings:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is None:
            raise MemfitError("`freeze_embeddings` needs a model with input embeddings (get_input_embeddings())")
        emb.requires_grad_(False)
    if setup.freeze_layers:
        stacks = repeated_layer_lists(model)
        if not stacks or setup.freeze_layers > len(stacks[0][1]):
            have = len(stacks[0][1]) if stacks else 0
            raise MemfitError(f"`freeze_layers` is `{setup.freeze_layers}` but the model has {have} blocks; "
                              f"freeze at most {have}")
        for block in list(stacks[0][1])[: setup.freeze_layers]:
            block.requires_grad_(False)
        p.splice = False
    from memfit.models.freezing import freeze_parts  # a speech model's feature encoder, a vision tower, ...

    p.notes += freeze_parts(model, setup)


def cut_repeated_blocks(p: PreparedModel, setup: TrainSetup) -> None:
    """The cut model (memfit.sim.splice), when its blocks can stand for the full model's: of a peft method only
    when its blocks are independent, never of a model passed as a module."""
    if p.splice and setup.peft_config:
        from memfit.models.peft_methods import splice_allowed

        p.splice = splice_allowed(setup)
    if not p.splice or isinstance(setup.model, nn.Module):
        return
    try:
        with meta_safe_deepcopy() if p.quant is not None else contextlib.nullcontext():
            p.cut, p.sizes, p.names = truncate_layers(p.model)
            if p.ref_model is not None:  # GRPO's reference forward is spliced too (memfit.sim.grpo_steps)
                p.ref_cut, ref_sizes, ref_names = truncate_layers(p.ref_model)
                if (ref_sizes, ref_names) != (p.sizes, p.names):
                    raise SpliceRefused("the reference's repeated stacks are not the policy's")
        trl_steps.prepare_cut(p.cut, p.ref_cut)
    except SpliceRefused:
        p.cut = p.ref_cut = None


def turn_on_checkpointing(p: PreparedModel, setup: TrainSetup) -> None:
    """Gradient checkpointing on the model and the cut model (on for a quantized model with kbit_prep: TrainSetup
    says why): Hugging Face's where transformers has it, else memfit's per-block checkpointing."""
    if not setup.gradient_checkpointing:
        return
    kwargs = setup.gradient_checkpointing_kwargs  # use_reentrant, offload, every_n_layers
    try:
        p.checkpointing = enable_checkpointing(p.model, kwargs)
        if p.cut is not None:
            enable_checkpointing(p.cut, kwargs)
    except ValueError as err:
        raise MemfitError(f"gradient checkpointing is not possible here: {err}") from err
    if p.checkpointing == "memfit" and kwargs:
        p.notes.append("`gradient_checkpointing_kwargs` apply to Hugging Face's checkpointing; memfit's own "
                       "(non-reentrant, on the device) is simulated for this model")
    if p.checkpointing == "memfit":
        p.notes.append(f"{type(p.model).__name__} has no gradient checkpointing in transformers; "
                       "memfit's per-block checkpointing (memfit.models.blocks) is simulated")


def check_experts(p: PreparedModel, setup: TrainSetup) -> None:
    """MoE: a routing-dependent experts implementation is refused; the routing figures are noted (memfit.sim.moe)."""
    from memfit.sim import moe

    moe.check_experts_implementation(p.model)
    figures = moe.routing_figures(p.model, tokens=setup.per_device_train_batch_size * setup.max_length)
    if figures is not None:
        p.notes.append(moe.routing_note(figures))
    if (mxfp4 := moe.mxfp4_note(p.model)) is not None:
        p.notes.append(mxfp4)
