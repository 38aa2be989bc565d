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
- GRPOTrainer under memfit.fit (memfit.fitting.grpo_recovery): `GRPOTrainer._prepare_inputs` (generation, scoring
  and the buffer of `steps_per_generation` micro-batches), `_generate_single_turn` and
  `_get_per_token_logps_and_entropies` (wrapped on the instance, so that an OOM in them can be retried smaller),
  `_tokenize_prompts` (the prompt lengths for preflight), `GRPOTrainer.training_step`'s bookkeeping (`_step`, the
  `step_time` metric; `grpo_micro_step` runs `Trainer.training_step` on a prepared micro-batch instead), and the
  attributes that decide whether a micro-batch can be chunked (`loss_type`, `_entropy_bonus_enabled`,
  `top_entropy_quantile`, `aux_loss_enabled`, `use_vllm`, `use_transformers_continuous_batching`, `rollout_func`).
- RLOOTrainer under memfit.fit (memfit.fitting.rloo_recovery): the same `_prepare_inputs`, `training_step`
  bookkeeping, `_get_per_token_logps_and_entropies` and `_tokenize_prompts` as GRPOTrainer's (rloo_trainer.py: the
  same code), its own `_generate_single_turn(prompt_ids, images, multimodal_fields)` (no `num_generations`, returns
  the completion ids only), and `rloo_state`'s attributes (`aux_loss_enabled`, `use_vllm`,
  `use_transformers_continuous_batching`, `beta`).
- RLOOTrainer / KTOTrainer (memfit.sim.rloo_steps, memfit.sim.kto_steps): their fused heads' outputs
  (`RLOO_FUSED_OUTPUTS`, `KTO_FUSED_OUTPUTS`), `trl.trainer.utils.nanstd` (RLOO's group standard deviation).
- DistillationTrainer (memfit.sim.distill_steps): `trl.kernels.chunked_divergence.ChunkedDivergenceFunction`
  (`chunked_divergence`), and `divergence_kernels()`, which replaces the torch fallbacks of its Triton kernels
  (`_stats_tile`, `_jsd_tile`, `_backward_tile`), its `_addmm_fp32` and `_project` by what the CUDA path allocates.
- DistillationTrainer under memfit.fit (memfit.fitting.distill_recovery): the same `_prepare_inputs` buffer (`_step`,
  `_buffered_inputs`) and `training_step` bookkeeping as GRPOTrainer's (distillation_trainer.py: the same code, so
  `grpo_prepare_inputs` / `grpo_micro_step` / `grpo_step_done` serve it), `_tokenize_prompts` (the prompt lengths),
  its own `_generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images=False)` (returns the
  completion ids only), and `distill_state`'s attributes (`use_vllm`, `_is_vlm`, `tools`, `teacher_model`).
- trainer attributes read by preflight: `SFTTrainer.padding_free` (bfd packing implies it),
  `SFTTrainer.completion_only_loss`, `DPOTrainer.ref_model`, `DPOTrainer.precompute_ref_logps`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

__all__ = ["tokenize", "add_fused_lm_head", "cuda_kernels", "trainer_kind", "sft_state", "dpo_state", "dpo_example_lengths",
           "SFT_FUSED_OUTPUTS", "DPO_FUSED_OUTPUTS", "GRPO_FUSED_OUTPUTS", "RLOO_FUSED_OUTPUTS", "KTO_FUSED_OUTPUTS", "nanstd",
           "divergence_kernels", "chunked_divergence", "grpo_log_probs", "shuffle_sequence_dict",
           "split_tensor_dict", "disable_gradient_checkpointing", "grpo_state", "rloo_state", "distill_state", "grpo_prompt_lengths",
           "grpo_prepare_inputs", "grpo_micro_step", "grpo_step_done", "wrap_grpo_method", "grpo_reward_models"]

