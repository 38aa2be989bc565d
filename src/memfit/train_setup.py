"""`TrainSetup`: what memfit needs to know about a fine-tuning run.

Field names mirror `transformers.TrainingArguments` so a user can move between the two;
`TrainSetup.from_training_args`, `from_kwargs` and `from_json` accept what old scripts
write (`evaluation_strategy`, ...) and record a note instead of raising a TypeError.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError

__all__ = ["TrainSetup", "TASKS", "PRECISIONS", "OPTIMIZERS", "LEGACY_ARG_NAMES"]

#: task name -> the Auto class head it builds (transformers.AutoModelFor...).
TASKS = {
    "seq-cls": "AutoModelForSequenceClassification",
    "token-cls": "AutoModelForTokenClassification",
    "qa": "AutoModelForQuestionAnswering",
    "mlm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
}
_TASK_ALIASES = {
    "sequence-classification": "seq-cls", "text-classification": "seq-cls", "classification": "seq-cls",
    "token-classification": "token-cls", "ner": "token-cls",
    "question-answering": "qa", "masked-lm": "mlm", "fill-mask": "mlm",
    "causal": "causal-lm", "clm": "causal-lm", "text-generation": "causal-lm",
    "seq2seq": "seq2seq-lm", "text2text-generation": "seq2seq-lm",
}
PRECISIONS = ("fp32", "fp16", "bf16")

#: `optim` names of TrainingArguments (transformers.training_args.OptimizerNames) memfit simulates.
OPTIMIZERS = (
    "adamw_torch", "adamw_torch_fused",
    "adafactor", "sgd", "adamw_bnb_8bit", "adamw_8bit", "adagrad", "rmsprop",
)

#: Renamed or removed TrainingArguments names old scripts still pass (transformers 4.x -> 5.x).
LEGACY_ARG_NAMES = {
    "evaluation_strategy": "eval_strategy",  # renamed in transformers 4.41, removed in 5.0
    "no_cuda": "use_cpu",
    "overwrite_output_dir": None,
    "logging_dir": None,
}

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
}


@dataclass(kw_only=True)
class TrainSetup:
    """A fine-tuning run as far as GPU memory is concerned."""

    model: Any = "xlnet-large-cased"
    """Hub id (bundled configs work offline), a directory with config.json, a PretrainedConfig, or an nn.Module."""
    task: str | None = None
    """One of seq-cls, token-cls, qa, mlm, causal-lm, seq2seq-lm; None: the model's own, from its config's
    architectures (`memfit.models.default_task`: causal-lm for GPT-2/Llama, seq2seq-lm for T5/BART,
    seq-cls for encoders), said in `notes`."""
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
    """Decoder (labels) length for seq2seq-lm; defaults to max_length."""
    precision: str = "fp32"
    """fp32, fp16 (AMP + GradScaler) or bf16 (AMP)."""
    weights_dtype: str = "auto"
    """Dtype the weights are loaded in: auto (transformers 5 `from_pretrained` default: the config's
    dtype, e.g. bf16 for Llama 3, fp32 when the config has none), fp32, fp16 or bf16."""
    optim: str = "adamw_torch_fused"
    """TrainingArguments.optim name; the transformers 5 default is adamw_torch_fused."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient clipping; 0 disables it."""
    gradient_checkpointing: bool = False
    eval_accumulation_steps: int | None = None
    """Move predictions to the CPU every N eval steps; None keeps all on the GPU until the end."""
    eval_strategy: str = "no"
    """no, steps or epoch; anything but `no` adds the evaluation phase."""
    eval_samples: int | None = None
    """Examples in the eval set (sizes the on-device prediction buffer); None: 1000 examples."""
    prediction_loss_only: bool = False
    attn_implementation: str | None = None
    """eager or sdpa; None keeps the model's default."""
    lora_r: int | None = None
    """LoRA rank (peft); None trains the full model."""
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    """Module names LoRA wraps; None lets peft pick its default for the architecture."""
    freeze_embeddings: bool = False
    """Input embeddings get no gradient (requires_grad=False)."""
    freeze_layers: int = 0
    """The lowest N blocks of the model's (first) stack of layers get no gradient."""
    offload_optimizer_state: bool = False
    """Optimizer state kept in host memory (DeepSpeed ZeRO-Offload); not on the GPU."""
    compute_capability: tuple[int, int] = (8, 0)
    """Of the target GPU: decides the SDPA backend and whether bf16 is allowed."""
    notes: list[str] = field(default_factory=list)
    """What memfit changed or assumed while reading the inputs (legacy names, ...)."""

    def __post_init__(self) -> None:
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
        if self.attn_implementation not in (None, "eager", "sdpa"):
            raise MemfitError(f"attn_implementation `{self.attn_implementation}` must be `eager` or `sdpa`")
        if self.eval_strategy not in ("no", "steps", "epoch"):
            raise MemfitError(f"eval_strategy `{self.eval_strategy}` must be `no`, `steps` or `epoch`")
        if self.lora_r is not None:
            _positive_int("lora_r", self.lora_r)
        if not isinstance(self.freeze_layers, int) or isinstance(self.freeze_layers, bool) or self.freeze_layers < 0:
            raise MemfitError(f"`freeze_layers` must be 0 or a positive number of blocks; got `{self.freeze_layers!r}`")
        if self.task is None:  # last: it reads the model's config (a clear MemfitError when there is none)
            from memfit.models.build import default_task  # memfit.models imports this module

            self.task, why = default_task(self.model)
            self.notes = [*self.notes, why]

    # -- derived ---------------------------------------------------------------------------
    @property
    def sequence_length(self) -> int:
        """Tokens per example in the worst (longest) padded batch."""
        if self.example_lengths is None:
            return self.max_length
        longest = max(self.example_lengths)
        return min(longest, self.max_length) if self.truncation else longest

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
    def from_kwargs(cls, model: Any = None, *, training_args: dict[str, Any] | None = None, **fields: Any) -> "TrainSetup":
        """Build from TrainSetup fields plus a dict of TrainingArguments kwargs (legacy names allowed)."""
        notes: list[str] = list(fields.pop("notes", []))
        merged: dict[str, Any] = {}
        for key, value in (training_args or {}).items():
            if key in LEGACY_ARG_NAMES:
                new = LEGACY_ARG_NAMES[key]
                if new is None:
                    notes.append(f"`{key}` was removed from TrainingArguments in transformers 5; ignored")
                    continue
                notes.append(
                    f"`{key}` is the old name of `{new}` (transformers 5 raises TypeError on it); read as `{new}`"
                )
                key = new
            if key in ("fp16", "bf16"):
                if value:
                    if merged.get("precision") not in (None, key):
                        raise MemfitError("`fp16=True` and `bf16=True` were both given; choose one")
                    merged["precision"] = key
                continue
            if key == "gradient_checkpointing_kwargs":
                continue
            if key in _ARG_TO_FIELD:
                merged[_ARG_TO_FIELD[key]] = value
        for key in ("optim", "eval_strategy"):  # TrainingArguments holds enums (OptimizerNames, IntervalStrategy)
            if merged.get(key) is not None:
                merged[key] = str(getattr(merged[key], "value", merged[key]))
        merged.update(fields)
        if model is not None:
            merged["model"] = model
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - valid)
        if unknown:
            raise MemfitError(f"unknown setting `{unknown[0]}`; valid names are: {', '.join(sorted(valid))}")
        return cls(notes=notes, **merged)

    @classmethod
    def from_training_args(cls, args: Any, model: Any = None, **fields: Any) -> "TrainSetup":
        """Build from a `transformers.TrainingArguments` object."""
        kwargs = {name: getattr(args, name) for name in list(_ARG_TO_FIELD) + ["fp16", "bf16"] if hasattr(args, name)}
        return cls.from_kwargs(model, training_args=kwargs, **fields)

    @classmethod
    def from_json(cls, path: str | os.PathLike, model: Any = None, **fields: Any) -> "TrainSetup":
        """Build from a JSON file of TrainingArguments kwargs, e.g. `{"per_device_train_batch_size": 1, ...}`."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError as err:
            raise MemfitError(f"arguments file `{path}` does not exist; pass a JSON file of TrainingArguments kwargs") from err
        except (OSError, UnicodeDecodeError) as err:
            raise MemfitError(f"cannot read arguments file `{path}`: {err}") from err
        except json.JSONDecodeError as err:
            raise MemfitError(f"arguments file `{path}` is not valid JSON ({err.msg} at line {err.lineno}); fix the file") from err
        if not isinstance(data, dict):
            raise MemfitError(f"arguments file `{path}` must hold a JSON object of TrainingArguments kwargs, not `{type(data).__name__}`")
        return cls.from_kwargs(model, training_args=data, **fields)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MemfitError(f"`{name}` must be a positive integer; got `{value!r}`")
