"""`TrainSetup`: what memfit needs to know about a fine-tuning run.

Field names mirror `transformers.TrainingArguments` so a user can move between the two;
`TrainSetup.from_training_args`, `from_kwargs` and `from_json` accept what old scripts
write (`evaluation_strategy`, ...) and record a note instead of raising a TypeError.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.files import read_json_object

__all__ = ["TrainSetup", "TASKS", "IMAGE_TASKS", "AUDIO_TASKS", "PRECISIONS", "OPTIMIZERS", "ATTN_IMPLEMENTATIONS",
           "HUB_FLASH_KERNELS",
           "LEGACY_ARG_NAMES", "TRAINING_ARGS_NAMES",
           "normalize_arg_names", "suggest_name", "read_args_file", "quantization_fields", "TRAINERS",
           "TRL_TRAINERS", "GENERATING_TRAINERS", "TRL_CONFIG_CLASS_NAMES", "TRL_CONFIG_NAMES", "VLLM_MODES", "grpo_generation_sizes", "EVAL_STRATEGIES", "BNB_4BIT_QUANT_TYPES"]

#: task name -> the Auto class head it builds (transformers.AutoModelFor...).
TASKS = {
    "seq-cls": "AutoModelForSequenceClassification",
    "token-cls": "AutoModelForTokenClassification",
    "qa": "AutoModelForQuestionAnswering",
    "mlm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    # tasks whose inputs the model's own processor makes from images or audio (memfit.models.processors)
    "image-cls": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "ctc": "AutoModelForCTC",
    # vision-language models: images and text in, text out (memfit.models.image_text)
    "image-text-to-text": "AutoModelForImageTextToText",
}
#: The tasks of TASKS whose inputs are images (IMAGE_TASKS) or audio (AUDIO_TASKS), not tokens.
IMAGE_TASKS = ("image-cls", "image-text-to-text")
AUDIO_TASKS = ("speech-seq2seq", "ctc")
_TASK_ALIASES = {
    "sequence-classification": "seq-cls", "text-classification": "seq-cls", "classification": "seq-cls",
    "token-classification": "token-cls", "ner": "token-cls",
    "question-answering": "qa", "masked-lm": "mlm", "fill-mask": "mlm",
    "causal": "causal-lm", "clm": "causal-lm", "text-generation": "causal-lm",
    "seq2seq": "seq2seq-lm", "text2text-generation": "seq2seq-lm",
    "image-classification": "image-cls", "speech-seq2seq-lm": "speech-seq2seq", "vlm": "image-text-to-text",
    "automatic-speech-recognition-ctc": "ctc",
}
PRECISIONS = ("fp32", "fp16", "bf16")
#: `eval_strategy` values: transformers.trainer_utils.IntervalStrategy.
EVAL_STRATEGIES = ("no", "steps", "epoch")

#: `optim` names of TrainingArguments (transformers.training_args.OptimizerNames) memfit simulates.
OPTIMIZERS = (
    "adamw_torch", "adamw_torch_fused",
    "adafactor", "sgd", "adamw_bnb_8bit", "adamw_8bit", "adagrad", "rmsprop",
    # bitsandbytes paged / Lion optimizers (memfit.sim.optimizers.BNB_OPTIMIZERS)
    "paged_adamw_32bit", "paged_adamw_8bit", "lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit",
)

#: The fields of `transformers.TrainingArguments` in transformers 5.24 (`dataclasses.fields(TrainingArguments)`;
#: tests/cli/test_api_cli.py checks this list against the installed transformers). Kept as text so that reading an
#: arguments file does not import transformers (about 2 s).
TRAINING_ARGS_NAMES = frozenset("""
accelerator_config activation_checkpointing activation_checkpointing_kwargs adam_beta1 adam_beta2 adam_epsilon
auto_find_batch_size average_tokens_across_devices batch_eval_metrics bf16 bf16_full_eval data_seed
dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_num_workers
dataloader_persistent_workers dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph ddp_timeout debug deepspeed disable_tqdm do_eval
do_predict do_train enable_jit_checkpoint eval_accumulation_steps eval_delay eval_do_concat_batches eval_on_start
eval_steps eval_strategy eval_use_gather_object fp16 fp16_full_eval fsdp fsdp_config full_determinism
gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs greater_is_better hub_always_push
hub_model_id hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip include_for_metrics
include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name
liger_kernel_config load_best_model_at_end local_rank log_level log_level_replica log_on_each_node
logging_first_step logging_nan_inf_filter logging_steps logging_strategy lr_scheduler_kwargs lr_scheduler_type
max_grad_norm max_steps metric_for_best_model neftune_noise_alpha num_train_epochs optim optim_args
optim_target_modules output_dir parallelism_config per_device_eval_batch_size per_device_train_batch_size
prediction_loss_only project push_to_hub remove_unused_columns report_to restore_callback_states_from_checkpoint
resume_from_checkpoint run_name save_on_each_node save_only_model save_steps save_strategy save_total_limit seed
skip_memory_metrics tf32 torch_compile torch_compile_backend torch_compile_mode torch_empty_cache_steps
trackio_bucket_id trackio_space_id trackio_static_space_id train_sampling_strategy use_cache use_cpu
use_liger_kernel warmup_steps weight_decay
""".split())

#: Names old scripts still pass that transformers 5.24's TrainingArguments does not have (none of them is in
#: TRAINING_ARGS_NAMES), -> the current name, or None when the setting is gone. Read with a note, not a TypeError.
LEGACY_ARG_NAMES = {
    "evaluation_strategy": "eval_strategy",  # renamed in transformers 4.41, removed in 5.0
    "no_cuda": "use_cpu",  # deprecated in 4.x for use_cpu, removed in 5.0
    "per_gpu_train_batch_size": "per_device_train_batch_size",  # removed in 5.0
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "warmup_ratio": "warmup_steps",  # 5.x: a float in [0, 1) in warmup_steps is a ratio (training_args.py)
    "include_inputs_for_metrics": "include_for_metrics",
    "max_seq_length": "max_length",  # TRL's SFTConfig name (renamed max_length in TRL 0.20); memfit's padded length
    "overwrite_output_dir": None,
    "logging_dir": None,
    "save_safetensors": None,  # 5.x always saves safetensors
    "use_mps_device": None,
}

#: TrainingArguments settings that change GPU memory but that memfit does not simulate: a note when set.
_NOT_MODELLED_ARGS = ("torch_compile", "auto_find_batch_size", "torch_empty_cache_steps")
#: TrainingArguments names that choose or configure the multi-GPU engine: memfit.parallel reads them
#: (`parallel_from_training_args`, the CLI's `--args`), not TrainSetup.
ENGINE_ARG_NAMES = ("deepspeed", "fsdp", "fsdp_config", "ddp_bucket_cap_mb", "accelerator_config")

# -- TRL ---------------------------------------------------------------------------------------
#: `trainer` values: transformers' Trainer, TRL's SFTTrainer, DPOTrainer, GRPOTrainer, RLOOTrainer, RewardTrainer,
#: KTOTrainer and DistillationTrainer.
TRAINERS = ("trainer", "sft", "dpo", "grpo", "rloo", "reward", "kto", "distill")
#: The TRL trainers of TRAINERS: their steps are simulated by memfit.sim.trl_steps (and the modules it hands RL and
#: preference trainers to), `memfit train --trainer` runs SFT and DPO (memfit.commands.train_trl), and their
#: configs' names are TRL_CONFIG_NAMES.
TRL_TRAINERS = ("sft", "dpo", "grpo", "rloo", "reward", "kto", "distill")
#: The trainers that generate completions in their step (GRPOTrainer and RLOOTrainer share the generation batch,
#: `num_generations`, vLLM and `steps_per_generation`: RLOOConfig has GRPOConfig's generation names, TRL 1.16).
GENERATING_TRAINERS = ("grpo", "rloo")
#: KTOConfig.loss_type choices (TRL 1.16 kto_config.py).
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
#: The TRL config classes of TRAINERS (for messages).
TRL_CONFIG_CLASS_NAMES = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig", "rloo": "RLOOConfig",
                          "reward": "RewardConfig", "kto": "KTOConfig", "distill": "DistillationConfig"}
#: SFTConfig / DPOConfig fields (TRL 1.16) that TrainingArguments does not have (`dataclasses.fields(SFTConfig)`
#: minus TRAINING_ARGS_NAMES; tests/sim/test_trl.py checks these lists against the installed TRL). Kept as text so
#: that reading an arguments file does not import TRL. Read when `trainer` is `sft` / `dpo`, rejected otherwise.
TRL_CONFIG_NAMES = {
    "sft": frozenset("""
activation_offloading assistant_only_loss chat_template_path completion_only_loss dataset_kwargs dataset_num_proc
dataset_text_field eos_token eval_packing loss_type max_length model_init_kwargs packing packing_strategy
pad_to_multiple_of pad_token padding_free router_aux_loss_coef shuffle_dataset truncation_mode trust_remote_code
""".split()),
    "dpo": frozenset("""
activation_offloading beta dataset_num_proc disable_dropout discopop_tau f_alpha_divergence_coef f_divergence_type
label_smoothing ld_alpha loss_type loss_weights max_length model_init_kwargs pad_to_multiple_of pad_token
padding_free precompute_ref_batch_size precompute_ref_log_probs ref_model_mixup_alpha ref_model_sync_steps
router_aux_loss_coef sync_ref_model truncation_mode trust_remote_code use_weighting
""".split()),
    "grpo": frozenset("""
beta cache_implementation cast_lm_head_to_fp32 chat_template_kwargs delta disable_dropout ds3_gather_for_generation
entropy_coef entropy_coef_delta entropy_coef_max entropy_coef_min entropy_target epsilon epsilon_high
generation_batch_size generation_kwargs importance_sampling_level log_completions log_completions_hub_repo
log_multimodal log_unique_prompts loss_type mask_truncated_completions max_completion_length
max_tool_calling_iterations min_p model_init_kwargs multi_objective_aggregation num_completions_to_print
num_generations num_generations_eval num_iterations off_policy_mask_threshold pad_to_multiple_of ref_model_mixup_alpha
ref_model_sync_steps repetition_penalty reward_weights router_aux_loss_coef sapo_temperature_neg sapo_temperature_pos
scale_rewards shuffle_dataset steps_per_generation sync_ref_model temperature top_entropy_quantile top_k top_p
transformers_continuous_batching_config trust_remote_code use_adaptive_entropy use_bias_correction_kl
use_transformers_continuous_batching use_transformers_paged use_vllm vespo_k_neg vespo_k_pos vespo_lambda_neg
vespo_lambda_pos vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port vllm_importance_sampling_cap
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min vllm_importance_sampling_correction
vllm_importance_sampling_mode vllm_max_model_length vllm_mode vllm_model_impl vllm_server_base_url vllm_server_host
vllm_server_port vllm_server_timeout vllm_structured_outputs_regex vllm_tensor_parallel_size
""".split()),
    "rloo": frozenset("""
