"""`memfit.preflight(trainer, gpu=None) -> PreflightReport`: what a real Trainer will need, and its traps.

The TrainSetup is read from `trainer.args` and the model's *config* (no weights are
simulated), the token lengths of `trainer.train_dataset` (`input_ids`) and the collator's
padding: with dynamic padding (DataCollatorWithPadding, padding=True/"longest") the worst
batch is the longest example; with padding="max_length" it is the collator's max_length.
"""

from __future__ import annotations

import os

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError
from memfit.estimator import MemoryReport, estimate
from memfit.gpus.catalog import as_gpu_spec
from memfit.models.resolve import resolve
from memfit.train_setup import TrainSetup
from memfit.units import parse_size

__all__ = ["PreflightFlag", "PreflightReport", "preflight", "setup_from_trainer", "task_of_model", "budget_spec",
           "check_budget", "check_budget_covers_model"]

_UNITLESS = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*$")

_LM_TASKS = ("causal-lm", "mlm", "seq2seq-lm")


@dataclass(frozen=True)
class PreflightFlag:
    """A trap found before training: what it is and what to do."""

    kind: str
    text: str
    fix: str


@dataclass
class PreflightReport:
    setup: TrainSetup
    estimate: MemoryReport
    gpu: str | None
    budget_bytes: int | None
    fits: bool | None
    flags: list[PreflightFlag] = field(default_factory=list)
    example_count: int | None = None
    longest_example: int | None = None
    free_bytes_now: int | None = None
    #: the multi-GPU strategy the estimate assumed (DeepSpeed ZeRO / FSDP2 from the trainer's args;
    #: memfit.fitting.engines.parallel_for_trainer), None for one GPU
    parallel: Any = None
    parallel_notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:  # the dataclass repr would print the whole model config (setup.model)
        from memfit.units import format_bytes

        model = self.setup.model if isinstance(self.setup.model, str) else self.estimate.model
        return (f"PreflightReport(model={model!r}, fits={self.fits}, "
                f"peak_reserved={format_bytes(self.estimate.peak_reserved_bytes)}, gpu={self.gpu!r}, "
                f"flags={[f.kind for f in self.flags]})")

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu, "budget_bytes": self.budget_bytes, "fits": self.fits,
            "predicted_peak_allocated_bytes": self.estimate.peak_allocated_bytes,
            "predicted_peak_reserved_bytes": self.estimate.peak_reserved_bytes,
            "predicted_phases": dict(self.estimate.phases),
            "sequence_length": self.setup.sequence_length,
            # the models simulated beside the trained one (GRPO's / RLOO's reward model, distillation's teacher)
            "reward_model": self.setup.reward_model, "teacher_model": self.setup.teacher_model,
            "example_count": self.example_count, "longest_example": self.longest_example,
            "free_bytes_now": self.free_bytes_now,
            "flags": [dataclasses.asdict(f) for f in self.flags],
            # the strategy assumed; the estimate is rank 0's
            "parallel": None if self.parallel is None else {
                "strategy": self.parallel.strategy, "world_size": self.parallel.world_size,
                "nodes": self.parallel.nodes, "rank": 0, "notes": list(self.parallel_notes)},
        }


def task_of_model(model: Any) -> str:
    name = type(getattr(model, "module", model)).__name__
    for key, task in (("ForSequenceClassification", "seq-cls"), ("ForTokenClassification", "token-cls"),
                      ("ForQuestionAnswering", "qa"), ("ForMaskedLM", "mlm"), ("ForCausalLM", "causal-lm"),
                      ("ForConditionalGeneration", "seq2seq-lm"), ("ForSeq2SeqLM", "seq2seq-lm"),
                      ("LMHeadModel", "causal-lm")):
        if key in name:
            return task
    raise MemfitError(f"cannot tell the task of model class `{name}`; memfit knows "
                      "ForSequenceClassification, ForTokenClassification, ForQuestionAnswering, ForMaskedLM, "
                      "ForCausalLM and ForConditionalGeneration heads")


def _lengths(dataset: Any, limit: int = 200_000) -> list[int] | None:
    if dataset is None:
        return None
    try:
        column = dataset["input_ids"]  # datasets.Dataset: the whole column at once
        return [len(x) for x in column[:limit]]
    except Exception:
        pass
    try:
        n = min(len(dataset), limit)
        return [len(dataset[i]["input_ids"]) for i in range(n)]
    except Exception:
        return None


