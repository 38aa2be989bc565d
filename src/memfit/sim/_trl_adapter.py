"""The one module that touches TRL's private or unstable APIs (TRL 1.16).

Everything memfit needs from TRL internals goes through here, so a TRL upgrade breaks (at most)
this file:

- `trl.trainer.utils.add_fused_lm_head`: the LM head SFTTrainer and DPOTrainer put on the model
  (`model(..., labels=labels, fused_lm_head=True)` returns per-token log-probs, never the
  `[batch, length, vocabulary]` logits). SFTTrainer asks for `("log_probs", "entropy", "is_top1")`
  (sft_trainer.py `__init__`), DPOTrainer for the default `("log_probs",)`.
- `trl.kernels.chunked_logprob._forward_tile`, `_backward_tile`, `_addmm_fp32`: the torch fallbacks of
  the Triton kernels `_forward_kernel` / `_backward_kernel` and of the CUDA `addmm(out_dtype=float32)`.
  On a CUDA GPU with Triton the kernels fold each `[4096, 32768]` logits tile into per-token
  statistics in registers and write the gradient into the tile in place: they allocate nothing.
  The torch fallbacks (what runs on the CPU) allocate several tile-sized fp32 temporaries.
  `cuda_kernels()` replaces them, while a simulation runs, by functions that allocate nothing,
  as the CUDA path does (the values are not computed; the trace is what memfit needs).
- `trl.trainer.utils._use_triton` is left as it is on the CPU: the fused head then scores every
  position (`compact=False`). On CUDA it scores only the positions whose label is not -100
  (`hidden_states[mask]`, a data-dependent shape a FakeTensor cannot have); scoring every position is
  the upper bound, equal when every label counts (no completion-only / assistant-only masking).
- `trl.data_utils._tokenize`: how SFTTrainer / DPOTrainer tokenize one example (the chat template for a
  list of messages, the tokenizer's call for text), for memfit's token lengths of a JSONL file.
- GRPOTrainer (memfit.sim.grpo_steps): `GRPOTrainer._get_per_token_logps_and_entropies` (the real method, on a
  stand-in for the trainer holding the one attribute it reads, `accelerator.autocast`), `trl.trainer.utils
  .shuffle_sequence_dict` / `split_tensor_dict` (the generation buffer), `trl.models.utils
  .disable_gradient_checkpointing` (around generation and scoring). GRPOTrainer asks the fused head for
  `("log_probs", "entropy")` (grpo_trainer.py `__init__`), its reference model for the default.
- trainer attributes read by preflight: `SFTTrainer.padding_free` (bfd packing implies it),
  `SFTTrainer.completion_only_loss`, `DPOTrainer.ref_model`, `DPOTrainer.precompute_ref_logps`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

__all__ = ["tokenize", "add_fused_lm_head", "cuda_kernels", "trainer_kind", "sft_state", "dpo_state", "dpo_example_lengths",
           "SFT_FUSED_OUTPUTS", "DPO_FUSED_OUTPUTS", "GRPO_FUSED_OUTPUTS", "grpo_log_probs", "shuffle_sequence_dict",
           "split_tensor_dict", "disable_gradient_checkpointing"]

#: `outputs=` of add_fused_lm_head in SFTTrainer.__init__ and DPOTrainer.__init__ (TRL 1.16).
SFT_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")
DPO_FUSED_OUTPUTS = ("log_probs",)
GRPO_FUSED_OUTPUTS = ("log_probs", "entropy")


def grpo_log_probs(trainer_view: Any, model: Any, *args: Any, **kwargs: Any):
    """`GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)`."""
    from trl import GRPOTrainer

    # the method without TRL's `profiling_decorator` (a timer that reads the trainer's state and arguments)
    method = inspect.unwrap(GRPOTrainer._get_per_token_logps_and_entropies)
    return method(trainer_view, model, *args, **kwargs)


def shuffle_sequence_dict(batch: dict) -> dict:
    from trl.trainer.utils import shuffle_sequence_dict as _shuffle

    return _shuffle(batch)


def split_tensor_dict(batch: dict, chunks: int) -> list[dict]:
    from trl.trainer.utils import split_tensor_dict as _split

    return _split(batch, chunks)


def disable_gradient_checkpointing(model: Any, kwargs: dict | None):
    from trl.models.utils import disable_gradient_checkpointing as _off

    return _off(model, kwargs)


def add_fused_lm_head(model: Any, outputs: tuple[str, ...]) -> None:
    """TRL's fused LM head on `model` (a PreTrainedModel, before peft wraps it, as SFTTrainer does)."""
    from trl.trainer.utils import add_fused_lm_head as _add

    _add(model, outputs=outputs)