beta cache_implementation chat_template_kwargs disable_dropout ds3_gather_for_generation epsilon epsilon_high
generation_batch_size generation_kwargs log_completions log_multimodal log_unique_prompts mask_truncated_completions
max_completion_length min_p model_init_kwargs normalize_advantages num_completions_to_print num_generations
num_generations_eval num_iterations pad_to_multiple_of ref_model_mixup_alpha ref_model_sync_steps repetition_penalty
reward_clip_range reward_weights router_aux_loss_coef shuffle_dataset steps_per_generation sync_ref_model
temperature top_k top_p transformers_continuous_batching_config trust_remote_code
use_transformers_continuous_batching use_transformers_paged use_vllm vllm_enable_sleep_mode
vllm_gpu_memory_utilization vllm_group_port vllm_max_model_length vllm_mode vllm_model_impl vllm_server_base_url
vllm_server_host vllm_server_port vllm_server_timeout vllm_structured_outputs_regex vllm_tensor_parallel_size
""".split()),
    "reward": frozenset("""
activation_offloading center_rewards_coefficient chat_template_path dataset_num_proc disable_dropout eos_token
max_length model_init_kwargs pad_to_multiple_of pad_token trust_remote_code
""".split()),
    "kto": frozenset("""
activation_offloading beta dataset_num_proc desirable_weight disable_dropout loss_type max_length model_init_kwargs
pad_to_multiple_of precompute_ref_batch_size precompute_ref_log_probs ref_model_mixup_alpha ref_model_sync_steps
router_aux_loss_coef sync_ref_model trust_remote_code undesirable_weight
""".split()),
    "distill": frozenset("""
beta cache_implementation chat_template_kwargs disable_dropout ds3_gather_for_generation generation_kwargs
log_completions log_unique_prompts max_completion_length max_tool_calling_iterations min_p model_init_kwargs
num_completions_to_print pad_to_multiple_of repetition_penalty shuffle_dataset teacher_model_init_kwargs
teacher_model_name_or_path teacher_model_revision temperature top_k top_p trust_remote_code use_vllm
vllm_enable_sleep_mode vllm_gpu_memory_utilization vllm_group_port vllm_max_model_length vllm_mode vllm_model_impl
vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout vllm_structured_outputs_regex
vllm_tensor_parallel_size
""".split()),
}
#: TRL settings that change GPU memory but that memfit does not simulate: a note when set.
_TRL_NOT_MODELLED = ("sync_ref_model", "pad_to_multiple_of",  # activation_offloading: a TrainSetup field
                     # GRPO: other generation paths and the high-entropy mask (a [B, C] quantile)
                     "cache_implementation", "use_transformers_paged", "use_transformers_continuous_batching",
                     "cast_lm_head_to_fp32")
#: TRL config names removed before TRL 1.16 -> why they are ignored (read with a note, not a TypeError).
_TRL_REMOVED = {
    "max_prompt_length": "DPOConfig 1.x has no prompt limit: DataCollatorForPreference truncates prompt + completion "
                         "to `max_length` (keep_start/keep_end, trl/trainer/dpo_trainer.py)",
    "max_completion_length": "DPOConfig 1.x truncates prompt + completion together to `max_length`",
}
#: GRPOConfig / RLOOConfig names of other TRL versions -> why they are ignored with `trainer="grpo"` / `"rloo"`
#: (TRL 1.16; rloo_trainer.py `_tokenize_prompts` and `__init__` do the same as grpo_trainer.py).
_GRPO_REMOVED = {
    "max_prompt_length": "GRPOTrainer / RLOOTrainer 1.16 do not truncate prompts (`_tokenize_prompts`); memfit "
                         "takes the prompt length from `max_length` / `example_lengths`",
    "use_liger_loss": "TRL 1.16 has no Liger loss: GRPOTrainer / RLOOTrainer always score completions with TRL's fused LM "
                      "head (`add_fused_lm_head`), which never builds the [B, C, vocab] logits",
}
#: vllm_mode values of GRPOConfig in TRL 1.16 (grpo_config.py `vllm_mode`).
VLLM_MODES = ("colocate", "server")
#: TRL trainers memfit does not simulate -> their class (ORPO, CPO and online DPO are in trl.experimental in TRL 1.16).
_TRL_NOT_SIMULATED = {"gkd": "trl.experimental GKDTrainer",
                      "orpo": "trl.experimental ORPOTrainer", "cpo": "trl.experimental CPOTrainer",
                      "online_dpo": "trl.experimental OnlineDPOTrainer", "online-dpo": "trl.experimental OnlineDPOTrainer"}
#: packing_strategy values of SFTConfig in TRL 1.16 (sft_config.py `packing_strategy` choices).
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


#: Names people guess for a TrainSetup field (the API's `estimate(model, batch_size=4)`) -> the field.
_COMMON_GUESSES = {
    "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
    "micro_batch_size": "per_device_train_batch_size", "eval_batch_size": "per_device_eval_batch_size",
    "grad_accum": "gradient_accumulation_steps", "gradient_accumulation": "gradient_accumulation_steps",
    "accumulation_steps": "gradient_accumulation_steps", "seq_len": "max_length", "seq_length": "max_length",
    "sequence_length": "max_length", "max_seq_len": "max_length", "dtype": "weights_dtype",
    "torch_dtype": "weights_dtype", "mixed_precision": "precision", "optimizer": "optim",
    "attn": "attn_implementation", "lora_rank": "lora_r",
}


def suggest_name(name: Any, valid: "set[str] | frozenset[str]") -> str:
    """` (did you mean `x`?)` for a misspelt setting name, or '' (difflib over `valid`)."""
    key = str(name)
    if key in _COMMON_GUESSES and _COMMON_GUESSES[key] in valid:
        return f" (did you mean `{_COMMON_GUESSES[key]}`?)"
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _setup_field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainSetup)} - {"notes"}


def normalize_arg_names(data: dict[str, Any], *, source: str = "the arguments",
                        trainer: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Check the names of a dict of TrainingArguments kwargs (or TrainSetup fields): legacy names are
    renamed (or dropped when the setting is gone) with a note; an unknown name is a MemfitError naming the
    closest valid one. Returns (the renamed dict, notes).

    Args:
        data: TrainingArguments kwargs and/or TrainSetup fields, as read from a JSON file.
        source: where they came from, for the messages (`--args a.json`).
        trainer: `sft` / `dpo` accept that TRL config's names too (TRL_CONFIG_NAMES); None: `data["trainer"]`.
    """
    trainer = trainer if trainer is not None else data.get("trainer")
    trl_names = TRL_CONFIG_NAMES.get(trainer, frozenset()) if isinstance(trainer, str) else frozenset()
    valid = TRAINING_ARGS_NAMES | _setup_field_names() | trl_names | {"quantization_config"} | set(_PROCESSOR_ARG_NAMES)
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str):
            raise MemfitError(f"setting name `{key!r}` in {source} is not a string")
        removed = _GRPO_REMOVED if trainer in GENERATING_TRAINERS else _TRL_REMOVED
        if trl_names and key in removed and key not in trl_names:  # TRL
            notes.append(f"`{key}` in {source} is not a TRL 1.16 setting ({removed[key]}); ignored")
            continue
        if key in LEGACY_ARG_NAMES:
            new = LEGACY_ARG_NAMES[key]
            if new is None:
                notes.append(f"`{key}` in {source} was removed from TrainingArguments in transformers 5; ignored")
                continue
            notes.append(f"`{key}` in {source} is the old name of `{new}` (transformers 5 raises TypeError on it); "
                         f"read as `{new}`")
            if new in data:
                raise MemfitError(f"{source} gives both `{key}` and its new name `{new}`; keep only `{new}`")
            key = new
        elif key in _PROCESSOR_ARG_NAMES:
            if _PROCESSOR_ARG_NAMES[key] in data:
                raise MemfitError(f"{source} gives both `{key}` and `{_PROCESSOR_ARG_NAMES[key]}`; keep one")
            key = _PROCESSOR_ARG_NAMES[key]
        elif key not in valid:
            trl = [t for t, names in TRL_CONFIG_NAMES.items() if key in names]
            if trl:  # TRL: an SFTConfig / DPOConfig name without the trainer that reads it
                raise MemfitError(f"`{key}` in {source} is a TRL {TRL_CONFIG_CLASS_NAMES[trl[0]]} setting; say which trainer "
                                  f"runs it: `trainer={trl[0]!r}` (`--trainer {trl[0]}`)")
            raise MemfitError(f"unknown setting `{key}` in {source}{suggest_name(key, valid)}; it is neither a "
                              "TrainingArguments argument (transformers 5) nor a memfit TrainSetup field")
        out[key] = value
    return out, notes

#: TrainingArguments names that affect GPU memory -> TrainSetup field.
_ARG_TO_FIELD = {
    "per_device_train_batch_size": "per_device_train_batch_size",
    "per_device_eval_batch_size": "per_device_eval_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "optim": "optim",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "gradient_checkpointing": "gradient_checkpointing",
    "eval_accumulation_steps": "eval_accumulation_steps",
    "eval_strategy": "eval_strategy",
    "prediction_loss_only": "prediction_loss_only",
    # Seq2SeqTrainingArguments (transformers training_args_seq2seq.py)
    "predict_with_generate": "predict_with_generate",
    "generation_max_length": "generation_max_length",
    "generation_num_beams": "generation_num_beams",
    # attention / Liger / activation memory: transformers 5.24 names, the deprecated aliases too
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    "gradient_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    "use_liger_kernel": "use_liger_kernel",
    "liger_kernel_config": "liger_kernel_config",
    "teacher_model_name_or_path": "teacher_model",  # DistillationConfig (TRL)
}
#: Processor settings an arguments file may give by the processor's own name -> TrainSetup field
#: (Gemma3Processor's `do_pan_and_scan`, transformers models/gemma3/processing_gemma3.py `images_kwargs`).
_PROCESSOR_ARG_NAMES = {"do_pan_and_scan": "pan_and_scan"}