def _tokenizer(trainer: Any) -> Any:
    tok = getattr(trainer, "processing_class", None)
    if tok is None:
        tok = getattr(getattr(trainer, "data_collator", None), "tokenizer", None)
    return tok


def setup_from_trainer(trainer: Any) -> tuple[TrainSetup, list[int] | None]:
    """The TrainSetup of a real Trainer (model config, arguments, token lengths, padding)."""
    model = trainer.model
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None:
        raise MemfitError(f"model `{type(model).__name__}` has no Hugging Face config; memfit needs a transformers model")
    task = task_of_model(model)
    lengths = _lengths(trainer.train_dataset)
    collator = trainer.data_collator
    padding = getattr(collator, "padding", True)
    fields: dict[str, Any] = {"task": task}
    if task in ("seq-cls", "token-cls"):
        fields["num_labels"] = int(getattr(config, "num_labels", 2) or 2)
    if lengths:
        if padding == "max_length" and getattr(collator, "max_length", None):
            fields["max_length"] = int(collator.max_length)
        else:
            fields["example_lengths"] = lengths
            fields["max_length"] = max(lengths)
    eval_ds = getattr(trainer, "eval_dataset", None)
    if eval_ds is not None and not isinstance(eval_ds, dict):
        try:
            fields["eval_samples"] = max(1, len(eval_ds))
        except TypeError:
            pass
    if getattr(config, "dtype", None) is not None:
        import torch

        p = next(iter(model.parameters()), None)
        if p is not None:
            fields["weights_dtype"] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
                p.dtype, "fp32")
    lengths = _trl_fields(trainer, fields, lengths)  # TRL
    setup = TrainSetup.from_training_args(trainer.args, model=config, **fields)
    if setup.eval_strategy == "no" and eval_ds is not None and getattr(trainer.args, "do_eval", False):
        setup = setup.replace(eval_strategy="epoch")
    return resolve(setup), lengths


