"""Gradient checkpointing for every model: Hugging Face's where it exists, memfit's own where not.

transformers 5 refuses `gradient_checkpointing_enable()` on models whose class does not
set `supports_gradient_checkpointing` (XLNet among them: ValueError "... does not support
activation checkpointing"). memfit then wraps each block of the model's repeated layer
list in `torch.utils.checkpoint.checkpoint(use_reentrant=False)`: the block's inputs are
saved, its internals are recomputed in the backward. The same wrapper serves the
simulator and real training.

    from memfit.models.blocks import enable_checkpointing
    kind = enable_checkpointing(model)   # "huggingface" or "memfit"
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import MemfitError

__all__ = ["repeated_layer_lists", "enable_checkpointing", "enable_block_checkpointing"]


def repeated_layer_lists(model: nn.Module, *, min_layers: int = 2) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists whose children all have one class: the model's stacks of transformer blocks.

    Nested lists (e.g. the linears inside a block) are skipped once an outer list matched.
    """
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < min_layers:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        # a block has parameters of its own (not a list of activations or dropouts)
        if not any(True for _ in module[0].parameters()):
            continue
        found.append((name, module))
    return found


def enable_block_checkpointing(model: nn.Module) -> int:
    """Wrap every block of every repeated layer list in non-reentrant checkpointing.

    Returns the number of blocks wrapped. Idempotent. Checkpointing applies only while
    training with grad enabled, as Hugging Face's does (evaluation runs the plain block).
    """
    wrapped = 0
    for _, layers in repeated_layer_lists(model):
        for block in layers:
            if getattr(block, "_memfit_checkpointed", False):
                continue
            plain = block.forward

            @functools.wraps(plain)
            def forward(*args, __plain=plain, __block=block, **kwargs):
                if __block.training and torch.is_grad_enabled():
                    return checkpoint(__plain, *args, use_reentrant=False, **kwargs)
                return __plain(*args, **kwargs)

            block.forward = forward
            block._memfit_checkpointed = True
            wrapped += 1
    return wrapped


def enable_checkpointing(model: nn.Module, kwargs: dict | None = None) -> str:
    """Enable gradient checkpointing as Trainer would; fall back to memfit's per-block wrapper.

    `kwargs` are TrainingArguments' `gradient_checkpointing_kwargs`: Trainer (transformers 5.24
    `_inner_training_loop`) pops `every_n_layers` and `offload` for `activation_checkpointing_enable`
    and passes the rest (`use_reentrant`) to torch.utils.checkpoint.

    Returns "huggingface" when the model's own implementation is used, "memfit" when memfit's
    wrapper is, and raises ValueError when the model has no repeated blocks to wrap.
    """
    kwargs = dict(kwargs or {})
    extra = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(gradient_checkpointing_kwargs=kwargs or None, **extra)
            return "huggingface"
        except ValueError:
            pass  # e.g. XLNet: "does not support activation checkpointing"
    if enable_block_checkpointing(model) == 0:
        raise MemfitError(f"`{type(model).__name__}` has no repeated layer blocks (an nn.ModuleList of 2 or more "
                          "identical layers) to checkpoint; checkpoint its modules with torch.utils.checkpoint yourself")
    return "memfit"