# -- attention, Liger kernels, activation memory ------------------------------------
#: `attn_implementation` values memfit simulates (memfit.sim.kernels.flash_attn emulates the flash kernels).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
#: Hub kernels (`kernels` package) that are flash-attn builds -> the implementation whose allocations they have
#: (transformers modeling_flash_attention_utils.FLASH_ATTN_KERNEL_FALLBACK: flash_attention_2 ->
#: kernels-community/flash-attn2, flash_attention_3 -> kernels-community/vllm-flash-attn3).
HUB_FLASH_KERNELS = {
    "kernels-community/flash-attn2": "flash_attention_2",
    "kernels-community/flash-attn": "flash_attention_2",
    "kernels-community/flash-attn3": "flash_attention_3",
    "kernels-community/vllm-flash-attn3": "flash_attention_3",
}
#: Keys of `gradient_checkpointing_kwargs` memfit models: torch.utils.checkpoint's `use_reentrant`, and
#: transformers 5.24 `activation_checkpointing_enable`'s `offload` (save_on_cpu) and `every_n_layers`
#: (Trainer pops the last two, trainer.py `_inner_training_loop`).
CHECKPOINT_KWARGS = ("use_reentrant", "offload", "every_n_layers")
#: liger_kernel_config keys `_apply_liger_kernel_to_instance` passes to `apply_liger_kernel_to_<model>`.
LIGER_CONFIG_KEYS = ("rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy", "rms_norm",
                     "layer_norm")

# -- torchao Float8 training --
#: torchao 0.18 float8/config.py `Float8LinearRecipeName` values (tests/models/test_float8.py checks them against it).
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# -- quantization --
#: `bnb_4bit_quant_type` values (transformers 5.24 `BitsAndBytesConfig`: nf4 or fp4).
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")
#: The `bnb_4bit_quant_storage` names BitsAndBytesConfig accepts (transformers 5.24 `BitsAndBytesConfig.__init__`).
QUANT_STORAGE_DTYPES = ("float16", "float32", "int8", "uint8", "float64", "bfloat16")