def _trl_fields(trainer: Any, fields: dict[str, Any], lengths: list[int] | None) -> list[int] | None:
    """TRL: the SFTTrainer / DPOTrainer / GRPOTrainer / RewardTrainer / KTOTrainer settings and token lengths;
    updates `fields`, returns the lengths preflight reports (packs for a packed SFT dataset, the longer sequence of
    each pair for DPO and reward, of each example and its KL sequence for KTO, the
    prompts as GRPOTrainer tokenizes them for GRPO).
    A peft model's LoRA settings are read for every trainer (DPO's reference depends on them)."""
    from memfit.sim import _trl_adapter as trl_adapter

    peft_config = getattr(trainer.model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        cfg = next(iter(peft_config.values()))
        if getattr(cfg, "peft_type", None) is not None and str(getattr(cfg.peft_type, "value", cfg.peft_type)) == "LORA":
            fields["lora_r"] = int(cfg.r)
            fields["lora_alpha"] = cfg.lora_alpha
            fields["lora_dropout"] = float(cfg.lora_dropout)
            targets = cfg.target_modules
            fields["lora_target_modules"] = sorted(targets) if isinstance(targets, (set, list, tuple)) else None
            if getattr(cfg, "use_dora", False):  # peft methods
                fields["use_dora"] = True
        elif getattr(cfg, "peft_type", None) is not None:  # peft methods: any other method, as configured
            fields["peft_config"] = cfg.to_dict()
    kind = trl_adapter.trainer_kind(trainer)
    if kind == "sft":
        fields["trainer"] = "sft"
        state = trl_adapter.sft_state(trainer)
        if getattr(trainer.args, "completion_only_loss", None) is None and state["completion_only_loss"] is not None:
            fields["completion_only_loss"] = bool(state["completion_only_loss"])
        if lengths and getattr(trainer.args, "max_length", None):
            # the truncation limit (packs hold up to max_length tokens); the example lengths give the worst batch
            fields["max_length"] = int(trainer.args.max_length)
        return lengths
    if kind == "dpo":
        fields["trainer"] = "dpo"
        fields["precompute_ref_log_probs"] = trl_adapter.dpo_state(trainer)["precompute_ref_log_probs"]
        max_length = getattr(trainer.args, "max_length", None)
        lengths = trl_adapter.dpo_example_lengths(trainer.train_dataset, max_length)
        if lengths:
            fields["example_lengths"] = lengths
            fields["max_length"] = int(max_length) if max_length else max(lengths)
        return lengths
    if kind in ("reward", "kto"):  # the real token lengths of the prepared dataset, as DPO's
        fields["trainer"] = kind
        max_length = getattr(trainer.args, "max_length", None)
        lengths = (trl_adapter.reward_example_lengths(trainer.train_dataset) if kind == "reward"
                   else trl_adapter.kto_example_lengths(trainer.train_dataset, max_length))
        if lengths:
            fields["example_lengths"] = lengths
            fields["max_length"] = int(max_length) if max_length else max(lengths)
        return lengths
    if kind in ("grpo", "rloo"):
        fields["trainer"] = kind
        args = trainer.args
        # GRPOConfig.__post_init__ (and RLOOConfig's) has resolved bf16 (its default: on unless fp16); an explicit
        # bf16=False is fp32
        fields["precision"] = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        # GRPOTrainer does not truncate prompts; RLOOTrainer's `_tokenize_prompts` is the same code
        rewards = [model for _, model, _ in trl_adapter.grpo_reward_models(trainer)]
        if rewards:  # the reward model memfit's simulation holds and runs in scoring (memfit.sim.grpo_steps)
            fields["reward_model"] = _config_path(rewards[0])
        prompts = trl_adapter.grpo_prompt_lengths(trainer)
        if prompts:
            fields["example_lengths"] = prompts
            fields["max_length"] = max(prompts)
        return prompts
    if kind == "distill":  # DistillationTrainer: its prompts as GRPO's (`_tokenize_prompts`, never truncated)
        fields["trainer"] = "distill"
        args = trainer.args
        fields["precision"] = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"  # _BaseConfig resolved bf16
        path = _teacher_path(trainer)
        if not path:  # MemfitCallback's view of the trainer: only the arguments
            raise MemfitError("memfit cannot see DistillationTrainer's teacher (a callback is given no trainer): set "
                              "DistillationConfig.teacher_model_name_or_path to the teacher's directory or hub id, or "
                              "train with memfit.fit(trainer)")
        fields["teacher_model"] = path  # the teacher memfit's simulation builds beside the student (trl_steps)
        prompts = trl_adapter.grpo_prompt_lengths(trainer)
        if prompts:
            fields["example_lengths"] = prompts
            fields["max_length"] = max(prompts)
        return prompts
    return lengths


def _teacher_path(trainer: Any) -> str | None:
    """Where memfit's simulation reads DistillationTrainer's teacher config from (`_config_path`;
    DistillationConfig.teacher_model_name_or_path for a teacher not loaded yet)."""
    teacher = getattr(trainer, "teacher_model", None)
    config = getattr(getattr(teacher, "module", teacher), "config", None)
    if config is None:
        path = getattr(trainer.args, "teacher_model_name_or_path", None)
        return str(path) if path else None
    return _config_path(teacher, getattr(trainer.args, "teacher_model_name_or_path", None))


def _config_path(model: Any, given: str | None = None) -> str:
    """A directory with `model`'s config.json for memfit's simulation: the one it was loaded from
    (`config._name_or_path`, else `given`), else its config written to a folder of its own (a model built in code),
    named by the config's hash so that it is written once."""
    import hashlib
    import tempfile

    config = getattr(model, "module", model).config
    for path in (getattr(config, "_name_or_path", None), given):
        if isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")):
            return path
    text = config.to_json_string(use_diff=False)
    folder = os.path.join(tempfile.gettempdir(), "memfit-model-configs",
                          hashlib.sha256(text.encode()).hexdigest()[:16])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        os.makedirs(folder, exist_ok=True)
        config.to_json_file(os.path.join(folder, "config.json"), use_diff=False)
    return folder


def budget_spec(budget_bytes: int):
    """An emulated GPU of `budget_bytes` (memfit.testing.memory_budget): A100-40GB rates, nothing outside PyTorch,
    no cuBLAS workspaces (the run's tensors are the CPU's)."""
    from memfit.gpus.catalog import CATALOG
    from memfit.units import format_bytes

    return dataclasses.replace(CATALOG["a100-40gb"], name=f"memory_budget-{format_bytes(int(budget_bytes))}",
                               total_bytes=int(budget_bytes), total_bytes_source="memory_budget", emulated=True,
                               notes=("an emulated GPU (memfit.testing.memory_budget) on the CPU",))


def check_trainer(trainer: Any) -> None:
    """A clear error when `trainer` is not a Trainer (memfit reads its model, args and datasets)."""
    if not all(hasattr(trainer, a) for a in ("model", "args", "train", "train_dataset")):
        raise MemfitError(f"`{type(trainer).__name__}` is not a transformers.Trainer; pass the Trainer you would "
                          "call .train() on")


def check_reward_tokenizers(trainer: Any) -> None:
    """GRPO: a clear error when a reward model's processing class has more tokens than the reward model has
    embeddings. GRPOTrainer decodes the completions and tokenizes them again with that processing class
    (grpo_trainer.py `_calculate_rewards`); an id past the embedding stops the run after its first generation (an
    IndexError on the CPU, a device-side assert on CUDA)."""
    from memfit.sim import _trl_adapter as trl_adapter

    for i, model, tok in trl_adapter.grpo_reward_models(trainer):
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        rows = getattr(embeddings, "num_embeddings", None)
        try:
            tokens = len(tok)
        except TypeError:
            continue
        if rows is not None and tokens > rows:
            raise MemfitError(
                f"reward model `{type(model).__name__}` (reward_funcs[{i}]) has {rows} token embeddings but its "
                f"processing class `{type(tok).__name__}` has {tokens} tokens, another tokenizer: ids from {rows} on "
                "index past its embedding after the first generation; pass the reward model's own tokenizer in "
                "reward_processing_classes, or leave it None and TRL loads it")


def check_budget(budget_bytes: Any) -> int | None:
    """The emulated budget in bytes from an int or a size such as "800MiB"; a clear error otherwise."""
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, str):
        if _UNITLESS.match(budget_bytes):  # "300" is 300 bytes to parse_size: never what a budget means
            raise MemfitError(f"memory budget `{budget_bytes}` has no unit; write it with one, e.g. "
                              f"`{budget_bytes.strip()}MiB` or `{budget_bytes.strip()}GiB`")
        budget_bytes = parse_size(budget_bytes, what="memory budget")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise MemfitError(f"budget_bytes `{budget_bytes!r}` is not a positive number of bytes; pass e.g. "
                          "800 * 2**20 or '800MiB'")
    return budget_bytes


