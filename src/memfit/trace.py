"""The allocation trace the simulator records and the allocator model replays.

One event per storage allocation or free on the (single) CUDA stream, in program
order, with the shape and dtype of the tensor that created the storage. Sizes are the bytes the tensor storage asks for (`nbytes`), before the
caching allocator's 512-byte rounding (c10/cuda/CUDACachingAllocator.cpp,
`round_size`), which is the allocator model's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["TraceEvent", "CATEGORIES", "PHASES", "TRAIN_PHASES", "REPORT_PHASES", "RUN_PHASES", "DIAGNOSED_PHASES",
           "FAILURE_PHASES", "SETUP", "FORWARD", "BACKWARD", "OPTIMIZER", "EVAL", "SAVE", "LOAD_BEST", "RESUME",
           "DATA_COLLATION", "MODEL_LOADING", "UNKNOWN", "TRAINING", "FINAL_EVAL", "FINAL_SAVE", "GENERATION", "SCORING",
           "RL_PHASES"]

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

# The one vocabulary of phases: every part of memfit names a phase with these constants.
SETUP = "setup"  #: building the model and the optimizer, before the first step
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"  #: the optimizer step (with gradient clipping)
EVAL = "eval"  #: the evaluation / prediction loop
SAVE = "save"  #: saving a checkpoint or the model
LOAD_BEST = "load_best"  #: Trainer's `_load_best_model` at the end of training
#: Trainer.train(resume_from_checkpoint=...) loading a checkpoint: the weights into the model being trained
#: (`_load_from_checkpoint`), the optimizer and scheduler, the scaler and the RNG state
RESUME = "resume"
DATA_COLLATION = "data_collation"  #: building a batch
MODEL_LOADING = "model_loading"  #: loading the model, moving it to the GPU
UNKNOWN = "unknown"  #: no traceback frame says
TRAINING = "train"  #: somewhere inside `Trainer.train`, no frame saying more
FINAL_EVAL = "final_eval"  #: memfit.fit's evaluation after `Trainer.train` returned
FINAL_SAVE = "final_save"  #: `memfit train`'s save of the final model
GENERATION = "generation"  #: GRPO: the completions generated with transformers' `generate` (no_grad, KV cache)
SCORING = "scoring"  #: GRPO: the old / reference log-probs of the generated completions (no_grad)
#: The phases an RL trainer adds before its training micro-steps (memfit.sim.grpo_steps).
RL_PHASES = (GENERATION, SCORING)

#: The simulator records PHASES; an estimate reports REPORT_PHASES; memfit.fit measures (and predicts)
#: RUN_PHASES, which add checkpoint saving and loading the best model; diagnose places an OOM in one of
#: DIAGNOSED_PHASES, which add what a traceback can show outside the training loop; a failed run's report
#: names one of FAILURE_PHASES, which add where the caller was when no frame says more.
PHASES = (SETUP, FORWARD, BACKWARD, OPTIMIZER, EVAL) + RL_PHASES
TRAIN_PHASES = (FORWARD, BACKWARD, OPTIMIZER)
REPORT_PHASES = TRAIN_PHASES + (EVAL,)
RUN_PHASES = REPORT_PHASES + (SAVE, LOAD_BEST)
DIAGNOSED_PHASES = RUN_PHASES + (RESUME, DATA_COLLATION, MODEL_LOADING, UNKNOWN)
FAILURE_PHASES = DIAGNOSED_PHASES[:-1] + (TRAINING, FINAL_EVAL, FINAL_SAVE)


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One allocation (`action="alloc"`) or free (`action="free"`) of a storage."""

    action: Literal["alloc", "free", "empty_cache"]
    id: int  #: storage id, unique within one trace; a free names the id of its alloc
    size_bytes: int  #: requested bytes (0 for `empty_cache`)
    category: str = "temporaries"
    phase: str = SETUP
    module: str = ""  #: module path active when the storage was allocated
    #: shape and dtype of the tensor whose op created the storage (None: a storage the simulation knows only
    #: the size of: evaluation buffers, cuBLAS workspaces, DDP buckets, DeepSpeed's buffers)
    shape: tuple[int, ...] | None = None
    dtype: str | None = None  #: e.g. "float16"