@dataclass(kw_only=True)
class TrainSetup:
    """A fine-tuning run as far as GPU memory is concerned."""

    model: Any = "xlnet-large-cased"
    """Hub id (bundled configs work offline), a directory with config.json, a PretrainedConfig, or an nn.Module."""
    task: str | None = None
    """One of seq-cls, token-cls, qa, mlm, causal-lm, seq2seq-lm, image-cls, speech-seq2seq (Whisper), ctc
    (wav2vec2, HuBERT), image-text-to-text (Qwen2.5-VL); None: the model's own, from its config (`memfit.models.default_task`: causal-lm for
    GPT-2/Llama, seq2seq-lm for T5/BART, seq-cls for encoders, image-cls for ViT, speech-seq2seq for Whisper, ctc for
    wav2vec2), said in `notes`."""
    num_labels: int = 2
    """Labels of a classification head."""
    per_device_train_batch_size: int = 8
    """Micro-batch size (TrainingArguments default 8)."""
    per_device_eval_batch_size: int = 8
    """Evaluation batch size (TrainingArguments default 8)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; does not change peak activations."""
    max_length: int = 512
    """Padded sequence length of a batch (tokens)."""
    example_lengths: list[int] | None = None
    """Token lengths of the examples; the worst padded batch (the longest, capped at max_length when truncating) is simulated."""
    truncation: bool = True
    """Whether inputs are truncated to max_length (only matters with example_lengths)."""
    target_length: int | None = None
    """Decoder (labels) length for seq2seq-lm and speech-seq2seq, transcript characters for ctc, the suffix (the
    answer, the only labels) for PaliGemma, whose processor takes the prompt (max_length) and the suffix apart;
    defaults to max_length (speech-seq2seq: at most the decoder's `max_target_positions`; ctc: at most the encoder
    positions of a clip; with a note)."""
    # -- images and audio: the model's own processor makes the inputs (memfit.models.processors) --
    image_size: str | None = None
    """Size of the images the image processor receives, `WxH` in pixels (e.g. `1920x1080`); None: an image of
    the processor's own output size. Image models only."""
    images_per_example: int = 1
    """Images in each example (image classification takes one; a vision-language model any number)."""
    video_frames: int | None = None
    """Frames of the one video clip in each example, each of `image_size`, given to the model's video processor
    as decoded frames (Qwen2.5-VL's `Qwen2VLVideoProcessor`, Qwen3-VL's `Qwen3VLVideoProcessor`, SmolVLM2's
    `SmolVLMVideoProcessor`, memfit.models.video_inputs); None: no video. A vision-language model that takes video
    only."""
    pan_and_scan: bool = False
    """Gemma 3: each image is also cut into crops along its longer side, each one more block of image tokens
    (Gemma3Processor's `do_pan_and_scan`, with its own crop settings; `do_pan_and_scan` in --args is read as
    this). Gemma 3 only."""
    audio_seconds: float | None = None
    """Length of the longest audio clip of a batch in seconds; None: 30 (Whisper's window), 20 for ctc (the
    longest clip run_speech_recognition_ctc.py keeps). Speech models only."""
    sampling_rate: int | None = None
    """Sampling rate of the audio in Hz; None: the feature extractor's own (16000 for Whisper and wav2vec2),
    the only one it takes (resample the data first, as transformers' feature extractors require)."""
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})
    """fp32, fp16 (AMP + GradScaler) or bf16 (AMP)."""
    weights_dtype: str = field(default="auto", metadata={"choices": ("auto", *PRECISIONS)})
    """Dtype the weights are loaded in: auto (transformers 5 `from_pretrained` default: the config's
    dtype, e.g. bf16 for Llama 3, fp32 when the config has none), fp32, fp16 or bf16."""
    optim: str = field(default="adamw_torch_fused", metadata={"choices": OPTIMIZERS})
    """TrainingArguments.optim name; the transformers 5 default is adamw_torch_fused."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (TrainingArguments default 0); no memory of its own."""
    max_grad_norm: float = 1.0
    """Gradient clipping; 0 disables it."""
    gradient_checkpointing: bool = False
    """Activations of each block recomputed in backward instead of kept (`model.gradient_checkpointing_enable`)."""
    eval_accumulation_steps: int | None = None
    """Move predictions to the CPU every N eval steps; None keeps all on the GPU until the end."""
    eval_strategy: str = field(default="no", metadata={"choices": EVAL_STRATEGIES})
    """no, steps or epoch; anything but `no` adds the evaluation phase."""
    eval_samples: int | None = None
    """Examples in the eval set (sizes the on-device prediction buffer); None: 1000 examples."""
    prediction_loss_only: bool = False
    """Evaluation keeps only the loss, no logits (TrainingArguments `prediction_loss_only`)."""
    # -- Seq2SeqTrainingArguments' generation in evaluation (transformers trainer_seq2seq.py `prediction_step`) --
    predict_with_generate: bool = False
    """The evaluation calls `model.generate` on each batch (Seq2SeqTrainer) and keeps the generated tokens, not
    the logits: the decoder's KV cache (self- and cross-attention) is held while it generates (memfit.sim.seq2seq_generation).
    seq2seq-lm and speech-seq2seq only."""
    generation_max_length: int | None = None
    """Tokens `generate` produces up to (Seq2SeqTrainingArguments `generation_max_length`); None: the model's
    `max_length` (its generation config's, 448 for Whisper), else its `max_target_positions`, else 20 (GenerationConfig)."""
    generation_num_beams: int | None = None
    """Beams of `generate` (Seq2SeqTrainingArguments `generation_num_beams`); None: 1, greedy."""
    attn_implementation: str | None = field(default=None,
                                            metadata={"choices": (*ATTN_IMPLEMENTATIONS, *HUB_FLASH_KERNELS)})
    """eager, sdpa, flash_attention_2, flash_attention_3, flex_attention, or a flash-attn hub kernel
    (`kernels-community/flash-attn2`); None keeps the model's default (sdpa)."""
    lora_r: int | None = None
    """LoRA rank (peft); None trains the full model."""
    lora_alpha: int = 16
    """LoRA scaling numerator (peft `LoraConfig.lora_alpha`): scales the update, changes no memory."""
    lora_dropout: float = 0.0
    """Dropout on the input of each LoRA adapter (peft `LoraConfig.lora_dropout`); 0: none."""
    lora_target_modules: list[str] | None = None
    """Module names LoRA wraps; None lets peft pick its default for the architecture."""
    # -- peft methods beyond LoRA (memfit.models.peft_methods) --
    use_dora: bool = False
    """LoRA with DoRA (peft `LoraConfig(use_dora=True)`: a magnitude vector per wrapped layer, the weight norm)."""
    peft_config: dict | None = None
    """Any peft method as peft's `get_peft_config` reads it (an adapter_config.json: `{"peft_type": "IA3", ...}`) or
    a `PeftConfig`; built by peft's own `get_peft_model` on the meta model. Not with `lora_r` (LoRA's own fields)."""
    freeze_embeddings: bool = False
    """Input embeddings get no gradient (requires_grad=False)."""
    freeze_layers: int = 0
    """The lowest N blocks of the model's (first) stack of layers get no gradient."""
    # -- freezing parts of image and speech models (memfit.models.freezing, the models' own methods) --
    freeze_feature_encoder: bool | None = None
    """A wav2vec2-style model's convolutional feature encoder gets no gradient (its `freeze_feature_encoder()`);
    None: frozen for ctc, as transformers' run_speech_recognition_ctc.py does by default, else not."""
    freeze_encoder: bool = False
    """Whisper's audio encoder gets no gradient (its `freeze_encoder()`; run_speech_recognition_seq2seq.py's
    `--freeze_encoder`)."""
    freeze_vision_tower: bool = False
    """The vision tower gets no gradient: a vision-language model's image encoder (`get_encoder(modality="image")`),
    an image classifier's backbone (all but the classification head)."""
    freeze_projector: bool = False
    """A vision-language model's projector (between the vision tower and the language model) gets no gradient."""
    offload_optimizer_state: bool = False
    """Optimizer state kept in host memory (DeepSpeed ZeRO-Offload); not on the GPU."""
    # -- quantization: BitsAndBytesConfig's fields and defaults (transformers 5.24
    # utils/quantization_config.py `BitsAndBytesConfig.__init__`), simulated by memfit.models.quantization --
    load_in_4bit: bool = False
    """Base weights in 4 bits (bitsandbytes Linear4bit); needs LoRA on top (QLoRA)."""
    load_in_8bit: bool = False
    """Base weights in 8 bits (bitsandbytes LLM.int8 Linear8bitLt); needs LoRA on top."""
    bnb_4bit_quant_type: str = field(default="fp4", metadata={"choices": BNB_4BIT_QUANT_TYPES})
    """nf4 or fp4 (BitsAndBytesConfig's default is fp4; QLoRA recipes use nf4)."""
    bnb_4bit_compute_dtype: str | None = field(default=None, metadata={"choices": PRECISIONS})
    """Dtype Linear4bit dequantizes to and computes in: fp32, fp16 or bf16; None is BitsAndBytesConfig's
    default, float32."""
    bnb_4bit_use_double_quant: bool = False
    """Quantize the absmax statistics again (uint8 + fp32 per 256 blocks)."""
    bnb_4bit_quant_storage: str = field(default="uint8", metadata={"choices": QUANT_STORAGE_DTYPES})
    """Dtype of the packed 4-bit storage (uint8, int8, float16, bfloat16, float32, float64)."""
    llm_int8_threshold: float = 6.0
    """LLM.int8 outlier threshold (0 disables the mixed-precision decomposition)."""
    llm_int8_skip_modules: list[str] | None = None
    """Module names kept unquantized; None: transformers' default (the LM head, `get_keys_to_not_convert`)."""
    kbit_prep: bool = True
    """Run peft's `prepare_model_for_kbit_training` on a quantized model (as peft's QLoRA recipes do): it casts the
    non-quantized fp16/bf16 parameters to float32 and turns gradient checkpointing on. TRL 1.16's SFTTrainer does
    not call it (trl/trainer/sft_trainer.py goes straight to `get_peft_model`; only TRL's experimental trainers call
    their own version, trl/experimental/utils.py, which freezes and checkpoints but casts nothing): False for those."""
    kbit_use_gradient_checkpointing: bool = True
    """`prepare_model_for_kbit_training(model, use_gradient_checkpointing=...)` (peft's default True turns gradient
    checkpointing on); False leaves it to `gradient_checkpointing`, whose `gradient_checkpointing_kwargs` are the
    ones peft passes on."""
    # -- Liger kernels and activation memory --
    use_liger_kernel: bool = False
    """Trainer's `use_liger_kernel`: `liger_kernel.transformers._apply_liger_kernel_to_instance` patches the model
    (fused linear cross-entropy, RMSNorm, RoPE, SwiGLU/GeGLU; the Triton kernels emulated, memfit.sim.kernels.liger)."""
    liger_kernel_config: dict | None = None
    """Keyword arguments of `_apply_liger_kernel_to_instance` (`{"rms_norm": False, ...}`)."""
    gradient_checkpointing_kwargs: dict | None = None
    """`use_reentrant` (transformers 5 default False), `offload` (checkpointed inputs kept in host memory,
    torch.autograd.graph.save_on_cpu) and `every_n_layers`, as transformers 5.24 `activation_checkpointing_enable` takes them."""
    activation_offloading: bool = False
    """TRL's `activation_offloading` (trl.models.get_act_offloading_ctx_manager): tensors saved for backward move to
    host memory, except those of the last module and parameters' views."""
    # -- torchao Float8 training: memfit.models.float8 --
    float8_recipe: str | None = None
    """torchao Float8 training recipe (tensorwise, rowwise, rowwise_with_gw_hp), applied as accelerate's
    `mixed_precision="fp8"` (torchao backend) applies it; needs bf16 and a GPU of compute capability 8.9+."""
    # -- TRL -------------------------------------------------------------------------
    trainer: str = field(default="trainer", metadata={"choices": TRAINERS, "checked_by_setup": True})
    """Which trainer runs the step: `trainer` (transformers.Trainer) or TRL's `sft` (SFTTrainer), `dpo` (DPOTrainer),
    `grpo` (GRPOTrainer), `rloo` (RLOOTrainer), `reward` (RewardTrainer: a one-score sequence-classification head over
    chosen / rejected pairs) or `kto` (KTOTrainer); TRL's steps are simulated by memfit.sim.trl_steps."""
    packing: bool = False
    """SFTConfig.packing: examples packed into sequences of `max_length` tokens."""
    packing_strategy: str = field(default="bfd", metadata={"choices": PACKING_STRATEGIES})
    """SFTConfig.packing_strategy: bfd, bfd_split (both imply padding-free, sft_trainer.py) or wrapped."""
    padding_free: bool = False
    """SFTConfig.padding_free: the micro-batch flattened to one row with position_ids (needs a varlen kernel)."""
    completion_only_loss: bool | None = None
    """SFTConfig.completion_only_loss (None: TRL's default, True for prompt/completion data)."""
    assistant_only_loss: bool = False
    """SFTConfig.assistant_only_loss: only assistant turns count in the loss."""
    loss_type: str | None = None
    """The TRL config's `loss_type` (SFTConfig, DPOConfig, GRPOConfig, KTOConfig). Memory depends on it for KTO:
    `apo_zero_unpaired` has no KL batch (KTOTrainer `calculate_KL`, memfit.sim.kto_steps); the other trainers'
    values are simulated as their defaults (DPO's sigmoid, GRPO's dapo). None: the trainer's default."""
    precompute_ref_log_probs: bool = False
    """DPOConfig.precompute_ref_log_probs: the reference forward runs before training, not in each step."""
    # -- GRPO: GRPOConfig's names and defaults (TRL 1.16 grpo_config.py), simulated by memfit.sim.grpo_steps --
    num_generations: int | None = None
    """GRPOConfig / RLOOConfig.num_generations: completions sampled per prompt (at least 2; divides the generation
    batch); None: the trainer's default, 8 for GRPO, 2 for RLOO (TRL 1.16)."""
    max_completion_length: int = 512
    """GRPOConfig.max_completion_length: new tokens per completion (the worst case: every completion this long).
    The prompt length is `max_length` / `example_lengths` (GRPOTrainer 1.16 does not truncate prompts)."""
    beta: float | None = None
    """GRPOConfig / RLOOConfig / KTOConfig.beta: the KL coefficient; above 0 GRPOTrainer and RLOOTrainer keep a
    reference model (a second copy of the weights; with peft the adapter is disabled instead) and score the
    completions with it (KTOTrainer always does). None: the trainer's default, 0.0 for GRPO, 0.05 for RLOO, 0.1 for
    KTO (TRL 1.16)."""
    steps_per_generation: int | None = None
    """GRPOConfig.steps_per_generation: micro-steps served by one generation; None: gradient_accumulation_steps
    (or generation_batch_size / per_device_train_batch_size)."""
    generation_batch_size: int | None = None
    """GRPOConfig.generation_batch_size: completions generated at once (per_device_train_batch_size x
    steps_per_generation when None); not with steps_per_generation."""
    num_generations_eval: int | None = None
    """GRPOConfig / RLOOConfig.num_generations_eval: completions per prompt in evaluation (the eval batch of
    `per_device_eval_batch_size` completions holds whole groups of it); None: `num_generations`."""
    num_iterations: int = 1
    """GRPOConfig.num_iterations: optimizer passes over each generation batch (above 1: old log-probs are kept)."""
    use_vllm: bool = False
    """GRPOConfig.use_vllm: vLLM generates the completions (modelled by memfit.gpus.vllm, never imported)."""
    vllm_mode: str = field(default="colocate", metadata={"choices": VLLM_MODES})
    """GRPOConfig.vllm_mode: colocate (vLLM in the training process, on the same GPU) or server (other GPUs)."""
    vllm_gpu_memory_utilization: float = 0.3
    """GRPOConfig.vllm_gpu_memory_utilization: the share of the GPU's total memory a colocated vLLM takes."""
    vllm_enable_sleep_mode: bool = False
    """GRPOConfig.vllm_enable_sleep_mode: vLLM sleeps (level 2: weights and KV cache released) outside generation."""
    reward_model: str | None = None
    """A reward model among GRPOTrainer's / RLOOTrainer's `reward_funcs` (a hub id with a bundled config, or a
    directory with config.json): TRL loads it with AutoModelForSequenceClassification (`num_labels=1`), keeps it on
    the GPU for the whole run and scores every generation batch with one forward (memfit.sim.grpo_steps
    `reward_scores`). None: the rewards are functions on the host."""
    # -- distillation: DistillationConfig (TRL 1.16 distillation_config.py), simulated by memfit.sim.distill_steps --
    teacher_model: str | None = None
    """DistillationConfig.teacher_model_name_or_path: the teacher DistillationTrainer keeps in memory beside the
    student (a hub id with a bundled config, or a directory with config.json); it must share the student's
    vocabulary. Required with `trainer="distill"`."""
    compute_capability: tuple[int, int] = (8, 0)
    """Of the target GPU: decides the SDPA backend and whether bf16 is allowed."""
    notes: list[str] = field(default_factory=list)
    """What memfit changed or assumed while reading the inputs (legacy names, ...)."""

    def __post_init__(self) -> None:
        _check_types(self)
        if self.task is not None:
            task = _TASK_ALIASES.get(str(self.task).lower(), str(self.task).lower())
            if task not in TASKS:
                raise MemfitError(f"unknown task `{self.task}`; use one of {', '.join(TASKS)}")
            self.task = task
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "max_length", "num_labels"):
            _positive_int(name, getattr(self, name))
        if self.target_length is not None:
            _positive_int("target_length", self.target_length)
        _check_media(self)
        _check_generation(self)
        if self.eval_accumulation_steps is not None:
            _positive_int("eval_accumulation_steps", self.eval_accumulation_steps)
        if self.eval_samples is not None:
            _positive_int("eval_samples", self.eval_samples)
        if self.example_lengths is not None:
            lengths = list(self.example_lengths)
            if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in lengths):
                raise MemfitError(
                    "`example_lengths` must be a non-empty list of positive token counts; "
                    f"got `{self.example_lengths if len(lengths) < 8 else str(lengths[:8]) + '...'}`"
                )
            self.example_lengths = lengths
        if self.weights_dtype not in ("auto",) + PRECISIONS:
            raise MemfitError(f"weights_dtype `{self.weights_dtype}` is not one of auto, {', '.join(PRECISIONS)}")
        if self.precision not in PRECISIONS:
            raise MemfitError(f"precision `{self.precision}` is not one of {', '.join(PRECISIONS)}")
        if self.precision == "bf16" and tuple(self.compute_capability) < (8, 0):
            raise MemfitError(
                f"bf16 needs a GPU of compute capability 8.0 or newer; this one has `{self.compute_capability}`. "
                "Use `--precision fp16` on V100/T4-class GPUs"
            )
        if self.optim not in OPTIMIZERS:
            raise MemfitError(f"optim `{self.optim}` is not supported; use one of {', '.join(OPTIMIZERS)}")
        if self.weight_decay < 0:
            raise MemfitError(f"weight_decay `{self.weight_decay}` is negative; use 0 or more")
        if self.max_grad_norm is None or self.max_grad_norm < 0:
            raise MemfitError(f"max_grad_norm `{self.max_grad_norm}` must be 0 (off) or positive")
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS \
                and self.attn_implementation not in HUB_FLASH_KERNELS:
            raise MemfitError(f"attn_implementation `{self.attn_implementation}` is not modelled; use one of "
                              f"{', '.join(ATTN_IMPLEMENTATIONS)} or a flash-attn hub kernel ({', '.join(HUB_FLASH_KERNELS)})")
        _check_kwargs_settings(self)
        if self.eval_strategy not in EVAL_STRATEGIES:
            raise MemfitError(f"eval_strategy `{self.eval_strategy}` must be `no`, `steps` or `epoch`")
        if self.lora_r is not None:
            _positive_int("lora_r", self.lora_r)
        if not isinstance(self.freeze_layers, int) or isinstance(self.freeze_layers, bool) or self.freeze_layers < 0:
            raise MemfitError(f"`freeze_layers` must be 0 or a positive number of blocks; got `{self.freeze_layers!r}`")
        _check_peft(self)  # peft methods
        _check_quantization(self)
        _check_trl(self)  # TRL
        _check_float8(self)  # torchao Float8 training
        # task None: memfit.models.resolve fills it from the model, then checks the setup again
        if self.task is not None and self.trainer not in ("trainer", "reward") and self.task != "causal-lm" \
                and not (self.trainer == "sft" and self.task == "image-text-to-text"):  # TRL (SFT: its VLM collator)
            raise MemfitError(f"trainer `{self.trainer}` trains a causal language model, but the task is "
                              f"`{self.task}`; use `task='causal-lm'` (a *ForCausalLM model)")

    # -- derived ---------------------------------------------------------------------------
    @property
    def sequence_length(self) -> int:
        """Tokens per example in the worst (longest) padded batch."""
        if self.example_lengths is None:
            return self.max_length
        longest = max(self.example_lengths)
        return min(longest, self.max_length) if self.truncation else longest

    @property
    def image_wh(self) -> tuple[int, int] | None:
        """`image_size` as (width, height) in pixels; None when not given."""
        if self.image_size is None:
            return None
        width, height = str(self.image_size).lower().split("x")
        return int(width), int(height)

    # -- TRL ----------------------------------------------------------------------
    @property
    def is_padding_free(self) -> bool:
        """Whether the micro-batch is flattened to one row: `padding_free`, or packing with a bfd strategy
        (SFTTrainer.__init__: `args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})`)."""
        return self.trainer == "sft" and (self.padding_free or (self.packing and self.packing_strategy != "wrapped"))

    @property
    def padding_free_tokens(self) -> int:
        """Tokens of the flattened row of the worst padding-free micro-batch.

        Packed: `per_device_train_batch_size` packs of at most `max_length` tokens each (TRL's pack_dataset
        fills each pack up to max_length), at most the dataset's tokens. Not packed: the B longest examples
        untruncated (TRL enforces no max_length there: SFTTrainer raises when padding_free is set without
        packing and max_length is not None)."""
        b = self.per_device_train_batch_size
        if self.packing:
            full = b * self.max_length
            if self.example_lengths is None:
                return full
            return max(1, min(full, sum(min(n, self.max_length) for n in self.example_lengths)))
        if self.example_lengths is None:
            return b * self.max_length
        return sum(sorted(self.example_lengths, reverse=True)[:b])

    @property
    def grpo_sizes(self) -> tuple[int, int]:
        """GRPO on one process: (steps_per_generation, generation_batch_size) as GRPOConfig derives them."""
        return grpo_generation_sizes(self.per_device_train_batch_size, self.gradient_accumulation_steps,
                                     self.steps_per_generation, self.generation_batch_size)

    @property
    def effective_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def does_eval(self) -> bool:
        return self.eval_strategy != "no"

    def replace(self, **changes: Any) -> "TrainSetup":
        return dataclasses.replace(self, **changes)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, model: Any = None, *, training_args: dict[str, Any] | None = None,
                    args_source: str | None = None, **fields: Any) -> "TrainSetup":
        """Build from TrainSetup fields plus a dict of TrainingArguments kwargs.

        Args:
            model: the model (hub id, directory, config, nn.Module); None: `training_args["model"]`, else
                the TrainSetup default.
            training_args: TrainingArguments kwargs (legacy names read with a note, unknown names a
                MemfitError naming the closest valid one); TrainSetup fields (`max_length`, `model`, ...)
                are accepted there too. TrainingArguments settings that do not change GPU memory
                (learning_rate, ...) are checked by name and not used.
            args_source: where `training_args` came from, for the notes (an arguments file's path).
            **fields: TrainSetup fields, or TrainingArguments names (`fp16=True`); they win over
                `training_args`, with a note when they change a value given there.
        """
        notes: list[str] = list(fields.pop("notes", []))
        setup_names = _setup_field_names()
        trainer = fields.get("trainer", (training_args or {}).get("trainer"))  # TRL
        trl_names = TRL_CONFIG_NAMES.get(trainer, frozenset()) if isinstance(trainer, str) else frozenset()
        for key in fields:
            if (key not in setup_names and key not in TRAINING_ARGS_NAMES and key not in LEGACY_ARG_NAMES
                    and key != "quantization_config" and key not in trl_names
                    and not (trl_names and key in (_GRPO_REMOVED if trainer in GENERATING_TRAINERS else _TRL_REMOVED))):
                raise MemfitError(f"unknown setting `{key}`{suggest_name(key, setup_names | TRAINING_ARGS_NAMES)}; "
                                  "TrainSetup fields mirror TrainingArguments names")
        source = args_source or "the training arguments"
        base = _merge_arg_values(training_args or {}, notes, source=source, trainer=trainer)
        over = _merge_arg_values({k: v for k, v in fields.items() if k not in setup_names}, notes, source="the keywords",
                                 trainer=trainer)
        over.update({k: v for k, v in fields.items() if k in setup_names})
        for key, value in over.items():
            if key in base and base[key] != value and key != "model":
                notes.append(f"`{key}` given twice: {value!r} overrides {base[key]!r} of {source}")
        merged = {**base, **over}
        if trainer in _BASE_CONFIG_DEFAULTS:  # TRL's base config (trl/trainer/base_config.py) changes two defaults
            cfg = TRL_CONFIG_CLASS_NAMES[trainer]
            if "gradient_checkpointing" not in merged:
                merged["gradient_checkpointing"] = True
                notes.append(f"gradient checkpointing is on: {cfg}'s default (TRL 1.16); "
                             "`gradient_checkpointing=false` turns it off")
            if "precision" not in merged:
                merged["precision"] = "bf16"
                notes.append(f"bf16 mixed precision: {cfg}'s default when fp16 is not set (TRL 1.16)")
        if model is not None:
            if "model" in merged and merged["model"] != model:
                notes.append(f"model `{model}` overrides `{merged['model']}` of {source}")
            merged["model"] = model
        return cls(notes=notes, **merged)

    @classmethod
    def from_training_args(cls, args: Any, model: Any = None, **fields: Any) -> "TrainSetup":
        """Build from a `transformers.TrainingArguments` object, or TRL's `SFTConfig` / `DPOConfig` (read as
        `trainer="sft"` / `"dpo"` with their max_length, packing, padding_free, ... unless `fields` say otherwise)."""
        kwargs = {name: getattr(args, name) for name in list(_ARG_TO_FIELD) + ["fp16", "bf16"] if hasattr(args, name)}
        trainer = fields.get("trainer") or _TRL_CONFIG_CLASSES.get(type(args).__name__)  # TRL
        if trainer in TRL_TRAINERS:
            kwargs["trainer"] = trainer
            for name in _TRL_READ[trainer]:
                value = getattr(args, name, None)
                if value is not None:
                    kwargs[name] = value
            if getattr(args, "max_length", 1) is None:
                kwargs.pop("max_length", None)
                fields.setdefault("notes", []).append(
                    f"{type(args).__name__}.max_length is None (no truncation); memfit uses the example lengths "
                    "or its own max_length")
        return cls.from_kwargs(model, training_args=kwargs, **fields)

    @classmethod
    def from_json(cls, path: str | os.PathLike, model: Any = None, **fields: Any) -> "TrainSetup":
        """Build from a JSON file of TrainingArguments kwargs, e.g. `{"per_device_train_batch_size": 1, ...}`;
        TrainSetup fields (`"model"`, `"max_length"`) may be in it too. `fields` win over the file."""
        raw = read_args_file(path)
        data, notes = normalize_arg_names(raw, source=f"`{path}`", trainer=fields.get("trainer", raw.get("trainer")))
        fields["notes"] = [*fields.get("notes", []), *notes]
        return cls.from_kwargs(model, training_args=data, args_source=f"`{path}`", **fields)


