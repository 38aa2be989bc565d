"""What a windowed vision tower costs the simulation itself: host memory and time, before it runs.

Qwen2.5-VL's vision tower attends within windows in all its blocks but `fullatt_block_indexes`: with eager or
SDPA attention, `Qwen2_5_VLVisionAttention.forward` splits queries, keys and values by `cu_seqlens` and runs one
attention per window (transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py, `torch.split(..., lengths.tolist())`;
flash-attention 2 runs one varlen call instead). The simulator records every op of every window, and that stack is
simulated whole (memfit.sim.splice `_uniform`: its full-attention blocks break the uniformity a splice needs), so
the trace, the fake tensors and the autograd graph grow with windows x windowed blocks x examples, and the
processor's real patches (memfit.sim.host_values) with the patches. A 16-frame 1024x1024 clip at batch 8 on
Qwen2.5-VL-7B is 6,400 windows in each of 28 windowed blocks: its `memfit estimate` was seen past 22 GB of host
memory after 8 minutes.

`vision_window_cost` counts the windows as `get_vision_window_index` makes them (transformers/vision_utils.py:
`vit_merger_window_size = window_size // spatial_merge_size // patch_size` merged patches a side, the padded grid's
empty windows dropped by `unique_consecutive`) and prices them with the figures below, measured on this machine
(2 CPU cores, torch 2.13 and transformers 5.24 unless said) with `memfit.sim.engine.simulate(..., fake=True)` (two optimizer steps of
one micro-step each, bf16) under `/usr/bin/time` / `resource.getrusage` peak RSS:

* the bundled Qwen2.5-VL-7B-Instruct (28 windowed blocks), a 16-frame 1024x1024 clip (`video_grid_thw`
  [8, 74, 74]: 43,808 patches, 800 windows), batch 1, in a venv with torchvision (torch 2.14): 2,437 MB against
  513 MB before the simulation, 846,399 trace events (37.8 per window and windowed block), 215 s;
* the bundled Qwen2.5-VL-3B-Instruct, one image per example, batch 1: 896x896 (4,096 patches, 64 windows)
  596 MB, 108,731 events, 27 s; 1792x1792 (16,384 patches, 256 windows) 880 MB, 302,267 events, 75 s (an 8-frame
  896x896 clip, as many patches and windows: 302,711 events, 1,138 MB against 512 MB before);
* a tiny Qwen2.5-VL (width 32 vision, one full-attention block), 1792x1792, batch 1: 3 windowed blocks 694 MB,
  32,291 events; 7 windowed blocks 722 MB, 72,051 events; 3584x3584 batch 2 (131,072 patches, 2,048 windows)
  2,363 MB, 226,031 events, 95 s.

Events grow linearly with windows x windowed blocks (37 to 39 per window and windowed block in every run), memory
and time with them and the patches. `memfit estimate` then
replays the trace through the allocator, which these figures leave out (the tiny model at 1792x1792 batch 4:
1,275 MB for the whole command against 1,208 MB for the simulation alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.units import format_bytes

__all__ = ["VisionWindowCost", "vision_window_cost", "BYTES_PER_WINDOW_BLOCK", "BYTES_PER_PATCH",
           "SECONDS_PER_WINDOW_BLOCK", "MEASURED_WINDOW_BLOCKS"]

#: Host memory per window and windowed block (all micro-steps of a simulation together): the 7B clip's 1,924 MB
#: over its 22,400 window-blocks, less its patches' share (43,808 x BYTES_PER_PATCH): 62 KB, the largest measured
#: (the tiny model's 3 -> 7 windowed blocks at 256 windows: 28 KB; the 3B's 64 -> 256 windows: 32 KB).
BYTES_PER_WINDOW_BLOCK = 62 * 1024
#: Host memory per vision patch (the processor's float32 patches and their copies: 1,176 values a patch): the tiny
#: model's 1792x1792 batch 1 -> 3584x3584 batch 2, +1,669 MB over 114,688 more patches less 5,376 more
#: window-blocks' share at 32 KB: 13.4 KB (its batch 1 -> 4 at 1792x1792 gives 9.3 KB).
BYTES_PER_PATCH = 13_400
#: Simulation time per window and windowed block: the 7B clip, 215 s over 22,400 window-blocks (the 3B's 64 -> 256
#: windows: 48 s over 5,376).
SECONDS_PER_WINDOW_BLOCK = 0.0096
#: The most window-blocks memfit has simulated and measured (the 7B clip above: 800 windows x 28 blocks, 2.4 GB);
#: beyond it the simulation says what it will take.
MEASURED_WINDOW_BLOCKS = 800 * 28


@dataclass(frozen=True)
class VisionWindowCost:
    """What the vision tower's windows cost the simulation of one micro-batch size."""

    windows: int  #: attention windows of all examples of a micro-batch
    windowed_blocks: int  #: vision blocks that attend in windows
    patches: int  #: vision patches of a micro-batch
    host_bytes: int  #: host memory the simulation's windows and patches take (the figures above; the
    #: allocator's replay of the trace and the model's own share come on top)
    seconds: float  #: simulation time they take

    @property
    def window_blocks(self) -> int:
        return self.windows * self.windowed_blocks

    def note(self) -> str | None:
        """A one-line note when this is beyond what memfit has measured, else None."""
        if self.window_blocks <= MEASURED_WINDOW_BLOCKS:
            return None
        return (f"the vision tower attends in {self.windows:,} windows in each of {self.windowed_blocks} blocks "
                f"({self.patches:,} patches): simulating them takes about {format_bytes(self.host_bytes)} of host "
                f"memory and {self.seconds / 60:.0f} min (memfit.sim.vision_windows); fewer frames, a smaller "
                f"--image-size or --batch-size take less, and flash-attention 2 runs one call per block")


def vision_window_cost(config: Any, example: dict, batch: int, attn_implementation: str | None) -> \
        VisionWindowCost | None:
    """The windows of `batch` copies of the processor's `example` (its `image_grid_thw` / `video_grid_thw`) in the
    vision tower of `config`; None for a tower without windows or one that attends in one call (flash-attention)."""
    vision = getattr(config, "vision_config", None)
    window_size = getattr(vision, "window_size", None)
    full = getattr(vision, "fullatt_block_indexes", None)
    if not window_size or full is None or (attn_implementation or "").startswith("flash_attention"):
        return None
    merge, patch = vision.spatial_merge_size, vision.patch_size
    side = window_size // merge // patch  # get_vision_window_index's vit_merger_window_size
    windows = patches = 0
    for name in ("image_grid_thw", "video_grid_thw"):
        grid = example.get(name)
        for t, h, w in ([] if grid is None else grid.tolist()):
            windows += t * -(-(h // merge) // side) * -(-(w // merge) // side)
            patches += t * h * w
    if not windows:
        return None
    windowed = vision.depth - len(full)
    window_blocks = windows * batch * windowed
    return VisionWindowCost(windows * batch, windowed, patches * batch,
                            window_blocks * BYTES_PER_WINDOW_BLOCK + patches * batch * BYTES_PER_PATCH,
                            window_blocks * SECONDS_PER_WINDOW_BLOCK)