def check_budget_covers_model(model: Any, budget_bytes: int | None, frozen: tuple[Any, ...] = ()) -> None:
    """A clear error when an emulated budget cannot hold the model's weights and gradients.

    Below weights + gradients (each storage as `memory_budget` counts it) nothing memfit can
    apply trains: the plan changes batches, precision of the computation, checkpointing and the
    optimizer, never the weights (LoRA / freezing are opt-ins of `memfit plan --allow`).
    `frozen`: models on the GPU beside it without gradients (DistillationTrainer's teacher), their weights counted.
    """
    if budget_bytes is None:
        return
    from memfit.testing import counted_bytes
    from memfit.units import format_bytes

    base = getattr(model, "module", model)
    weights = counted_bytes(base, *frozen)
    grads = counted_bytes([p for p in base.parameters() if p.requires_grad])
    if budget_bytes >= weights + grads:
        return
    lead = (f"is less than the model's weights alone ({format_bytes(weights)}"
            + (", the teacher's included" if frozen else "") + ")" if budget_bytes < weights else
            f"holds the model's weights ({format_bytes(weights)}) but not their gradients ({format_bytes(grads)})")
    raise MemfitError(f"memory budget `{format_bytes(budget_bytes)}` {lead}; no setup trains in less than "
                      f"{format_bytes(weights + grads)} (weights + gradients, before activations and optimizer "
                      f"state), so the smallest budget that could work is above that: give a larger one "
                      "(`memfit plan` gives what this setup needs)")