def read_args_file(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of an arguments file (`--args`), or a one-line MemfitError saying what is wrong with it."""
    return read_json_object(path, "arguments file", "pass a JSON file of TrainingArguments kwargs")


#: TRL config class name -> `trainer` (TRL); by name, so that TrainSetup does not import TRL.
_TRL_CONFIG_CLASSES = {"SFTConfig": "sft", "DPOConfig": "dpo", "GRPOConfig": "grpo", "RLOOConfig": "rloo",
                       "RewardConfig": "reward", "KTOConfig": "kto", "DistillationConfig": "distill"}
#: The trainers whose config's defaults `from_kwargs` applies: `gradient_checkpointing=True` and bf16 unless fp16
#: (trl/trainer/base_config.py `_BaseConfig`, which every TRL 1.16 config subclasses).
_BASE_CONFIG_DEFAULTS = ("grpo", "rloo", "reward", "kto", "distill")
#: TRL config fields that are TrainSetup fields (read from an SFTConfig / DPOConfig object).
_TRL_READ = {
    "sft": ("max_length", "packing", "packing_strategy", "padding_free", "completion_only_loss", "assistant_only_loss",
            "activation_offloading", "use_liger_kernel"),
    "dpo": ("max_length", "precompute_ref_log_probs", "activation_offloading", "sync_ref_model", "use_liger_kernel"),
    # generation_batch_size is left out: GRPOConfig.__post_init__ has derived both it and steps_per_generation
    "grpo": ("num_generations", "num_generations_eval", "max_completion_length", "beta", "steps_per_generation", "num_iterations", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode",
             "use_liger_kernel"),
    "rloo": ("num_generations", "num_generations_eval", "max_completion_length", "beta", "steps_per_generation", "num_iterations", "use_vllm",
             "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "use_liger_kernel"),
    "reward": ("max_length", "activation_offloading", "use_liger_kernel"),
    "kto": ("max_length", "beta", "loss_type", "precompute_ref_log_probs", "activation_offloading", "sync_ref_model",
            "use_liger_kernel"),
    "distill": ("max_completion_length", "beta", "use_vllm", "use_liger_kernel", "teacher_model_name_or_path"),
}


def _merge_arg_values(data: dict[str, Any], notes: list[str], *, source: str, trainer: Any = None) -> dict[str, Any]:
    """TrainingArguments kwargs (and TrainSetup fields) -> TrainSetup fields; appends notes."""
    data, more = normalize_arg_names(data, source=source, trainer=trainer)
    notes.extend(more)
    setup_names = _setup_field_names()
    merged: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("fp16", "bf16"):
            if not isinstance(value, bool):
                raise MemfitError(f"`{key}` must be true or false; got `{value!r}`")
            if value:
                if merged.get("precision") not in (None, key):
                    raise MemfitError("`fp16=True` and `bf16=True` were both given; choose one")
                merged["precision"] = key
            continue
        if key == "quantization_config":  # quantization: a dict or a BitsAndBytesConfig
            merged.update(quantization_fields(value, source=source))
            continue
        if key in _TRL_NOT_MODELLED and value not in (None, False, "", [], {}, 0):  # TRL
            notes.append(f"`{key}` (TRL) is set but not modelled by memfit: the estimate is of a run without it")
            continue
        if key in ENGINE_ARG_NAMES:
            if value not in (None, False, "", [], {}, 0) and key in ("deepspeed", "fsdp"):
                notes.append(f"`{key}` chooses the multi-GPU engine, which a TrainSetup does not hold: pass "
                             "`parallel=memfit.parallel.parallel_from_training_args(args, world_size=N)` to "
                             "estimate() (the CLI reads it from --args)")
            continue
        if key in _NOT_MODELLED_ARGS and value not in (None, False, "", [], {}, 0):
            notes.append(f"`{key}` is set but not modelled by memfit: the estimate is of a run without it")
            continue
        if key in _ARG_TO_FIELD:
            merged[_ARG_TO_FIELD[key]] = value
        elif key in setup_names:
            merged[key] = value
    for key in ("optim", "eval_strategy"):  # TrainingArguments holds enums (OptimizerNames, IntervalStrategy)
        if merged.get(key) is not None:
            merged[key] = str(getattr(merged[key], "value", merged[key]))
    return merged


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MemfitError(f"`{name}` must be a positive integer; got `{value!r}`")


def _check_media(setup: "TrainSetup") -> None:
    """Image and audio settings: their values, and a one-line MemfitError when the task takes no such input."""
    if setup.image_size is not None:
        text = str(setup.image_size).strip().lower()
        parts = text.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise MemfitError(f"image size `{setup.image_size}` is not WIDTHxHEIGHT in pixels; write e.g. "
                              "`--image-size 1024x768`")
        setup.image_size = text
    _positive_int("images_per_example", setup.images_per_example)
    if setup.video_frames is not None:
        _positive_int("video_frames", setup.video_frames)
    if not isinstance(setup.pan_and_scan, bool):
        raise MemfitError(f"`pan_and_scan` must be true or false; got `{setup.pan_and_scan!r}`")
    seconds = setup.audio_seconds
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not math.isfinite(seconds) or seconds <= 0):
        raise MemfitError(f"`audio_seconds` must be a positive number of seconds; got `{seconds!r}`")
    if setup.sampling_rate is not None:
        _positive_int("sampling_rate", setup.sampling_rate)
    if setup.freeze_feature_encoder is not None and not isinstance(setup.freeze_feature_encoder, bool):
        raise MemfitError(f"`freeze_feature_encoder` must be true, false or unset; got `{setup.freeze_feature_encoder!r}`")
    if setup.task is None:  # memfit.models.resolve fills the task, then the setup is checked again
        return
    # the freezing of a part of an image or speech model: only where the task's models have that part
    for flag, tasks in (("freeze_feature_encoder", ("ctc",)), ("freeze_encoder", ("speech-seq2seq",)),
                        ("freeze_vision_tower", ("image-cls", "image-text-to-text")),
                        ("freeze_projector", ("image-text-to-text",))):
        if getattr(setup, flag) and setup.task not in tasks:
            dashed = "--" + flag.replace("_", "-")
            raise MemfitError(f"`{dashed}` is set but the run is `{setup.task}`, whose models have no such part "
                              f"(it is for {' / '.join(tasks)}); drop {dashed}")
    name = setup.model if isinstance(setup.model, str) else type(setup.model).__name__
    if setup.task not in IMAGE_TASKS:
        if setup.image_size is not None or setup.images_per_example != 1:
            flag = "--image-size" if setup.image_size is not None else "--images-per-example"
            raise MemfitError(f"`{flag}` is set but `{name}` is fine-tuned as `{setup.task}`, which takes no "
                              f"images; drop {flag}, or choose an image model or task (`--task image-cls`)")
    elif setup.images_per_example != 1 and setup.task == "image-cls":
        raise MemfitError(f"image classification takes one image per example; got `images_per_example` "
                          f"{setup.images_per_example}: drop --images-per-example")
    if setup.video_frames is not None and setup.task != "image-text-to-text":
        raise MemfitError(f"`--video-frames` is set but `{name}` is fine-tuned as `{setup.task}`, which takes no video; "
                          "drop --video-frames, or choose a vision-language model that takes video")
    if setup.pan_and_scan and setup.task != "image-text-to-text":
        raise MemfitError(f"`--pan-and-scan` is set but `{name}` is fine-tuned as `{setup.task}`; it crops the images "
                          "of Gemma 3's processor (image-text-to-text): drop --pan-and-scan")
    if setup.task not in AUDIO_TASKS and (setup.audio_seconds is not None or setup.sampling_rate is not None):
        flag = "--audio-seconds" if setup.audio_seconds is not None else "--sampling-rate"
        raise MemfitError(f"`{flag}` is set but `{name}` is fine-tuned as `{setup.task}`, which takes no audio; "
                          f"drop {flag}, or choose a speech model (`--task speech-seq2seq` or `--task ctc`)")


#: The tasks whose evaluation can generate (Seq2SeqTrainer's `predict_with_generate`).
GENERATE_EVAL_TASKS = ("seq2seq-lm", "speech-seq2seq")


def _check_generation(setup: "TrainSetup") -> None:
    """`predict_with_generate` and its sizes: their values, and only for an encoder-decoder task."""
    for name in ("generation_max_length", "generation_num_beams"):
        if getattr(setup, name) is not None:
            _positive_int(name, getattr(setup, name))
    if setup.task is None or not setup.predict_with_generate:  # resolve fills the task, then it is checked again
        return
    if setup.task not in GENERATE_EVAL_TASKS:
        raise MemfitError(f"`--predict-with-generate` is set but the run is `{setup.task}`; Seq2SeqTrainer generates "
                          f"in evaluation only for {' / '.join(GENERATE_EVAL_TASKS)}: drop --predict-with-generate")


def _check_types(setup: "TrainSetup") -> None:
    """A MemfitError for a value of the wrong type (from JSON or keywords), before any comparison on it."""
    for name in ("truncation", "gradient_checkpointing", "prediction_loss_only", "freeze_embeddings", "freeze_encoder",
                 "freeze_vision_tower", "freeze_projector", "predict_with_generate",
                 "offload_optimizer_state", "load_in_4bit", "load_in_8bit", "bnb_4bit_use_double_quant", "kbit_prep",
                 "kbit_use_gradient_checkpointing",
                 "use_liger_kernel", "activation_offloading", "use_dora"):
        value = getattr(setup, name)
        if not isinstance(value, bool):
            raise MemfitError(f"`{name}` must be true or false; got `{value!r}`")
    for name in ("weight_decay", "max_grad_norm", "lora_dropout"):
        value = getattr(setup, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MemfitError(f"`{name}` must be a finite number; got `{value!r}`")
    if isinstance(setup.lora_alpha, bool) or not isinstance(setup.lora_alpha, (int, float)) or setup.lora_alpha <= 0:
        raise MemfitError(f"`lora_alpha` must be a positive number; got `{setup.lora_alpha!r}`")
    for name in ("task", "precision", "weights_dtype", "optim", "eval_strategy", "attn_implementation",
                 "bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        value = getattr(setup, name)
        if value is not None and not isinstance(value, str):
            raise MemfitError(f"`{name}` must be a string; got `{value!r}`")
    if setup.example_lengths is not None and not isinstance(setup.example_lengths, (list, tuple)):
        raise MemfitError(f"`example_lengths` must be a list of token counts; got `{setup.example_lengths!r}`")
    mods = setup.lora_target_modules
    if isinstance(mods, str):  # peft's `all-linear`, or a regex: peft takes a string as it is
        setup.lora_target_modules = mods = [mods] if mods.lower() == "all-linear" else mods
    elif mods is not None and (not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods)):
        raise MemfitError(f"`lora_target_modules` must be a list of module names, `all-linear` or a regex; "
                          f"got `{mods!r}`")
    cc = setup.compute_capability
    if not (isinstance(cc, (list, tuple)) and len(cc) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                  for x in cc)):
        raise MemfitError(f"`compute_capability` must be two integers like `(8, 0)`; got `{cc!r}`")
    if not isinstance(setup.notes, list):
        raise MemfitError(f"`notes` must be a list of strings; got `{setup.notes!r}`")



# -- quantization -------------------------------------------------------------------
#: `bnb_4bit_compute_dtype` spellings -> torch dtype name (BitsAndBytesConfig takes a torch dtype or its name).
_COMPUTE_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                   "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
#: BitsAndBytesConfig keys -> TrainSetup field (`to_dict()` also writes `_load_in_4bit` / `_load_in_8bit`).
_BNB_KEYS = {
    "load_in_4bit": "load_in_4bit", "_load_in_4bit": "load_in_4bit",
    "load_in_8bit": "load_in_8bit", "_load_in_8bit": "load_in_8bit",
    "bnb_4bit_quant_type": "bnb_4bit_quant_type", "bnb_4bit_compute_dtype": "bnb_4bit_compute_dtype",
    "bnb_4bit_use_double_quant": "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage": "bnb_4bit_quant_storage",
    "llm_int8_threshold": "llm_int8_threshold", "llm_int8_skip_modules": "llm_int8_skip_modules",
}
#: BitsAndBytesConfig keys read but not changing the estimate when left at their defaults.
_BNB_DEFAULT_ONLY = {"llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False}


def quantization_fields(config: Any, *, source: str = "the arguments") -> dict[str, Any]:
    """TrainSetup fields from a `quantization_config`: a dict (as JSON holds it) or a `BitsAndBytesConfig`.

    Args:
        config: the quantization config; an object with `to_dict()` (BitsAndBytesConfig) is read through it.
        source: where it came from, for the messages.
    """
    if hasattr(config, "to_dict") and not isinstance(config, dict):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise MemfitError(f"`quantization_config` in {source} must be a dict or a BitsAndBytesConfig; "
                          f"got `{type(config).__name__}`")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == "quant_method":
            method = str(getattr(value, "value", value))
            if method != "bitsandbytes":
                raise MemfitError(f"`quantization_config` quant_method `{method}` is not modelled; memfit simulates "
                                  "bitsandbytes (`BitsAndBytesConfig`) only")
        elif key in _BNB_DEFAULT_ONLY:
            if value not in (None, _BNB_DEFAULT_ONLY[key]):
                raise MemfitError(f"`quantization_config` {key}=`{value!r}` is not modelled; memfit simulates the "
                                  f"default `{_BNB_DEFAULT_ONLY[key]}`")
        elif key in _BNB_KEYS:
            if key.endswith("_dtype") or key.endswith("_storage"):
                value = None if value is None else str(value).removeprefix("torch.")
            out[_BNB_KEYS[key]] = value
        else:
            raise MemfitError(f"unknown `quantization_config` key `{key}` in {source}"
                              f"{suggest_name(key, set(_BNB_KEYS))}; memfit reads BitsAndBytesConfig's fields")
    if out.get("bnb_4bit_quant_storage") is None:
        out.pop("bnb_4bit_quant_storage", None)
    return out


def _check_quantization(setup: "TrainSetup") -> None:
    """Bad quantization values and impossible combinations: one-line MemfitErrors."""
    if setup.load_in_4bit and setup.load_in_8bit:
        # BitsAndBytesConfig.__init__ raises the same ValueError
        raise MemfitError("`load_in_4bit` and `load_in_8bit` are both true; only one can be used at the same time")
    if setup.bnb_4bit_quant_type not in BNB_4BIT_QUANT_TYPES:
        raise MemfitError(f"bnb_4bit_quant_type `{setup.bnb_4bit_quant_type}` must be `nf4` or `fp4`")
    if setup.bnb_4bit_compute_dtype is not None:
        name = _COMPUTE_DTYPES.get(setup.bnb_4bit_compute_dtype.lower())
        if name is None:
            raise MemfitError(f"bnb_4bit_compute_dtype `{setup.bnb_4bit_compute_dtype}` must be one of fp32, fp16, bf16")
        setup.bnb_4bit_compute_dtype = name
        if name == "bfloat16" and setup.load_in_4bit and tuple(setup.compute_capability) < (8, 0):
            raise MemfitError(f"bnb_4bit_compute_dtype `bf16` needs compute capability 8.0 or newer; this GPU has "
                              f"`{tuple(setup.compute_capability)}`. Use `--bnb-4bit-compute-dtype fp16`")
    if setup.bnb_4bit_quant_storage not in QUANT_STORAGE_DTYPES:
        raise MemfitError(f"bnb_4bit_quant_storage `{setup.bnb_4bit_quant_storage}` must be one of "
                          f"{', '.join(QUANT_STORAGE_DTYPES)}")
    t = setup.llm_int8_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise MemfitError(f"`llm_int8_threshold` must be a finite number >= 0; got `{t!r}`")
    mods = setup.llm_int8_skip_modules
    if mods is not None and (not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods)):
        raise MemfitError(f"`llm_int8_skip_modules` must be a list of module names; got `{mods!r}`")
    if (setup.load_in_4bit or setup.load_in_8bit) and setup.kbit_prep and setup.kbit_use_gradient_checkpointing \
            and not setup.gradient_checkpointing:
        # peft/utils/other.py prepare_model_for_kbit_training(use_gradient_checkpointing=True) calls
        # model.gradient_checkpointing_enable(); Trainer never turns it off (it only enables it when asked)
        setup.gradient_checkpointing = True
        setup.notes = [*setup.notes, "gradient checkpointing is on: peft's prepare_model_for_kbit_training, which "
                       "quantized models get (kbit_prep), enables it by default; --no-kbit-use-gradient-checkpointing (peft's "
                       "use_gradient_checkpointing=False) or --no-kbit-prep leaves it to you"]
    if (setup.load_in_4bit or setup.load_in_8bit) and setup.lora_r is None and not setup.peft_config:
        # transformers 5.24 trainer_utils.validate_quantization_for_training, called by Trainer.__init__
        raise MemfitError("a quantized model (`load_in_4bit`/`load_in_8bit`) cannot be fine-tuned without adapters: "
                          "Trainer raises 'You cannot perform fine-tuning on purely quantized models'; add LoRA "
                          "(`--lora-r 16`)")


def _check_float8(setup: "TrainSetup") -> None:
    """torchao Float8 training (memfit.models.float8): a one-line MemfitError when `float8_recipe` cannot run
    with this setup: float8 runs under bf16 autocast, and memfit models it without quantized weights or adapters."""
    recipe = setup.float8_recipe
    if recipe is None:
        return
    if not isinstance(recipe, str) or recipe not in FLOAT8_RECIPES:
        raise MemfitError(f"float8 recipe `{recipe}` is not one of {', '.join(FLOAT8_RECIPES)} "
                          "(torchao Float8LinearRecipeName); use e.g. `--float8 tensorwise`")
    if setup.precision != "bf16":
        raise MemfitError(f"float8 training runs under bf16 autocast (accelerate mixed_precision=\"fp8\"), but "
                          f"precision is `{setup.precision}`; use `--precision bf16`")
    if setup.load_in_4bit or setup.load_in_8bit or setup.lora_r is not None or setup.peft_config:
        what = "bitsandbytes-quantized weights" if setup.load_in_4bit or setup.load_in_8bit else "LoRA / peft adapters"
        raise MemfitError(f"float8 training with {what} is not modelled (accelerate would convert the adapter's "
                          f"linears too); drop `--float8 {recipe}` or the {what}")


def _check_peft(setup: "TrainSetup") -> None:
    """peft methods: LoRA given once, `use_dora` only with LoRA. peft reads and checks `peft_config`
    itself in memfit.models.resolve (memfit.models.peft_methods)."""
    if setup.peft_config is not None:
        if setup.lora_r is not None:
            raise MemfitError("both `lora_r` and `peft_config` are set; give LoRA by its fields (`lora_r`, "
                              "`use_dora`, ...) or by `peft_config` with `\"peft_type\": \"LORA\"`, not both")
    if setup.use_dora and setup.lora_r is None:
        raise MemfitError("`use_dora` is a LoRA setting but no LoRA rank is set; add `lora_r` (`--lora-r 16 --use-dora`)")


def _check_kwargs_settings(setup: "TrainSetup") -> None:
    """Liger / checkpointing kwargs / offloading: a MemfitError for a value memfit cannot read."""
    for name, keys in (("liger_kernel_config", LIGER_CONFIG_KEYS), ("gradient_checkpointing_kwargs", CHECKPOINT_KWARGS)):
        value = getattr(setup, name)
        if value is None:
            continue
        if isinstance(value, str):  # TrainingArguments accepts a JSON string for these dicts
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise MemfitError(f"`{name}` `{value}` is not a JSON object ({err.msg}); pass a dict") from err
        if not isinstance(value, dict):
            raise MemfitError(f"`{name}` must be a dict; got `{value!r}`")
        for key in value:
            if key not in keys:
                raise MemfitError(f"`{name}` key `{key}` is not modelled{suggest_name(key, set(keys))}; "
                                  f"memfit reads {', '.join(keys)}")
        setattr(setup, name, dict(value))
    kw = setup.gradient_checkpointing_kwargs or {}
    for key in ("use_reentrant", "offload"):
        if key in kw and not isinstance(kw[key], bool):
            raise MemfitError(f"`gradient_checkpointing_kwargs[{key!r}]` must be true or false; got `{kw[key]!r}`")
    if "every_n_layers" in kw:
        _positive_int("gradient_checkpointing_kwargs['every_n_layers']", kw["every_n_layers"])
    for key, value in (setup.liger_kernel_config or {}).items():
        if not isinstance(value, bool):
            raise MemfitError(f"`liger_kernel_config[{key!r}]` must be true or false; got `{value!r}`")


#: Per trainer, the defaults of TrainSetup fields left None (TRL 1.16 grpo_config.py, rloo_config.py, kto_config.py);
#: other trainers: `fallback`.
_TRAINER_DEFAULTS = {"num_generations": ({"grpo": 8, "rloo": 2}, 8),
                     "beta": ({"grpo": 0.0, "rloo": 0.05, "kto": 0.1, "distill": 1.0}, 0.0)}


def _trainer_defaults(setup: "TrainSetup") -> None:
    """`num_generations` / `beta` left None: the trainer's own default."""
    for name, (per_trainer, fallback) in _TRAINER_DEFAULTS.items():
        if getattr(setup, name) is None:
            setattr(setup, name, per_trainer.get(setup.trainer, fallback))


def _check_trl(setup: "TrainSetup") -> None:
    """TRL: the TRL fields' values, and the combinations TRL 1.16 itself refuses or changes."""
    if not isinstance(setup.trainer, str):
        raise MemfitError(f"trainer must be one of {', '.join(TRAINERS)}; got `{setup.trainer!r}`")
    if setup.trainer in _TRL_NOT_SIMULATED:
        raise MemfitError(f"trainer `{setup.trainer}` ({_TRL_NOT_SIMULATED[setup.trainer]}) is not supported by memfit; "
                          f"it simulates {', '.join(TRAINERS)}")
    if setup.trainer not in TRAINERS:
        raise MemfitError(f"trainer `{setup.trainer}` is not one of {', '.join(TRAINERS)}"
                          f"{suggest_name(setup.trainer, set(TRAINERS))}")
    _trainer_defaults(setup)
    for name in ("packing", "padding_free", "assistant_only_loss", "precompute_ref_log_probs"):
        if not isinstance(getattr(setup, name), bool):
            raise MemfitError(f"`{name}` must be true or false; got `{getattr(setup, name)!r}`")
    if setup.completion_only_loss is not None and not isinstance(setup.completion_only_loss, bool):
        raise MemfitError(f"`completion_only_loss` must be true, false or null; got `{setup.completion_only_loss!r}`")
    strategy = setup.packing_strategy
    if isinstance(strategy, str):
        strategy = {"bfd-requeue": "bfd_split"}.get(strategy, strategy)  # sft_config.py rename
    if not isinstance(strategy, str) or strategy not in PACKING_STRATEGIES:
        raise MemfitError(f"packing_strategy `{setup.packing_strategy}` is not one of {', '.join(PACKING_STRATEGIES)} "
                          "(SFTConfig, TRL 1.16)")
    setup.packing_strategy = strategy
    sft_only = [n for n in ("packing", "assistant_only_loss") if getattr(setup, n)]
    if setup.completion_only_loss:
        sft_only.append("completion_only_loss")
    if sft_only and setup.trainer != "sft":
        raise MemfitError(f"`{sft_only[0]}` is an SFTTrainer setting but trainer is `{setup.trainer}`; "
                          "pass `trainer='sft'` (`--trainer sft`)")
    if setup.loss_type is not None and "loss_type" not in TRL_CONFIG_NAMES.get(setup.trainer, ()):
        raise MemfitError(f"`loss_type` is a setting of TRL's SFTConfig, DPOConfig, GRPOConfig and KTOConfig but "
                          f"trainer is `{setup.trainer}`; pass the trainer it is for (`--trainer kto`) or drop it")
    if setup.precompute_ref_log_probs and setup.trainer not in ("dpo", "kto"):
        raise MemfitError("`precompute_ref_log_probs` is a DPOTrainer setting (KTOTrainer's too) but trainer is "
                          f"`{setup.trainer}`; pass `trainer='dpo'` (`--trainer dpo`) or `trainer='kto'`")
    if setup.padding_free and setup.trainer == "dpo":
        # DPOTrainer.__init__ (TRL 1.16): "padding_free=True is temporarily unavailable ... Falling back"
        setup.padding_free = False
        setup.notes = [*setup.notes, "DPOTrainer (TRL 1.16) ignores padding_free=True and pads (dpo_trainer.py); "
                                     "simulated padded"]
    elif setup.padding_free and setup.trainer != "sft":
        raise MemfitError(f"`padding_free` is an SFTTrainer setting but trainer is `{setup.trainer}`; "
                          "pass `trainer='sft'` (`--trainer sft`)")
    _check_grpo(setup)
    _check_reward_and_kto(setup)
    _check_distill(setup)


def _check_distill(setup: "TrainSetup") -> None:
    """DistillationTrainer: a teacher model, and the settings memfit simulates for it (one-line errors)."""
    if setup.trainer != "distill":
        if setup.teacher_model is not None:
            raise MemfitError(f"`teacher_model` is a DistillationTrainer setting but trainer is `{setup.trainer}`; "
                              "pass `trainer='distill'` (`--trainer distill`)")
        return
    if setup.teacher_model is None:
        raise MemfitError("trainer `distill` needs the teacher DistillationTrainer keeps in memory: pass "
                          "`teacher_model` (`--teacher-model Qwen/Qwen2.5-7B`, DistillationConfig's "
                          "`teacher_model_name_or_path` in --args)")
    if not isinstance(setup.teacher_model, str):
        raise MemfitError(f"`teacher_model` must be a hub id or a directory; got `{setup.teacher_model!r}`")
    if setup.use_vllm:
        raise MemfitError("`use_vllm` with trainer `distill` is not modelled (memfit models vLLM for GRPO and RLOO); "
                          "drop `use_vllm` to estimate generation with transformers")
    _positive_int("max_completion_length", setup.max_completion_length)
    b = setup.beta
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
        raise MemfitError(f"`beta` must be in [0, 1] (DistillationConfig's interpolation: 0 forward KL, 1 reverse KL, "
                          f"between them the generalized JSD); got `{b!r}`")


def _check_reward_and_kto(setup: "TrainSetup") -> None:
    """RewardTrainer: a sequence-classification model of one label (reward_trainer.py `__init__` loads
    `AutoModelForSequenceClassification` with `num_labels=1` and refuses a model of another), so the task is
    `seq-cls`. KTOTrainer: `beta` a number."""
    if setup.trainer == "reward":
        if setup.task is None:
            setup.task = "seq-cls"
            setup.notes = [*setup.notes, "RewardTrainer trains a sequence-classification model with one output (the "
                                         "reward): the model is built as AutoModelForSequenceClassification, "
                                         "num_labels=1 (TRL 1.16 reward_trainer.py)"]
        elif setup.task != "seq-cls":
            raise MemfitError(f"trainer `reward` trains a sequence-classification head (AutoModelForSequenceClassification"
                              f", one label), but the task is `{setup.task}`; use `task='seq-cls'` or leave it out")
        setup.num_labels = 1
    if setup.trainer == "kto":
        b = setup.beta
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise MemfitError(f"`beta` must be a finite number (KTOConfig's KL coefficient); got `{b!r}`")
        if setup.loss_type is None:
            setup.loss_type = "kto"  # KTOConfig's default
        if setup.loss_type not in KTO_LOSS_TYPES:
            raise MemfitError(f"loss_type `{setup.loss_type}` is not a KTOConfig loss type (TRL 1.16): use one of "
                              f"{', '.join(KTO_LOSS_TYPES)}{suggest_name(setup.loss_type, set(KTO_LOSS_TYPES))}")
        if setup.per_device_train_batch_size <= 1 and setup.loss_type != "apo_zero_unpaired":
            # KTOTrainer.__init__ (`calculate_KL`: every loss type but apo_zero_unpaired): "Actual (not effective)
            # batch size must be > 1"
            raise MemfitError(f"per_device_train_batch_size `{setup.per_device_train_batch_size}` is too small for KTO: "
                              "KTOTrainer needs at least 2 examples per micro-batch (its KL term pairs each prompt "
                              "with another example's completion); use 2 or more, or loss_type `apo_zero_unpaired` "
                              "(no KL term)")


def grpo_generation_sizes(per_device_train_batch_size: int, gradient_accumulation_steps: int,
                          steps_per_generation: int | None, generation_batch_size: int | None,
                          num_processes: int = 1) -> tuple[int, int]:
    """(steps_per_generation, generation_batch_size) as GRPOConfig.__post_init__ (TRL 1.16 grpo_config.py) derives
    them, or a MemfitError where it raises ValueError. `generation_batch_size` counts completions of all processes."""
    global_batch = per_device_train_batch_size * num_processes
    if generation_batch_size is None and steps_per_generation is None:
        return gradient_accumulation_steps, global_batch * gradient_accumulation_steps
    if generation_batch_size is not None and steps_per_generation is None:
        if generation_batch_size % global_batch != 0:
            raise MemfitError(f"generation_batch_size `{generation_batch_size}` must be divisible by the global batch "
                              f"size ({per_device_train_batch_size} x {num_processes} processes = {global_batch}), as "
                              f"GRPOConfig requires; use a multiple of {global_batch}")
        return generation_batch_size // global_batch, generation_batch_size
    if generation_batch_size is None:
        return steps_per_generation, global_batch * steps_per_generation
    raise MemfitError(f"generation_batch_size `{generation_batch_size}` and steps_per_generation "
                      f"`{steps_per_generation}` are both set; GRPOConfig takes only one of them: drop one")


def _check_grpo(setup: "TrainSetup") -> None:
    """GRPO / RLOO: the GRPOConfig / RLOOConfig values, and what their `__post_init__` (TRL 1.16 grpo_config.py,
    rloo_config.py: the same checks) refuses, as one-line errors."""
    if setup.trainer not in GENERATING_TRAINERS:
        if setup.reward_model is not None:
            raise MemfitError(f"`reward_model` is a GRPOTrainer / RLOOTrainer reward function but trainer is "
                              f"`{setup.trainer}`; pass `trainer='grpo'` (`--trainer grpo`) or `trainer='rloo'`")
        if setup.use_vllm and setup.trainer != "distill":  # DistillationConfig has it too: memfit.train_setup refuses it
            raise MemfitError(f"`use_vllm` is a GRPOTrainer setting (RLOOTrainer's too) but trainer is `{setup.trainer}`; "
                              "pass `trainer='grpo'` (`--trainer grpo`) or `trainer='rloo'`")
        return
    cfg, kind = TRL_CONFIG_CLASS_NAMES[setup.trainer], setup.trainer.upper()
    if setup.reward_model is not None and not isinstance(setup.reward_model, str):
        raise MemfitError(f"`reward_model` must be a hub id or a directory; got `{setup.reward_model!r}`")
    for name in ("num_generations", "max_completion_length", "num_iterations"):
        _positive_int(name, getattr(setup, name))
    for name in ("steps_per_generation", "generation_batch_size"):
        if getattr(setup, name) is not None:
            _positive_int(name, getattr(setup, name))
    for name in ("use_vllm", "vllm_enable_sleep_mode"):
        if not isinstance(getattr(setup, name), bool):
            raise MemfitError(f"`{name}` must be true or false; got `{getattr(setup, name)!r}`")
    b = setup.beta
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0:
        raise MemfitError(f"`beta` must be a finite number >= 0 ({cfg}'s KL coefficient); got `{b!r}`")
    if setup.vllm_mode not in VLLM_MODES:
        raise MemfitError(f"vllm_mode `{setup.vllm_mode}` must be `colocate` or `server` ({cfg}, TRL 1.16)")
    u = setup.vllm_gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise MemfitError(f"vllm_gpu_memory_utilization `{u!r}` must be a share of the GPU in (0, 1], e.g. 0.3")
    if setup.num_generations < 2:
        # GRPOConfig / RLOOConfig.__post_init__: "... requires at least 2 generations per prompt to calculate the
        # advantages"
        raise MemfitError(f"num_generations `{setup.num_generations}` is below 2: {kind} needs at least 2 completions "
                          "per prompt for its advantages; use `num_generations=2` or more")
    _, gen = grpo_generation_sizes(setup.per_device_train_batch_size, setup.gradient_accumulation_steps,
                                   setup.steps_per_generation, setup.generation_batch_size)
    if gen % setup.num_generations != 0:
        raise MemfitError(f"the generation batch of {gen} completions (per_device_train_batch_size x "
                          f"steps_per_generation) is not divisible by num_generations `{setup.num_generations}`, as "
                          f"{cfg} requires (whole prompt groups); make it a multiple of {setup.num_generations}")
    if setup.num_generations_eval is not None:
        _positive_int("num_generations_eval", setup.num_generations_eval)
    eval_groups = setup.num_generations_eval or setup.num_generations  # GRPOConfig.__post_init__, on do_eval
    if setup.does_eval and setup.per_device_eval_batch_size % eval_groups != 0:
        name = "num_generations_eval" if setup.num_generations_eval else "num_generations"
        raise MemfitError(f"per_device_eval_batch_size `{setup.per_device_eval_batch_size}` is not divisible by "
                          f"{name} `{eval_groups}`, as {cfg} requires for evaluation; make it a multiple of "
                          f"{eval_groups}")
