"""Host data stays real on a fake run: what a vision-language model computes from its inputs' values.

A vision-language model reads some inputs' values on the host. Qwen2.5-VL sizes its vision tower's windows,
its `cu_seqlens` packing and its 3D positions from `image_grid_thw` (`.tolist()`, `repeat_interleave`,
`unique_consecutive`: transformers/vision_utils.py), and finds where the image features go from the placeholder
tokens of `input_ids` (`get_placeholder_mask`, `get_rope_index`). A FakeTensor has no values, so these cannot
run on one. memfit hands the model the processor's real output (memfit.models.image_text) and, while this mode
is active, runs every op whose tensor inputs are all real on real data, outside the fake mode: the host-side
arithmetic gets its values, and the tracker below still records each of its allocations (they are device
allocations on the GPU, where these inputs live). An op that touches a FakeTensor (the weights, anything made
from them) stays fake. A factory op (no tensor input: `arange`, `zeros`, `full`) makes a real tensor when it is
small (at most `SMALL_FACTORY_NUMEL` elements: index and position ranges, scalars), so host code built from it
(`get_vision_window_index`'s padded index grid) runs; a larger one stays fake. On a real CPU run everything is
real and the mode changes nothing: tests/sim/test_media_exactness.py checks that both traces are equal.

Active only for the forward and backward of a micro-step and the evaluation forward (`active`), never in the
optimizer step, whose in-place updates of fake state must stay fake.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from memfit.sim import _torch_adapter as adapter

__all__ = ["HostValues", "SMALL_FACTORY_NUMEL", "image_text_batch"]

#: Factory outputs up to this many elements are made real (index grids of a vision tower, position ranges of a
#: sequence); larger ones (a full attention mask) stay fake unless made from real inputs.
SMALL_FACTORY_NUMEL = 1 << 16


def _is_real(t: torch.Tensor) -> bool:
    return not isinstance(t, adapter.FakeTensor) and t.device.type != "meta"


class HostValues(adapter.TorchDispatchMode):
    """Runs ops on real tensors for real under a fake mode (see the module docstring). Enter it above the
    StorageTracker (after it), so that the tracker sees what it runs."""

    def __init__(self, tracker: Any, *, fake: bool) -> None:
        super().__init__()
        self.tracker = tracker
        self.fake = fake  #: a real run has nothing to do
        self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (self.active and self.fake):
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors:
            if all(_is_real(t) for t in tensors):
                with adapter.outside_fake_mode():
                    return func(*args, **kwargs)
            if func in _MASK_INDEXED and any(_is_real(t) and t.dtype == torch.bool for t in tensors):
                args = (args[0], self._positions(args[1]), *args[2:])
            return func(*args, **kwargs)
        # a factory: its size, from a run the tracker does not record
        paused, self.tracker.paused = self.tracker.paused, True
        try:
            probe = func(*args, **kwargs)
        finally:
            self.tracker.paused = paused
        small = isinstance(probe, adapter.FakeTensor) and probe.numel() <= SMALL_FACTORY_NUMEL
        del probe
        if small:
            with adapter.outside_fake_mode():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _positions(self, indices: Any) -> list:
        """`indices` with each real boolean mask replaced by the long positions of its True elements (real, made
        outside the fake mode and not recorded: the op itself turns a mask into them inside its kernel, where the
        real run's dispatch sees no allocation either)."""
        out = []
        paused, self.tracker.paused = self.tracker.paused, True
        try:
            with adapter.outside_fake_mode():
                for index in indices:
                    if isinstance(index, torch.Tensor) and _is_real(index) and index.dtype == torch.bool:
                        out.extend(index.nonzero().unbind(1))
                    else:
                        out.append(index)
        finally:
            self.tracker.paused = paused
        return out


def _mask_indexed_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                      aten._index_put_impl_.default})


#: Ops that take a list of indices, where a boolean mask stands for the positions of its True elements (ATen's
#: `expandTensors`: `mask.nonzero()`, one index tensor per mask dimension): Qwen3-VL's `_deepstack_process` reads
#: and writes `hidden_states[visual_pos_masks, :]`, a fake tensor indexed by the real mask of its image positions.
#: A FakeTensor cannot run `nonzero` (its output size is data-dependent), so a real mask is handed to the op as
#: the positions it selects, which give the op's output the size the real run's has.
_MASK_INDEXED = _mask_indexed_ops()


def image_text_batch(example: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """What a vision-language collator (TRL's DataCollatorForVisionLanguageModeling, the Qwen-VL fine-tuning
    recipes) hands the model for `batch` copies of the processor's one-example output: each tensor concatenated on
    its first axis, as the processor concatenates examples (`input_ids` [B, S], Qwen's patches [B x N, 1176] and
    `image_grid_thw` [B x images, 3]), and `labels`, a copy of `input_ids` (the collators mask padding and image
    tokens with -100, which changes no tensor's size), unless the processor made the labels itself (PaliGemma's:
    its suffix, the prefix -100, as its fine-tuning recipes hand them on). Real tensors, made outside the fake
    mode: the model reads their values on the host."""
    with adapter.outside_fake_mode():
        out = {name: torch.cat([t] * batch) if t.dim() else t.clone() for name, t in example.items()}
        if "labels" not in out:
            out["labels"] = out["input_ids"].clone()
    return out
