"""TRL's training steps: what SFTTrainer and DPOTrainer (TRL 1.16) run in a micro-step.

memfit.sim.engine runs the Trainer's step; for `setup.trainer` `sft` / `dpo` it asks this module for the
batch and the loss, and everything else (backward, clipping, the optimizer, accumulation) is the
Trainer's, which both TRL trainers inherit.

Both trainers put TRL's fused LM head on the model (`add_fused_lm_head`, memfit.sim._trl_adapter): the
loss is computed from per-token log-probs in `[4096, 32768]` tiles and the `[batch, length, vocab]`
logits are never materialized, unlike the plain Trainer's causal-LM loss.

SFTTrainer (sft_trainer.py, `DataCollatorForLanguageModeling.torch_call`, `compute_loss`):

- padded (no packing, not padding-free): `[B, S]` input_ids / labels / attention_mask, S the longest
  example of the batch. transformers skips the attention mask when it is all ones
  (masking_utils `_ignore_causal_mask_sdpa`); memfit builds it when the worst batch is padded.
- packing `wrapped`: `B` packs of exactly `max_length` tokens, an all-ones mask (no mask is built with
  sdpa), so the kernel sees what a padded batch of `B x max_length` full sequences gives it.
- padding-free (`padding_free=True`, or packing `bfd` / `bfd_split`, which imply it): the batch is
  flattened to one row `[1, T]` of the real tokens with `position_ids` restarting per example, and
  `cu_seq_lens_q/k`, `seq_idx` for varlen kernels; no attention mask. With sdpa or eager, transformers
  sees restarting positions and builds a block-diagonal `[1, 1, T, T]` mask (masking_utils
  `find_packed_sequence_indices`, always taken on FakeTensors, `is_tracing`), so the attention is
  quadratic in T; a varlen kernel (flash_attention_2) attends per example. The attention kernel is the
  model's own code: when memfit emulates flash attention, the varlen path needs nothing here.
- loss: `-log_probs.sum() / label_mask.sum()` of the fused head.

DPOTrainer (dpo_trainer.py `DataCollatorForPreference.torch_call`, `_compute_loss`):

- chosen and rejected concatenated in one forward: `[2B, S]` input_ids / attention_mask /
  completion_mask, S the longest prompt+completion truncated to `max_length` (TRL 1.16 has no
  `max_prompt_length`), labels = input_ids masked where completion_mask is 0.
- the reference: a second frozen copy of the model (weights, no gradients, no optimizer state) run
  under `no_grad`; with peft (`lora_r`) the same model with its adapter disabled (no copy);
  with `precompute_ref_log_probs` no reference forward in the step (its log-probs come with the batch,
  two `[B]` fp32 tensors). The precompute pass before training (a no-grad forward) is not simulated.
- loss: sigmoid DPO `-logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()`.

`activation_offloading=True`: the forward and the loss run inside TRL's offloading context
(`activation_offloading`, memfit.sim.offload's rule of trl/models/activation_offloading.py).

Not simulated: TRL's logging metrics (a few device scalars), SFT / DPO / KTO evaluation (Trainer's evaluation loop
is simulated, with full logits, an upper bound; GRPO's, RLOO's and distillation's evaluation generates:
GENERATING_EVAL, `eval_loss`). Liger (`use_liger_kernel`) applies its layer kernels only, as TRL
applies it (`liger_config`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.inputs.lengths import has_padding
from memfit.sim import _trl_adapter as trl_adapter
from memfit.sim.autocast import cuda_autocast

__all__ = ["liger_config", "prepare_model", "GENERATING_EVAL", "eval_loss",
           "prepare_cut", "build_reference", "materialize_reference", "kernels", "micro_loss", "sft_batch", "activation_offloading",
           "dpo_batch", "wants_splice", "notes", "LOSS_SCALED_FOR_GA"]

#: The trainers that put TRL's fused LM head on the model (RewardTrainer trains a sequence-classification head).
_FUSED_HEAD_TRAINERS = ("sft", "dpo", "grpo", "rloo", "kto")
#: Attention implementations that attend per example on a flattened row (cu_seq_lens), in transformers 5.
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def wants_splice(setup: Any) -> bool:
    """Layer splicing stands the cut model for the full one; DPO's reference forward runs a second model
    whose events the splice would not tag, so DPO is simulated on the full model (GRPO's reference has a cut
    model and a tagger of its own: memfit.sim.grpo_steps)."""
    return setup.trainer not in ("dpo", "kto", "distill")  # KTO: its reference forwards; distill: the teacher's


def notes(setup: Any) -> list[str]:
    out = []
    if setup.trainer == "sft" and setup.is_padding_free and setup.attn_implementation not in VARLEN_ATTENTION:
        attn = f"`{setup.attn_implementation}`" if setup.attn_implementation else "the model's default"
        out.append(f"padding-free SFT batch ({setup.padding_free_tokens} tokens in one row) with "
                   f"{attn} attention: transformers builds a block-diagonal "
                   "[T, T] mask over the row (masking_utils find_packed_sequence_indices), quadratic in T; a varlen "
                   "kernel (attn_implementation='flash_attention_2') attends per example")
    if setup.trainer == "sft" and (setup.completion_only_loss or setup.assistant_only_loss):
        out.append("completion/assistant-only loss: the fused LM head is simulated scoring every position (its CPU "
                   "path); on CUDA it scores only the tokens that count, so the head's memory is an upper bound")
    if setup.trainer == "distill":
        g = setup.per_device_train_batch_size * setup.gradient_accumulation_steps
        out.append(f"DistillationTrainer keeps the teacher `{setup.teacher_model}` in memory (its weights, no gradients "
                   f"or optimizer state) and generates {g} completions of {setup.max_completion_length} tokens every "
                   f"{setup.gradient_accumulation_steps} micro-steps (one per prompt); its loss runs outside autocast "
                   "(TRL's _ForwardRedirection bypasses accelerate's wrapper), in the weights' dtype")
    if setup.trainer in ("sft", "dpo", "kto") and setup.does_eval:
        out.append(f"evaluation of the {setup.trainer.upper()} trainer is simulated as Trainer's (full logits), "
                   "an upper bound: TRL's fused head keeps no logits")
    return out


def liger_config(setup: Any) -> dict | None:
    """The `liger_kernel_config` Liger is applied with. SFTTrainer / DPOTrainer `__init__` (TRL 1.16) set
    `fused_linear_cross_entropy=False` (Liger's fused loss would replace the forward that carries TRL's fused LM
    head, so only Liger's layer kernels apply) and raise ValueError when it is asked for; the same here."""
    config = setup.liger_kernel_config
    if setup.trainer not in _FUSED_HEAD_TRAINERS:  # GRPO / RLOO / KTOTrainer.__init__ refuse it the same way
        return config
    config = dict(config or {})
    if config.get("fused_linear_cross_entropy"):
        raise MemfitError(f"`liger_kernel_config={{'fused_linear_cross_entropy': True}}` with `trainer={setup.trainer!r}`"
                          ": TRL refuses it (it would replace the forward TRL patches with its fused LM head); drop it")
    return {**config, "fused_linear_cross_entropy": False}


def prepare_model(model: nn.Module, setup: Any) -> None:
    """TRL's fused LM head on the (meta) model, before peft wraps it, as SFTTrainer / DPOTrainer do."""
    if setup.trainer != "trainer":
        try:
            import trl  # noqa: F401 - the first use of TRL in a simulation: a hint instead of a traceback
        except ImportError as err:
            raise MemfitError(f"`--trainer {setup.trainer}` simulates TRL's trainer, and TRL is not installed: "
                              "`pip install trl` (or memfit's `llm` extra: `pip install 'memfit[llm]'`)") from err
    if setup.trainer == "sft":
        trl_adapter.add_fused_lm_head(model, trl_adapter.SFT_FUSED_OUTPUTS)
    elif setup.trainer == "dpo":
        trl_adapter.add_fused_lm_head(model, trl_adapter.DPO_FUSED_OUTPUTS)
    elif setup.trainer == "grpo":
        trl_adapter.add_fused_lm_head(model, trl_adapter.GRPO_FUSED_OUTPUTS)
    elif setup.trainer == "rloo":
        trl_adapter.add_fused_lm_head(model, trl_adapter.RLOO_FUSED_OUTPUTS)
    elif setup.trainer == "kto":
        trl_adapter.add_fused_lm_head(model, trl_adapter.KTO_FUSED_OUTPUTS)
    # reward: a sequence-classification head, no fused LM head (reward_trainer.py)


def prepare_cut(*cuts: nn.Module | None) -> None:
    """The cut models (memfit.sim.splice) of a model with TRL's fused LM head: the head patched again on each, so
    that its non-fused forward (generation, evaluation) runs the cut model, not the one it was copied from."""
    for cut in cuts:
        if cut is not None:
            trl_adapter.rebind_fused_lm_head(cut)


def kernels(setup: Any):
    """The context a TRL simulation runs in: TRL's log-prob kernels allocate as on CUDA."""
    if setup.trainer == "distill":  # DistillationTrainer's chunked divergence (memfit.sim.distill_steps)
        return trl_adapter.divergence_kernels()
    return trl_adapter.cuda_kernels() if setup.trainer in _FUSED_HEAD_TRAINERS else contextlib.nullcontext()


#: The trainers whose `compute_loss` already scales the loss for gradient accumulation (TRL 1.16
#: `loss_is_scaled_for_ga = True`: grpo_trainer.py, distillation_trainer.py), so Trainer does not divide it.
LOSS_SCALED_FOR_GA = ("grpo", "distill")


#: The autocast dtype of each precision (memfit.sim.engine `_LOW`): what a flash-attn kernel sees.
_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _frozen_model(setup: Any, spec: Any) -> nn.Module:
    """A second model of `setup` on the meta device (DPO's reference, the teacher), built as
    memfit.sim.prepare.build_model builds the trained one: with flash-attn, built with sdpa and then switched to the
    emulated kernels (`use_flash_attention`: transformers refuses to build it where flash-attn is not installed)."""
    from memfit.models.build import build_meta_model

    attn = setup.attn_implementation
    flash = attn is not None and attn not in ("eager", "sdpa", "flex_attention")
    model = build_meta_model(setup.replace(attn_implementation="sdpa") if flash else setup, spec)
    if flash:
        from memfit.sim.kernels.flash_attn import use_flash_attention

        use_flash_attention(model, attn, compute_capability=tuple(setup.compute_capability),
                            amp_dtype=_AMP_DTYPES.get(setup.precision))
    return model


def build_reference(setup: Any, spec: Any) -> nn.Module | None:
    """DPO's reference model on the meta device: a second copy of the model (None with peft, where the
    adapter-disabled model is the reference, or with precomputed reference log-probs)."""
    # trl/trainer/dpo_trainer.py DPOTrainer.__init__: `if is_peft_model(self.model) or precompute_ref_log_probs:
    # self.ref_model = None` -- any peft method (LoRA or a `peft_config`), not only LoRA
    # grpo_trainer.py GRPOTrainer.__init__: no reference when `beta == 0.0` or when the model is a peft model
    # rloo_trainer.py RLOOTrainer.__init__: as GRPO; kto_trainer.py KTOTrainer.__init__: as DPO
    if setup.trainer == "distill":  # DistillationTrainer: the teacher, always (memfit.sim.distill_steps)
        return _build_teacher(setup, spec)
    if setup.trainer in ("grpo", "rloo"):
        if setup.beta == 0.0 or setup.lora_r is not None or setup.peft_config:
            return None
    elif setup.trainer not in ("dpo", "kto") or setup.precompute_ref_log_probs or setup.lora_r is not None \
            or setup.peft_config:
        return None
    ref = _frozen_model(setup, spec)
    ref.requires_grad_(False)
    ref.eval()  # DPOTrainer: accelerator.prepare_model(ref_model, evaluation_mode=True), dropout disabled
    trl_adapter.add_fused_lm_head(ref, trl_adapter.DPO_FUSED_OUTPUTS)  # GRPO's reference: the default outputs too
    return ref


#: The TRL trainers whose `__init__` casts a quantized model's trainable parameters to bf16 (TRL 1.16 sft_trainer.py,
#: dpo_trainer.py, reward_trainer.py, grpo_trainer.py, rloo_trainer.py, kto_trainer.py, distillation_trainer.py:
#: "When using QLoRA, the PEFT adapter weights are converted to bf16 ... `autocast_adapter_dtype=False` ... is not yet
#: supported for quantized models", peft#2889): all of them; transformers' Trainer keeps peft's fp32 adapters.
QLORA_BF16_ADAPTER_TRAINERS = ("sft", "dpo", "reward", "grpo", "rloo", "kto", "distill")


def cast_quantized_trainable(model: nn.Module, setup: Any) -> int:
    """`param.data = param.data.to(torch.bfloat16)` for every trainable parameter of a 4-/8-bit model but DoRA's
    magnitude vectors, as TRL's trainers' `__init__` does after the user's freezing and peft; returns how many
    parameters (elements) it cast."""
    if setup.trainer not in QLORA_BF16_ADAPTER_TRAINERS or not (setup.load_in_4bit or setup.load_in_8bit):
        return 0
    cast = 0
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name and param.dtype != torch.bfloat16:
            param.data = param.data.to(torch.bfloat16)
            cast += param.numel()
    return cast


def build_reward_model(setup: Any) -> nn.Module | None:
    """GRPOTrainer's / RLOOTrainer's reward model on the meta device: `reward_model` as `GRPOTrainer.__init__` loads
    a reward function given by name (`AutoModelForSequenceClassification.from_pretrained(reward_func, num_labels=1,
    **model_init_kwargs)`: the policy's dtype settings), no gradients, eval mode (`accelerator.prepare_model(...,
    evaluation_mode=True)`). None without one."""
    if setup.trainer not in ("grpo", "rloo") or setup.reward_model is None:
        return None
    from memfit.models.build import build_meta_model, resolve_config

    try:
        spec = resolve_config(setup.reward_model)
    except MemfitError as err:  # "model `X` is not bundled ...": say which model
        text = str(err)
        raise MemfitError("reward " + text if text.startswith("model `") else f"reward model: {text}") from err
    reward = build_meta_model(setup.replace(trainer="trainer", task="seq-cls", model=setup.reward_model,
                                            num_labels=1, reward_model=None, lora_r=None, peft_config=None,
                                            load_in_4bit=False, load_in_8bit=False, use_vllm=False, beta=None,
                                            num_generations=None, use_liger_kernel=False), spec)
    reward.requires_grad_(False)
    reward.eval()
    return reward


def materialize_reward_model(runner: Any) -> None:
    """`accelerator.prepare_model(reward_func, evaluation_mode=True, device_placement=True)`: the reward model's
    parameters and buffers are weights on the device from the trainer's start."""
    reward = getattr(runner, "reward_model", None)
    if reward is None:
        return
    from memfit.models.build import to_empty_tied

    tr = runner.tracker
    tr.paused = True
    to_empty_tied(reward, device="cpu")
    if not runner.fake:
        with torch.no_grad():
            for t in list(reward.parameters()) + list(reward.buffers()):
                t.zero_()
    tr.paused = False
    for t in list(reward.parameters()) + list(reward.buffers()):
        tr.register(t, "weights")


def _build_teacher(setup: Any, spec: Any) -> nn.Module:
    """DistillationTrainer's teacher on the meta device: `teacher_model` as `create_model_from_path` loads it (a
    causal LM, no gradients, eval mode), refused in one line when its vocabulary is not the student's
    (DistillationTrainer.__init__ raises ValueError)."""
    from memfit.models.build import resolve_config

    teacher_spec = resolve_config(setup.teacher_model)
    student_vocab = spec.config.get_text_config().vocab_size
    teacher_vocab = teacher_spec.config.get_text_config().vocab_size
    if student_vocab != teacher_vocab:
        raise MemfitError(f"teacher `{setup.teacher_model}` has vocab_size {teacher_vocab} but the student has "
                          f"{student_vocab}; DistillationTrainer needs a shared vocabulary: choose a teacher of the "
                          "student's family")
    teacher = _frozen_model(setup.replace(model=setup.teacher_model, lora_r=None, peft_config=None,
                                          load_in_4bit=False, load_in_8bit=False), teacher_spec)
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher


def materialize_reference(runner: Any) -> None:
    """`ref_model.to("cuda")`: its parameters and buffers are weights on the device."""
    ref = runner.ref_model
    if ref is None:
        return
    from memfit.models.build import to_empty_tied

    tr = runner.tracker
    tr.paused = True
    to_empty_tied(ref, device="cpu")
    if not runner.fake:
        with torch.no_grad():
            for t in list(ref.parameters()) + list(ref.buffers()):
                t.zero_()
    tr.paused = False
    for t in list(ref.parameters()) + list(ref.buffers()):
        tr.register(t, "weights")


# -- batches ---------------------------------------------------------------------------------------

def _longs(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long)


def sft_batch(setup: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors the collator hands the device, the model's keyword arguments) of the worst SFT micro-batch."""
    b = setup.per_device_train_batch_size
    if setup.is_padding_free:
        t = setup.padding_free_tokens
        cu = torch.zeros(b + 1, dtype=torch.int32)  # cu_seq_lens_q is cu_seq_lens_k: one tensor
        tensors = {"input_ids": _longs(1, t), "labels": _longs(1, t), "position_ids": _longs(1, t),
                   "cu_seq_lens": cu, "seq_idx": torch.zeros(1, t, dtype=torch.int32)}
        kwargs = {"input_ids": tensors["input_ids"], "labels": tensors["labels"],
                  "position_ids": tensors["position_ids"], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                  "max_length_q": min(t, setup.max_length), "max_length_k": min(t, setup.max_length),
                  "seq_idx": tensors["seq_idx"]}
        return tensors, kwargs
    seq = setup.max_length if setup.packing else setup.sequence_length  # wrapped packs are max_length long
    tensors = {"input_ids": _longs(b, seq), "labels": _longs(b, seq), "attention_mask": torch.ones(b, seq, dtype=torch.long)}
    kwargs = {"input_ids": tensors["input_ids"], "labels": tensors["labels"]}
    if not setup.packing and has_padding(setup, seq):
        # A padded batch: see engine._make_batch (one pad token makes transformers build the mask, as a
        # FakeTensor, which it cannot read, always does).
        tensors["attention_mask"][-1, -1:].zero_()
        kwargs["attention_mask"] = tensors["attention_mask"]
    # else: an all-ones mask, which transformers drops for sdpa (_ignore_causal_mask_sdpa) and which
    # eager replaces by the causal mask it builds anyway: the model is called without it.
    return tensors, kwargs


def dpo_batch(setup: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors of DataCollatorForPreference on the device, the model's keyword arguments): chosen then rejected."""
    b2, seq = 2 * setup.per_device_train_batch_size, setup.sequence_length
    tensors = {"input_ids": _longs(b2, seq), "attention_mask": torch.ones(b2, seq, dtype=torch.long),
               "completion_mask": _longs(b2, seq)}
    tensors["attention_mask"][-1, -1:].zero_()  # chosen and rejected differ in length: padded
    if setup.precompute_ref_log_probs:
        tensors["ref_chosen_logps"] = torch.zeros(b2 // 2)
        tensors["ref_rejected_logps"] = torch.zeros(b2 // 2)
    return tensors, {"input_ids": tensors["input_ids"], "attention_mask": tensors["attention_mask"]}


# -- losses ----------------------------------------------------------------------------------------

def _forward(runner: Any, model: nn.Module, kwargs: dict[str, Any]):
    """model(**kwargs) as accelerate runs a prepared model: under autocast, outputs converted to fp32."""
    with cuda_autocast(runner.low):
        out = model(**kwargs, use_cache=False, fused_lm_head=True)
    if runner.low is not None:
        from accelerate.utils import convert_to_fp32

        out = convert_to_fp32(out)
    return out


def micro_loss(runner: Any) -> tuple[torch.Tensor, int]:
    """The loss of one TRL micro-step (forward phase), and the index of the first record after the batch."""
    s = runner.setup
    if s.trainer == "grpo":  # generation, scoring and the GRPO loss: memfit.sim.grpo_steps
        from memfit.sim import grpo_steps

        return grpo_steps.micro_loss(runner)
    if s.trainer == "rloo":  # GRPO's generation and scoring passes, RLOO's rewards and loss: memfit.sim.rloo_steps
        from memfit.sim import rloo_steps

        return rloo_steps.micro_loss(runner)
    if s.trainer == "distill":  # generation, the teacher, the chunked divergence: memfit.sim.distill_steps
        from memfit.sim import distill_steps

        return distill_steps.micro_loss(runner)
    if s.trainer in ("reward", "kto"):  # memfit.sim.reward_steps, memfit.sim.kto_steps
        from memfit.sim import kto_steps, reward_steps

        return (reward_steps if s.trainer == "reward" else kto_steps).micro_loss(runner)
    media = getattr(runner, "media", None)
    if s.trainer == "sft" and media is not None and media.example is not None:  # TRL's VLM collator
        from memfit.sim.host_values import image_text_batch

        tensors = image_text_batch(media.example, s.per_device_train_batch_size)
        kwargs = dict(tensors)
    elif s.trainer == "sft":
        tensors, kwargs = sft_batch(s)
    elif s.trainer == "dpo":
        tensors, kwargs = dpo_batch(s)
    else:  # pragma: no cover - the engine only calls this for TRL trainers
        raise MemfitError(f"trainer `{s.trainer}` has no TRL step")
    for t in tensors.values():
        runner.tracker.register(t, "inputs")
    start = len(runner.tracker.records)
    with activation_offloading(runner):
        if s.trainer == "sft":
            out = _forward(runner, runner.fwd_model, kwargs)
            per_token_loss = -out.log_probs  # SFTTrainer.compute_loss: zero on ignored positions
            num_tokens = out.label_mask.sum()
            loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            del out, per_token_loss, num_tokens
        else:
            loss = _dpo_loss(runner, tensors, kwargs)
    del tensors, kwargs
    return loss, start


#: The trainers whose `prediction_step` generates and scores the eval batch before its no-grad loss (TRL 1.16).
GENERATING_EVAL = ("grpo", "rloo", "distill")


def eval_loss(runner: Any) -> torch.Tensor:
    """The eval loss of one eval batch of a generating trainer (GENERATING_EVAL), as its `prediction_step` computes
    it: memfit.sim.grpo_steps / rloo_steps / distill_steps `evaluation`."""
    from memfit.sim import distill_steps, grpo_steps, rloo_steps

    return {"grpo": grpo_steps, "rloo": rloo_steps, "distill": distill_steps}[runner.setup.trainer].evaluation(runner)


def activation_offloading(runner: Any):
    """TRL's `activation_offloading=True`: SFTTrainer.training_step and DPOTrainer.training_step (TRL 1.16) run
    `super().training_step` inside `self.maybe_activation_offload_context`
    (`get_act_offloading_ctx_manager(model=self.model)`, built in `__init__`), so every tensor the forward and
    the loss save for backward goes through its pack hook (memfit.sim.offload.trl_activation_offloading: TRL's
    rule). DPO's reference forward runs under `no_grad` and saves nothing. TRL's head exemption hooks the
    `lm_head` module, whose forward the fused LM head never calls (`add_fused_lm_head` reads `lm_head.weight`),
    so the fused head's saved `hidden` and per-token statistics are offloaded too, as on the GPU."""
    if not runner.setup.activation_offloading:
        return contextlib.nullcontext()
    from memfit.sim.offload import trl_activation_offloading

    if getattr(runner, "_act_offload", None) is None:
        runner._act_offload = trl_activation_offloading(runner.fwd_model, runner.tracker)
    return runner._act_offload()


def _dpo_loss(runner: Any, tensors: dict[str, Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """DPOTrainer._compute_loss with the default sigmoid loss, beta 0.1 (values do not change the trace)."""
    s = runner.setup
    completion_mask = tensors["completion_mask"]
    seq_len = completion_mask[..., 1:].size(1)
    labels = tensors["input_ids"].masked_fill(completion_mask == 0, -100)
    out = _forward(runner, runner.fwd_model, {**kwargs, "labels": labels})
    logps = out.log_probs[:, -seq_len:].sum(dim=1)
    del out
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    if s.precompute_ref_log_probs:
        ref_chosen, ref_rejected = tensors["ref_chosen_logps"], tensors["ref_rejected_logps"]
    else:
        with torch.no_grad():
            if runner.ref_model is None:  # peft: the adapter-disabled model is the reference
                with runner.model.disable_adapter():
                    ref_out = _forward(runner, runner.fwd_model, {**kwargs, "labels": labels})
            else:
                ref_out = _forward(runner, runner.ref_model, {**kwargs, "labels": labels})
            ref_logps = ref_out.log_probs[:, -seq_len:].sum(dim=1)
            del ref_out
        ref_chosen, ref_rejected = ref_logps.chunk(2, dim=0)
    chosen_logratios = chosen_logps - ref_chosen
    rejected_logratios = rejected_logps - ref_rejected
    delta = chosen_logratios - rejected_logratios
    loss = 0.0 + (-F.logsigmoid(0.1 * delta)).mean() * 1.0
    return loss