def preflight(trainer: Any, gpu: Any = None, *, budget_bytes: int | str | None = None,
              non_pytorch_bytes: int | None = None) -> PreflightReport:
    """Estimate a real Trainer's run and flag the traps that make such runs fail.

    `gpu`: a catalog name, a size, `auto` or a GpuSpec (None: only flags, `fits` unknown
    unless `budget_bytes` is given). `budget_bytes`: an emulated GPU of that many bytes
    (memfit.testing.memory_budget) with nothing outside PyTorch.
    """
    check_trainer(trainer)
    budget_bytes = check_budget(budget_bytes)
    spec = as_gpu_spec(gpu)
    check_reward_tokenizers(trainer)
    setup, lengths = setup_from_trainer(trainer)
    if spec is None and budget_bytes is not None:
        spec = budget_spec(budget_bytes)
        non_pytorch_bytes = 0 if non_pytorch_bytes is None else non_pytorch_bytes
    from memfit.fitting._trainer import preserve_accelerator_state, without_hf_deepspeed_config
    from memfit.fitting.engines import parallel_for_trainer

    parallel, parallel_notes = parallel_for_trainer(trainer, setup)  # DeepSpeed / FSDP2: rank 0
    with preserve_accelerator_state(), without_hf_deepspeed_config():
        report = estimate(setup, gpu=spec, non_pytorch_bytes=non_pytorch_bytes, parallel=parallel)
    flags: list[PreflightFlag] = []
    args = trainer.args
    tok = _tokenizer(trainer)
    mml = getattr(tok, "model_max_length", None)
    from memfit.sim._trl_adapter import trainer_kind

    # GRPOTrainer (and RLOOTrainer) never truncates with the tokenizer: prompts are kept whole (`_tokenize_prompts`),
    # completions stop at max_completion_length
    if mml is not None and mml > 1e6 and trainer_kind(trainer) not in ("grpo", "rloo", "distill"):
        flags.append(PreflightFlag(
            "no_max_length",
            f"the tokenizer has no real maximum length (model_max_length = {int(mml):.3g}): truncation=True "
            "truncates nothing, so one long text makes a batch as long as that text",
            "pass max_length=... (e.g. 512) to the tokenizer call together with truncation=True"))
    # only a run with an eval set evaluates (Trainer.evaluate needs one; without it no eval batch is ever formed)
    if getattr(trainer, "eval_dataset", None) is not None \
            and args.per_device_eval_batch_size > args.per_device_train_batch_size:
        flags.append(PreflightFlag(
            "eval_batch_larger",
            f"per_device_eval_batch_size ({args.per_device_eval_batch_size}) is larger than "
            f"per_device_train_batch_size ({args.per_device_train_batch_size}); evaluation may need more memory "
            "than training (it also keeps the predictions on the GPU)",
            f"per_device_eval_batch_size={args.per_device_train_batch_size}"))
    # GRPOTrainer / RLOOTrainer / DistillationTrainer: `prediction_step` returns `loss, None, None` (no logits)
    if (setup.task in _LM_TASKS and args.eval_accumulation_steps is None
            and setup.trainer not in ("grpo", "rloo", "distill")
            and getattr(trainer, "preprocess_logits_for_metrics", None) is None
            and not args.prediction_loss_only
            and (setup.does_eval or getattr(trainer, "compute_metrics", None) is not None)):
        flags.append(PreflightFlag(
            "eval_logits_on_gpu",
            "evaluation of a language-model head keeps every batch's logits (batch x length x vocabulary) on the "
            "GPU until the end of the evaluation",
            "eval_accumulation_steps=1, or preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1)"))
    free_now = None
    try:
        import torch

        if torch.cuda.is_available():
            free_now, _total = torch.cuda.mem_get_info()
            need = report.peak_reserved_bytes
            if free_now < need:
                flags.append(PreflightFlag(
                    "low_free_memory",
                    f"only {free_now / 2**30:.2f} GiB of GPU memory is free now, the run needs about "
                    f"{need / 2**30:.2f} GiB (other processes or earlier objects hold the rest)",
                    "free the GPU (del old models/trainers, torch.cuda.empty_cache(), stop other processes "
                    "shown by nvidia-smi) or apply memfit's plan"))
    except Exception:  # no driver: nothing to measure
        free_now = None
    fits = report.fits
    if fits is False:
        flags.append(PreflightFlag(
            "does_not_fit",
            (f"predicted to need {(report.required_bytes + report.non_pytorch_bytes) / 2**20:,.0f} MiB of GPU memory, "
             f"{report.shortfall_bytes / 2**20:,.0f} MiB more than {spec.name if spec else 'the GPU'} has "
             f"(out of memory in the {report.oom.phase if report.oom else report.peak_phase} phase)"
             if report.required_bytes is not None and report.shortfall_bytes is not None else
             f"predicted {report.device_used_bytes / 2**20:,.0f} MiB in use at the peak ({report.peak_phase}) "
             f"on {spec.name if spec else '?'}"),
            "let memfit.fit apply the plan, or run `memfit plan` for the changes"))
    return PreflightReport(setup=setup, estimate=report, gpu=None if spec is None else spec.name,
                           budget_bytes=budget_bytes, fits=fits, flags=flags,
                           example_count=len(lengths) if lengths else None,
                           longest_example=max(lengths) if lengths else None, free_bytes_now=free_now,
                           parallel=parallel, parallel_notes=parallel_notes)
