"""transformers' CTC speech models (wav2vec2, HuBERT, WavLM, data2vec-audio, ...): the internals a simulated step
replaces, in one place.

A CTC model's training step reads values on the host in three places, which a FakeTensor cannot give:

* its forward checks the labels, `if labels is not None and labels.max() >= self.config.vocab_size: raise`
  (`Wav2Vec2ForCTC.forward`, transformers 5.24): the check's device ops run (the max and the comparison, two
  scalars), its host read does not (memfit made the labels, all below vocab_size);
* SpecAugment (`Wav2Vec2Model._mask_hidden_states`): `_compute_mask_indices` draws the masked spans with numpy on
  the host, then `hidden_states[mask] = masked_spec_embed`, a boolean-mask `index_put_` whose CUDA kernel turns the
  mask into `mask.nonzero()` indices. Here the same numpy draw runs (seeded, so that two simulations agree; every
  example full length, which is what `attention_mask=None` means to it), the mask is copied to the device as the
  model copies it, and `index_put_` gets the nonzero indices (n, 2) int64 that CUDA makes of the mask. The feature
  mask (`mask_feature_prob`) is a `masked_fill_`, what CUDA dispatches a scalar boolean-mask assignment to
  (`canDispatchToMaskedFill`, aten/src/ATen/native/TensorAdvancedIndexing.cpp);
* the loss, transformers' `ForCTCLoss` (transformers/loss/loss_ctc.py): `labels.masked_select(mask)` has a
  data-dependent size and `F.ctc_loss` sizes its buffers from the label lengths; both are emulated as CUDA runs
  them (memfit.sim.kernels.ctc). Its other ops (the masks, the lengths, `log_softmax` in float32) run as they are.

The forward is wrapped, not rewritten: the model's own forward runs with `labels=None` (everything up to the
logits), its base model's output is kept alive until the loss is done (the original's local `outputs`), and the
loss lines of the original follow (tests/sim/test_ctc.py checks that a real CPU step through this wrapper, with
PyTorch's CPU `ctc_loss`, allocates what the unwrapped model allocates, event for event).

Known limitations: the SpecAugment mask is one draw (the fraction of masked frames varies a little from step to
step in a real run; its indices are a few KB); autograd keeps the nonzero indices for the backward where CUDA keeps
the boolean mask (B x T bytes) and makes the indices again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.sim.kernels import ctc as ctc_kernels
from memfit.sim.patching import patched

__all__ = ["is_ctc_model", "ctc_patches", "SPEC_AUGMENT_SEED"]

#: numpy seed of the simulated SpecAugment draw (any fixed value: two simulations of a setup must agree).
SPEC_AUGMENT_SEED = 0


def is_ctc_model(model: nn.Module) -> bool:
    """A transformers CTC head over a speech encoder (`*ForCTC` with the conv feature encoder's lengths)."""
    return type(model).__name__.endswith("ForCTC") and hasattr(model, "_get_feat_extract_output_lengths")


def _ctc_loss(logits: torch.Tensor, labels: torch.Tensor, logit_lengths: torch.Tensor, blank_token_id: int,
              reduction: str = "mean", zero_infinity: bool = False, ignore_index: int = -100,
              **kwargs: Any) -> torch.Tensor:
    """transformers' ForCTCLoss (loss_ctc.py), with masked_select and ctc_loss as CUDA allocates them."""
    labels = labels.to(logits.device)
    labels_mask = (labels != ignore_index) & (labels != blank_token_id)
    target_lengths = labels_mask.sum(-1)
    flattened_targets = ctc_kernels.masked_select_all(labels, labels_mask)
    log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    return ctc_kernels.ctc_loss(log_probs, flattened_targets, logit_lengths, target_lengths, blank=blank_token_id,
                                reduction=reduction, zero_infinity=zero_infinity)


def _wrap_forward(original: Any, loss: Any) -> Any:
    def forward(self: nn.Module, input_values: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(self, input_values, attention_mask=attention_mask, **kwargs)
        check = labels.max() >= self.config.vocab_size  # the device side of the original's label check
        del check
        kept: list[Any] = []  # the base model's output, alive until the loss is computed (the original's `outputs`)
        handle = self.base_model.register_forward_hook(lambda module, args, out: kept.append(out))
        try:
            out = original(self, input_values, attention_mask=attention_mask, labels=None, **kwargs)
        finally:
            handle.remove()
        # the original's loss lines (Wav2Vec2ForCTC.forward, transformers 5.24)
        attention_mask = (attention_mask if attention_mask is not None
                          else torch.ones_like(input_values, dtype=torch.long))
        input_lengths = self._get_feat_extract_output_lengths(attention_mask.sum(-1)).to(torch.long)
        out.loss = loss(logits=out.logits, labels=labels, logit_lengths=input_lengths,
                        blank_token_id=self.config.pad_token_id, reduction=self.config.ctc_loss_reduction,
                        zero_infinity=self.config.ctc_zero_infinity, **kwargs)
        # `kept` goes with the frame, after `attention_mask`, in the order CPython clears the original's locals
        # (`attention_mask`, an argument, before `outputs`)
        return out

    return forward


def _spec_augment_mask(shape: tuple[int, int], prob: float, length: int, min_masks: int, module: Any) -> Any:
    """The model's own `_compute_mask_indices` draw (its module's function), seeded, the global numpy state kept."""
    import sys

    import numpy as np

    compute = sys.modules[type(module).__module__]._compute_mask_indices
    state = np.random.get_state()
    try:
        np.random.seed(SPEC_AUGMENT_SEED)
        return compute(shape, mask_prob=prob, mask_length=length, attention_mask=None, min_masks=min_masks)
    finally:
        np.random.set_state(state)


def _mask_hidden_states(self: nn.Module, hidden_states: torch.Tensor, mask_time_indices: torch.Tensor | None = None,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`Wav2Vec2Model._mask_hidden_states` (transformers 5.24) with the host-drawn masks applied by index."""
    import numpy as np

    config = self.config
    if not getattr(config, "apply_spec_augment", True):
        return hidden_states
    batch_size, sequence_length, hidden_size = hidden_states.size()
    time_mask = mask_time_indices is None and config.mask_time_prob > 0 and self.training
    if (time_mask or (config.mask_feature_prob > 0 and self.training)) and hidden_states._base is not None:
        # a view written in place (the feature projection's linear output when its dropout is 0): autograd then
        # regenerates the view's backward, for a CUDA tensor as an as_strided of the base; a FakeTensor (a
        # Python-dispatch tensor) replays the view op instead, which allocates otherwise. The same view, made by
        # as_strided, takes CUDA's path on both.
        hidden_states = hidden_states._base.as_strided(hidden_states.size(), hidden_states.stride(),
                                                       hidden_states.storage_offset())
    if time_mask:
        mask = _spec_augment_mask((batch_size, sequence_length), config.mask_time_prob, config.mask_time_length,
                                  config.mask_time_min_masks, self)
        on_device = torch.tensor(mask, device=hidden_states.device, dtype=torch.bool)  # the model's copy
        indices = torch.tensor(np.argwhere(mask), device=hidden_states.device, dtype=torch.long)  # nonzero()
        value = self.masked_spec_embed.to(hidden_states.dtype)
        hidden_states.index_put_((indices[:, 0], indices[:, 1]), value)
        del on_device, indices
    elif mask_time_indices is not None:  # given by the caller (pretraining): as the model does
        hidden_states[mask_time_indices] = self.masked_spec_embed.to(hidden_states.dtype)
    if config.mask_feature_prob > 0 and self.training:
        mask = _spec_augment_mask((batch_size, hidden_size), config.mask_feature_prob, config.mask_feature_length,
                                  config.mask_feature_min_masks, self)
        features = torch.tensor(mask, device=hidden_states.device, dtype=torch.bool)[:, None]
        hidden_states.masked_fill_(features.expand(-1, sequence_length, -1), 0)
    return hidden_states


@contextlib.contextmanager
def ctc_patches(models: list[nn.Module], *, loss: Any = None) -> Iterator[None]:
    """The CTC models' forward and their base models' SpecAugment replaced (module docstring), undone on exit.

    Args:
        models: the simulated models (a peft model stands for its base model).
        loss: the loss the wrapped forward calls; None: ForCTCLoss with CUDA's masked_select and ctc_loss
            (a test passes transformers' own ForCTCLoss to compare the wrapper with the model).
    """
    with contextlib.ExitStack() as stack:
        done: set[type] = set()
        for model in models:
            model = model.get_base_model() if hasattr(model, "get_base_model") else model
            if not is_ctc_model(model):
                continue
            for cls, name, new in ((type(model), "forward", None),
                                   (type(model.base_model), "_mask_hidden_states", _mask_hidden_states)):
                if cls in done or not hasattr(cls, name):
                    continue
                done.add(cls)
                if new is None:
                    new = _wrap_forward(cls.forward, loss or _ctc_loss)
                stack.enter_context(patched(cls, name, new))
        yield