def _no_alloc(*args: Any, **kwargs: Any) -> None:
    """Stands for a Triton kernel / CUDA addmm that writes into buffers it is given and allocates nothing."""
    return None


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """While inside, TRL's chunked log-prob kernels allocate what their CUDA path allocates (see module doc)."""
    import trl.kernels.chunked_logprob as ck

    names = ("_forward_tile", "_backward_tile", "_addmm_fp32")
    saved = {n: getattr(ck, n) for n in names}
    try:
        for n in names:
            setattr(ck, n, _no_alloc)
        yield
    finally:
        for n, fn in saved.items():
            setattr(ck, n, fn)


def trainer_kind(trainer: Any) -> str:
    """`sft`, `dpo` or `trainer` for a trainer object, by class (TRL need not be importable)."""
    names = {c.__name__ for c in type(trainer).__mro__}
    if "SFTTrainer" in names:
        return "sft"
    if "DPOTrainer" in names:
        return "dpo"
    # MemfitCallback sees no trainer, only its arguments: SFTConfig / DPOConfig say which trainer it is
    arg_names = {c.__name__ for c in type(getattr(trainer, "args", None)).__mro__}
    if "SFTConfig" in arg_names:
        return "sft"
    if "DPOConfig" in arg_names:
        return "dpo"
    return "trainer"


def sft_state(trainer: Any) -> dict[str, Any]:
    """What an SFTTrainer decided in __init__ that changes memory (TRL 1.16 attributes)."""
    args = trainer.args
    return {
        "packing": bool(getattr(args, "packing", False)),
        "packing_strategy": getattr(args, "packing_strategy", "bfd") or "bfd",
        # sft_trainer.py: self.padding_free = args.padding_free or (args.packing and strategy in bfd/bfd_split)
        "padding_free": bool(getattr(trainer, "padding_free", getattr(args, "padding_free", False))),
        "completion_only_loss": getattr(trainer, "completion_only_loss", getattr(args, "completion_only_loss", None)),
        "assistant_only_loss": bool(getattr(args, "assistant_only_loss", False)),
    }


def dpo_state(trainer: Any) -> dict[str, Any]:
    """What a DPOTrainer decided in __init__ that changes memory (TRL 1.16 attributes)."""
    return {
        "precompute_ref_log_probs": bool(getattr(trainer, "precompute_ref_logps", False)),
        "has_ref_model": getattr(trainer, "ref_model", None) is not None,
    }


def dpo_example_lengths(dataset: Any, max_length: int | None, limit: int = 200_000) -> list[int] | None:
    """Per pair, the longer of prompt+chosen and prompt+rejected, truncated to `max_length` as
    DataCollatorForPreference truncates each sequence (dpo_trainer.py `torch_call`)."""
    try:
        cols = {k: dataset[k][:limit] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
    except Exception:
        return None
    out = []
    for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"]):
        n = max(len(p) + len(c), len(p) + len(r))
        out.append(min(n, max_length) if max_length else n)
    return out or None


def tokenize(tokenizer: Any, value: Any) -> list[int]:
    """The token ids TRL's dataset preparation gives `value` (a string, or a list of chat messages)."""
    from trl.data_utils import _tokenize

    return list(_tokenize(tokenizer, value)["input_ids"])
