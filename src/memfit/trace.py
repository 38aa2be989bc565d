"""The allocation trace the simulator records and the allocator model replays.

One event per storage allocation or free on the (single) CUDA stream, in program
order. Sizes are the bytes the tensor storage asks for (`nbytes`), before the
caching allocator's 512-byte rounding (c10/cuda/CUDACachingAllocator.cpp,
`round_size`), which is the allocator model's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["TraceEvent", "CATEGORIES", "PHASES", "TRAIN_PHASES", "REPORT_PHASES", "RUN_PHASES", "DIAGNOSED_PHASES"]

#: Memory categories, after torch.distributed._tools.mem_tracker's `_MemRefType`,
#: split further where a user can act on it.
CATEGORIES = (
    "weights",          # parameters and buffers (incl. frozen / quantized ones)
    "gradients",        # .grad of trainable parameters, alive across accumulation micro-steps
    "optimizer_state",  # exp_avg, exp_avg_sq, step tensors, Adafactor factors, ...
    "activations",      # tensors alive from the forward into the backward (saved for backward)
    "temporaries",      # everything transient: workspaces, grad temporaries, casts, optimizer temps
    "eval_outputs",     # predictions / labels / losses the evaluation loop keeps on the device
    "inputs",           # the batch itself (input_ids, attention_mask, labels)
)

#: The one vocabulary of phases. The simulator records PHASES; an estimate reports REPORT_PHASES;
#: memfit.fit measures (and predicts) RUN_PHASES, which add checkpoint saving and loading the best
#: model; diagnose places an OOM in one of DIAGNOSED_PHASES, which add what a traceback can show
#: outside the training loop.
PHASES = ("setup", "forward", "backward", "optimizer", "eval")
TRAIN_PHASES = ("forward", "backward", "optimizer")
REPORT_PHASES = TRAIN_PHASES + ("eval",)
RUN_PHASES = REPORT_PHASES + ("save", "load_best")
DIAGNOSED_PHASES = RUN_PHASES + ("data_collation", "model_loading", "unknown")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One allocation (`action="alloc"`) or free (`action="free"`) of a storage."""

    action: Literal["alloc", "free", "empty_cache"]
    id: int  #: storage id, unique within one trace; a free names the id of its alloc
    size_bytes: int  #: requested bytes (0 for `empty_cache`)
    category: str = "temporaries"
    phase: str = "setup"
    module: str = ""  #: module path active when the storage was allocated