#: `outputs=` of add_fused_lm_head in SFTTrainer.__init__ and DPOTrainer.__init__ (TRL 1.16).
SFT_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")
DPO_FUSED_OUTPUTS = ("log_probs",)
GRPO_FUSED_OUTPUTS = ("log_probs", "entropy")
#: `outputs=` of add_fused_lm_head in RLOOTrainer.__init__ (as GRPOTrainer) and KTOTrainer.__init__ (TRL 1.16); their
#: reference models get the default `("log_probs",)`.
RLOO_FUSED_OUTPUTS = ("log_probs", "entropy")
KTO_FUSED_OUTPUTS = ("log_probs", "entropy", "mean_logits")


def grpo_log_probs(trainer_view: Any, model: Any, *args: Any, **kwargs: Any):
    """`GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)`."""
    from trl import GRPOTrainer

    # the method without TRL's `profiling_decorator` (a timer that reads the trainer's state and arguments)
    method = inspect.unwrap(GRPOTrainer._get_per_token_logps_and_entropies)
    return method(trainer_view, model, *args, **kwargs)


def nanstd(tensor: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """`trl.trainer.utils.nanstd` (RLOOTrainer's group standard deviation, NaNs ignored)."""
    from trl.trainer.utils import nanstd as _nanstd

    return _nanstd(tensor, dim=dim, keepdim=keepdim)


def shuffle_sequence_dict(batch: dict) -> dict:
    from trl.trainer.utils import shuffle_sequence_dict as _shuffle

    return _shuffle(batch)


def split_tensor_dict(batch: dict, chunks: int) -> list[dict]:
    from trl.trainer.utils import split_tensor_dict as _split

    return _split(batch, chunks)


def disable_gradient_checkpointing(model: Any, kwargs: dict | None):
    from trl.models.utils import disable_gradient_checkpointing as _off

    return _off(model, kwargs)


def add_fused_lm_head(model: Any, outputs: tuple[str, ...], **kwargs: Any) -> None:
    """TRL's fused LM head on `model` (a PreTrainedModel, before peft wraps it, as SFTTrainer does)."""
    from trl.trainer.utils import add_fused_lm_head as _add

    _add(model, outputs=outputs, **kwargs)


def rebind_fused_lm_head(model_copy: Any) -> None:
    """Re-add TRL's fused LM head on a deep copy of a patched model (memfit.sim.splice's cut model).

    `add_fused_lm_head` keeps the model's `original_forward` (a bound method) in a closure, which `copy.deepcopy`
    shares: the copy's non-fused path (`fused_lm_head=False`: generation, evaluation) would run the original model.
    Each patched module of the copy is patched again, with the settings read from the closure."""
    for module in model_copy.modules():
        fn = module.__dict__.get("forward")
        func = getattr(fn, "__func__", None)
        if func is None or func.__code__.co_name != "_fused_forward":  # functools.wraps renamed it `forward`
            continue
        settings = inspect.getclosurevars(func).nonlocals
        del module.forward
        add_fused_lm_head(module, temperature=settings.get("temperature", 1.0),
                          cast_lm_head_to_fp32=settings.get("cast_lm_head_to_fp32", False),
                          outputs=settings.get("outputs", DPO_FUSED_OUTPUTS))


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


def _project_cuda(tile: Any, hidden_chunk: Any, weight: Any, bias: Any, start: int, end: int, dtype: Any) -> None:
    """`trl.kernels.chunked_divergence._project` as it allocates on CUDA: the head's rows cast to the compute dtype
    (`weight[start:end].to(dtype)`), then `torch.mm(..., out_dtype=float32, out=tile)` writing into the tile (the
    CPU path's `hidden.float()` / `w.float()` copies do not exist there); the bias added in place."""
    w = weight[start:end].to(dtype).t()
    del w
    if bias is not None:
        tile.add_(bias[start:end].float())


@contextlib.contextmanager
def divergence_kernels() -> Iterator[None]:
    """While inside, DistillationTrainer's chunked divergence (`trl.kernels.chunked_divergence`) allocates what its
    CUDA path allocates: the Triton kernels `_stats_kernel` / `_jsd_kernel` / `_backward_kernel` fold each
    `[4096, 32768]` tile in registers (their torch fallbacks `_stats_tile`, `_jsd_tile`, `_backward_tile` allocate
    tile-sized temporaries), `_addmm_fp32` accumulates in place, `_project` as `_project_cuda`."""
    import trl.kernels.chunked_divergence as cd

    patches = {"_stats_tile": _no_alloc, "_jsd_tile": _no_alloc, "_backward_tile": _no_alloc,
               "_addmm_fp32": _no_alloc, "_project": _project_cuda}
    saved = {n: getattr(cd, n) for n in patches}
    try:
        for n, fn in patches.items():
            setattr(cd, n, fn)
        yield
    finally:
        for n, fn in saved.items():
            setattr(cd, n, fn)


def chunked_divergence(*args: Any) -> Any:
    """`trl.kernels.chunked_divergence.ChunkedDivergenceFunction.apply` (the autograd function of
    DistillationTrainer's loss, `_chunked_divergence_loss`)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    return ChunkedDivergenceFunction.apply(*args)


def trainer_kind(trainer: Any) -> str:
    """`sft`, `dpo`, `grpo`, `rloo`, `reward`, `kto`, `distill` or `trainer` for a trainer object, by class (TRL need not be
    importable)."""
    names = {c.__name__ for c in type(trainer).__mro__}
    for cls, kind in (("SFTTrainer", "sft"), ("DPOTrainer", "dpo"), ("GRPOTrainer", "grpo"), ("RLOOTrainer", "rloo"),
                      ("RewardTrainer", "reward"), ("KTOTrainer", "kto"), ("DistillationTrainer", "distill")):
        if cls in names:
            return kind
    # MemfitCallback sees no trainer, only its arguments: SFTConfig / DPOConfig say which trainer it is
    arg_names = {c.__name__ for c in type(getattr(trainer, "args", None)).__mro__}
    for cls, kind in (("SFTConfig", "sft"), ("DPOConfig", "dpo"), ("GRPOConfig", "grpo"), ("RLOOConfig", "rloo"),
                      ("RewardConfig", "reward"), ("KTOConfig", "kto"), ("DistillationConfig", "distill")):
        if cls in arg_names:
            return kind
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


def reward_example_lengths(dataset: Any, limit: int = 200_000) -> list[int] | None:
    """Per pair of a prepared RewardTrainer dataset, the longer of chosen and rejected (the prompt is already in
    each; reward_trainer.py `_prepare_dataset` drops pairs longer than max_length rather than truncating them)."""
    try:
        cols = {k: dataset[k][:limit] for k in ("chosen_ids", "rejected_ids")}
    except Exception:
        return None
    return [max(len(c), len(r)) for c, r in zip(cols["chosen_ids"], cols["rejected_ids"])] or None


def kto_example_lengths(dataset: Any, max_length: int | None, limit: int = 200_000) -> list[int] | None:
    """Per example of a prepared KTOTrainer dataset, the longer of prompt+completion and prompt+KL completion (the
    KL batch's, when the loss has one), truncated to `max_length` as DataCollatorForUnpairedPreference truncates
    each sequence (kto_trainer.py `torch_call`)."""
    try:
        names = set(dataset.column_names)
        cols = {k: dataset[k][:limit] for k in ("prompt_ids", "completion_ids", "KL_completion_ids") if k in names}
    except Exception:
        return None
    if "prompt_ids" not in cols or "completion_ids" not in cols:
        return None
    kl = cols.get("KL_completion_ids") or [[] for _ in cols["prompt_ids"]]
    out = []
    for p, c, k in zip(cols["prompt_ids"], cols["completion_ids"], kl):
        n = len(p) + max(len(c), len(k))
        out.append(min(n, max_length) if max_length else n)
    return out or None


def tokenize(tokenizer: Any, value: Any) -> list[int]:
    """The token ids TRL's dataset preparation gives `value` (a string, or a list of chat messages)."""
    from trl.data_utils import _tokenize

    return list(_tokenize(tokenizer, value)["input_ids"])


# -- GRPOTrainer under memfit.fit (TRL 1.16 grpo_trainer.py) ------------------------------------------------

def grpo_state(trainer: Any) -> dict[str, Any]:
    """What a GRPOTrainer decided in __init__ that decides how memfit may split its work (TRL 1.16 attributes)."""
    args = trainer.args
    return {
        "loss_type": getattr(trainer, "loss_type", getattr(args, "loss_type", "dapo")),
        "num_generations": int(getattr(trainer, "num_generations", args.num_generations)),
        "steps_per_generation": int(args.steps_per_generation),
        "generation_batch_size": int(args.generation_batch_size),
        "num_iterations": int(getattr(trainer, "num_iterations", getattr(args, "num_iterations", 1))),
        "max_completion_length": int(args.max_completion_length),
        # grpo_trainer.py __init__: entropy_coef != 0 or use_adaptive_entropy
        "entropy_bonus": bool(getattr(trainer, "_entropy_bonus_enabled", False)),
        "top_entropy_quantile": float(getattr(trainer, "top_entropy_quantile", 1.0)),
        "aux_loss": bool(getattr(trainer, "aux_loss_enabled", False)),
        "use_vllm": bool(getattr(trainer, "use_vllm", False)),
        "continuous_batching": bool(getattr(trainer, "use_transformers_continuous_batching", False)),
        "rollout_func": getattr(trainer, "rollout_func", None) is not None,
        "environments": getattr(trainer, "environment_factories", None) is not None,
        "has_ref_model": getattr(trainer, "ref_model", None) is not None,
    }


def rloo_state(trainer: Any) -> dict[str, Any]:
    """What an RLOOTrainer decided in __init__ that decides how memfit may split its work (TRL 1.16 rloo_trainer.py
    attributes; RLOOConfig has no loss_type, entropy bonus or top_entropy_quantile: `_compute_loss` is a mean over the
    micro-batch's completions of their per-sequence losses)."""
    args = trainer.args
    return {
        "num_generations": int(getattr(trainer, "num_generations", args.num_generations)),
        "steps_per_generation": int(args.steps_per_generation),
        "generation_batch_size": int(args.generation_batch_size),
        "num_iterations": int(getattr(trainer, "num_iterations", getattr(args, "num_iterations", 1))),
        "max_completion_length": int(args.max_completion_length),
        "beta": float(getattr(trainer, "beta", args.beta)),
        "aux_loss": bool(getattr(trainer, "aux_loss_enabled", False)),
        "use_vllm": bool(getattr(trainer, "use_vllm", False)),
        "continuous_batching": bool(getattr(trainer, "use_transformers_continuous_batching", False)),
        "has_ref_model": getattr(trainer, "ref_model", None) is not None,
    }


def grpo_prompt_lengths(trainer: Any, limit: int = 2_000, chunk: int = 256) -> list[int] | None:
    """Token lengths of the training prompts as GRPOTrainer tokenizes them for generation (`_tokenize_prompts`:
    the chat template with the generation prompt for conversational prompts, the processing class for text);
    None where the trainer cannot say (environments, no `prompt` column)."""
    if getattr(trainer, "environment_factories", None) is not None:
        return None
    try:
        prompts = list(trainer.train_dataset["prompt"][:limit])
    except Exception:
        try:
            prompts = [trainer.train_dataset[i]["prompt"] for i in range(min(limit, len(trainer.train_dataset)))]
        except Exception:
            return None
    tokenize = getattr(trainer, "_tokenize_prompts", None)
    if tokenize is None:  # MemfitCallback's view of the trainer: the same two calls `_tokenize_prompts` makes
        tok = getattr(trainer, "processing_class", None)
        if tok is None:
            return None

        def tokenize(batch):
            from trl.data_utils import is_conversational

            if is_conversational({"prompt": batch[0]}):
                out = tok.apply_chat_template(conversation=batch, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)
            else:
                out = tok(text=batch)
            return out["input_ids"], None, {}
    lengths: list[int] = []
    try:
        for start in range(0, len(prompts), chunk):
            ids, _, _ = tokenize(prompts[start:start + chunk])
            lengths.extend(len(x) for x in ids)
    except Exception:
        return None
    return lengths or None


def grpo_prepare_inputs(trainer: Any, model: Any, generation_batch: Any) -> dict[str, Any]:
    """`GRPOTrainer._prepare_inputs`: generates and scores a generation batch when one is due, and returns the
    micro-batch of this micro-step from its buffer (`_buffered_inputs[_step % steps_per_generation]`). The model
    (and a schedule-free optimizer) are put in training mode first, as `Trainer.training_step` does before it
    calls `_prepare_inputs`: GRPOTrainer picks train or eval by `self.model.training`."""
    model.train()
    if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
        trainer.optimizer.train()
    return trainer._prepare_inputs(generation_batch)


def grpo_micro_step(trainer: Any, model: Any, prepared: dict[str, Any], num_items_in_batch: Any):
    """`Trainer.training_step` (forward, loss, backward) on a micro-batch `_prepare_inputs` already prepared:
    GRPOTrainer.training_step is `Trainer.training_step` plus `grpo_step_done`, and Trainer.training_step calls
    `self._prepare_inputs`, which is made the identity for this call (an instance attribute, removed after)."""
    from transformers import Trainer

    trainer._prepare_inputs = lambda inputs: inputs
    try:
        return Trainer.training_step(trainer, model, prepared, num_items_in_batch)
    finally:
        del trainer._prepare_inputs


def grpo_step_done(trainer: Any, seconds: float) -> None:
    """The bookkeeping GRPOTrainer.training_step does after a micro-step (grpo_trainer.py `training_step`): `_step`
    advances (it picks the buffered micro-batch and decides when to generate) and `step_time` is logged once per
    accumulation window."""
    trainer._step += 1
    trainer._current_train_step_time += seconds
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0


#: GRPOTrainer (and RLOOTrainer) methods memfit.fit wraps on the instance: the one generate call of a batch, the
#: log-prob passes.
GRPO_WRAPPED = ("_generate_single_turn", "_get_per_token_logps_and_entropies")


def wrap_grpo_method(trainer: Any, name: str, make: Any):
    """Replace `trainer.<name>` (one of GRPO_WRAPPED) by `make(original)` on the instance; returns the undo, which
    puts back what the instance had (a caller's own wrapper on the instance stays after the run)."""
    if name not in GRPO_WRAPPED:
        raise ValueError(f"{name} is not a GRPOTrainer / RLOOTrainer method memfit wraps")
    own = name in vars(trainer)
    original = getattr(trainer, name)
    setattr(trainer, name, make(original))

    def undo() -> None:
        if own:
            setattr(trainer, name, original)
        elif name in vars(trainer):
            delattr(trainer, name)

    return undo


def grpo_reward_models(trainer: Any) -> list[tuple[int, Any, Any]]:
    """(index, model, processing class) of each reward *model* of a GRPOTrainer (`reward_funcs` /
    `reward_processing_classes` as GRPOTrainer.__init__ leaves them: the reward model's own tokenizer where none
    was given)."""
    import torch

    funcs = list(getattr(trainer, "reward_funcs", None) or [])
    classes = list(getattr(trainer, "reward_processing_classes", None) or [None] * len(funcs))
    return [(i, f, c) for i, (f, c) in enumerate(zip(funcs, classes))
            if isinstance(f, torch.nn.Module) and c is not None]


# -- DistillationTrainer under memfit.fit (TRL 1.16 distillation_trainer.py) ----------------------------------------

def distill_state(trainer: Any) -> dict[str, Any]:
    """What a DistillationTrainer decided in __init__ that decides how memfit may split its work (TRL 1.16
    attributes). Its generation batch is `per_device_train_batch_size x gradient_accumulation_steps` prompts (one
    completion each, `_get_train_sampler`), buffered as `gradient_accumulation_steps` micro-batches."""
    args = trainer.args
    teacher = getattr(trainer, "teacher_model", None)
    return {
        "generation_batch_size": int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps),
        "steps_per_generation": int(args.gradient_accumulation_steps),
        "num_generations": 1,
        "max_completion_length": int(args.max_completion_length),
        "beta": float(getattr(trainer, "beta", args.beta)),
        "use_vllm": bool(getattr(trainer, "use_vllm", False)),
        "vlm": bool(getattr(trainer, "_is_vlm", False)),
        "tools": bool(getattr(trainer, "tools", None)),
        "teacher": teacher,
    }
