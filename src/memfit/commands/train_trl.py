"""`memfit train --trainer sft|dpo|grpo|rloo|reward|kto|distill`: TRL's real SFTTrainer / DPOTrainer / GRPOTrainer /
RLOOTrainer / RewardTrainer / KTOTrainer / DistillationTrainer under memfit.fit.

    memfit train ./my-llm --trainer sft --data chat.jsonl --packing --budget 2GiB
    memfit train ./my-llm --trainer sft --data pc.jsonl --completion-only-loss --lora-r 8
    memfit train ./my-llm --trainer dpo --data pairs.jsonl --precompute-ref-log-probs
    memfit train ./my-llm --trainer grpo --data prompts.jsonl --reward-func rewards.py:length --num-generations 4
    memfit train ./my-llm --trainer rloo --data prompts.jsonl --reward-func rewards.py:length --num-generations 4
    memfit train ./my-llm --trainer reward --data pairs.jsonl --lora-r 8
    memfit train ./my-llm --trainer kto --data unpaired.jsonl --beta 0.1
    memfit train ./my-llm --trainer distill --teacher ./my-big-llm --data prompts.jsonl

The same run as the classification default (memfit.commands.train: preflight, the plan applied when the
setup does not fit, OOM recovery without lost steps, atomic checkpoints, the report and the console
summary); only the data, the model class and the trainer differ. Every input is checked before a model
is loaded, each bad one a one-line MemfitError:

- data: JSONL (or a JSON list) in one of TRL 1.16's dataset formats (trl.data_utils): `text` (the column
  `--dataset-text-field` names), `messages` (chat, through the tokenizer's chat template),
  `prompt`/`completion` (strings or messages); for DPO `prompt`/`chosen`/`rejected`; for GRPO `prompt`
  (strings or messages; GRPOTrainer passes the other columns to the reward functions by name); for reward
  `chosen`/`rejected`, `prompt` optional (RewardTrainer `_prepare_dataset`); for KTO `prompt`/`completion`/`label`
  (`label` true or false, KTOTrainer's unpaired format) or `prompt`/`chosen`/`rejected` (KTOTrainer unpairs it).
  A CSV, or text
  with a `label` column, is a classification dataset: the error says to drop `--trainer`.
- GRPO's (and RLOO's: the same prompt-only data and reward call) reward functions: `--reward-func SPEC`, repeatable (memfit.commands._reward_funcs: `module:function`,
  `file.py:function` or a local reward model directory), each checked before the model is loaded.
- distillation's teacher: `--teacher DIR` (TrainSetup.teacher_model, DistillationConfig's
  teacher_model_name_or_path), a local causal LM directory with the student's vocabulary size (DistillationTrainer
  compares the two next-token distributions; its `__init__` raises otherwise), checked before any model loads;
  memfit loads it as it loads the student and passes it to DistillationTrainer, which keeps it on the GPU.
- model: a causal LM (its config's `architectures` in transformers' causal-LM auto mapping); TRL loads
  DPO's reference from the same directory (`DPOTrainer.__init__`: `create_model_from_path(
  get_config_model_id(model.config))`) unless LoRA (adapter disabled) or `--precompute-ref-log-probs`;
  GRPO's likewise when `--beta` is above 0, KTO's as DPO's. Reward: a model type with a sequence-classification
  class, loaded as RewardTrainer loads a path (AutoModelForSequenceClassification, num_labels=1): a one-label
  classifier, or a causal LM whose body gets a new one-score head (a note says so).
- flags: each TRL setting only with the trainer that reads it (`--packing` is SFTConfig's, DPOConfig has
  no packing; `--precompute-ref-log-probs` is DPOConfig's), `--completion-only-loss` only with
  prompt/completion data (SFTTrainer's collator raises at the first batch otherwise:
  `DataCollatorForLanguageModeling.torch_call`), `--assistant-only-loss` only with conversational data.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from memfit.commands._setup_flags import flag_name, split_list
from memfit.commands._train_common import (Run, check_counts, check_model_dir, check_output_dir, check_resume,
                                           first_line, fit_and_report, print_preflight, read_budget,
                                           set_aside_earlier_results, training_kwargs)
from memfit.errors import MemfitError
from memfit.train_setup import TRL_TRAINERS

__all__ = ["TRL_TRAINERS", "TRL_DEFAULT_MAX_LENGTH", "check_trl_flags", "train_trl_command", "read_trl_data"]

#: flag dest -> the trainer(s) whose config has it (None: every TRL trainer memfit train runs, LoRA through
#: peft_config)
_TRL_FLAGS = {
    "packing": "sft",
    "packing_strategy": "sft",
    "padding_free": "sft",
    "completion_only_loss": "sft",
    "assistant_only_loss": "sft",
    "dataset_text_field": "sft",
    "precompute_ref_log_probs": ("dpo", "kto"),  # DPOConfig's and KTOConfig's: the reference's log-probs first
    "num_generations": ("grpo", "rloo"),
    "max_completion_length": ("grpo", "rloo", "distill"),
    # DPOConfig.beta / KTOConfig.beta: the loss's temperature; GRPOConfig.beta / RLOOConfig.beta: the KL coefficient;
    # DistillationConfig.beta: the divergence's interpolation (0 forward KL, 1 reverse KL)
    "beta": ("dpo", "grpo", "rloo", "kto", "distill"),
    "teacher_model": "distill",
    "steps_per_generation": ("grpo", "rloo"),
    "generation_batch_size": ("grpo", "rloo"),
    "num_iterations": ("grpo", "rloo"),
    "lora_r": None,
    "lora_target_modules": None,
}

#: The TRL trainers `memfit estimate` simulates that `memfit train` does not run -> why (none today).
_ESTIMATE_ONLY: dict[str, str] = {}

#: The config class of each trainer memfit train runs (TRL 1.16).
_CONFIGS = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig", "rloo": "RLOOConfig",
            "reward": "RewardConfig", "kto": "KTOConfig", "distill": "DistillationConfig"}
_TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer", "rloo": "RLOOTrainer",
             "reward": "RewardTrainer", "kto": "KTOTrainer", "distill": "DistillationTrainer"}
#: The trainers that generate and reward completions (RLOOTrainer takes GRPOTrainer's reward_funcs, prompt-only data
#: and generation settings, TRL 1.16 rloo_trainer.py / rloo_config.py).
_RL = ("grpo", "rloo")
#: The trainers that generate completions of prompt-only data and never truncate the prompts (DistillationTrainer:
#: its student generates on-policy, distillation_trainer.py `_prepare_inputs`; DistillationConfig has no max_length).
_GENERATING = _RL + ("distill",)
#: The columns of each trainer's data format (trl_data.dataset_format), for messages.
_DATA_COLUMNS = {"dpo": "`prompt`/`chosen`/`rejected`", "grpo": "`prompt`", "rloo": "`prompt`", "distill": "`prompt`",
                 "reward": "`chosen`/`rejected`, optionally `prompt`", "kto": "`prompt`/`completion`/`label`"}

#: SFTConfig.max_length and DPOConfig.max_length default (TRL 1.16 sft_config.py / dpo_config.py)
TRL_DEFAULT_MAX_LENGTH = 1024
#: GRPOConfig.max_completion_length default (TRL 1.16 grpo_config.py; RLOOConfig's, rloo_config.py, is the same)
GRPO_DEFAULT_MAX_COMPLETION_LENGTH = 512

#: classification-only flags of `memfit train` (dests)
_CLS_FLAGS = ("text_column", "label_column", "num_labels")


def check_trl_flags(args: argparse.Namespace) -> str:
    """The trainer `args` asks for (`trainer`, `sft`, `dpo`, `grpo`, `reward`, `kto`), or a MemfitError for a flag of another
    trainer."""
    trainer = getattr(args, "trainer", None) or "trainer"
    if trainer in _ESTIMATE_ONLY:  # memfit estimate simulates them; memfit train does not run them
        raise MemfitError(f"`memfit train --trainer {trainer}` is not supported: {_ESTIMATE_ONLY[trainer]}; run "
                          f"`memfit estimate --trainer {trainer}` for its memory")
    for dest, owner in _TRL_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None or (value is False and trainer == "trainer"):  # `--no-...` asks for nothing here
            continue
        flag = flag_name(args, dest)
        owners = (owner,) if isinstance(owner, str) else owner
        if trainer == "trainer":
            need = (f"--trainer {', '.join(owners[:-1])} or {owners[-1]}" if owners and len(owners) > 1 else
                    f"--trainer {owners[0]}" if owners else "--trainer sft, dpo, grpo, rloo, reward, kto or distill")
            raise MemfitError(f"`{flag}` is a TRL setting; add `{need}` (the default `memfit train` fine-tunes a "
                              "classifier with transformers' Trainer)")
        if owners is not None and trainer not in owners:
            why = {"sft": f"{_CONFIGS[trainer]} has no such setting"
                          + (" (DPOTrainer does not pack or flatten pairs)" if trainer == "dpo" else ""),
                   "dpo": "it is DPOConfig's (the reference model of DPO)",
                   "kto": "it is KTOConfig's",
                   "grpo": "it is GRPOConfig's (the completions GRPO generates and scores)",
                   "distill": "it is DistillationConfig's (the teacher DistillationTrainer distils from)"}[owners[0]] \
                if len(owners) == 1 else f"{_CONFIGS[trainer]} has no such setting"
            named = [f"`--trainer {o}`" for o in owners]
            where = ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else named[0]
            raise MemfitError(f"`{flag}` is for {where}, not `--trainer {trainer}`: {why}; remove it")
    rewards = getattr(args, "reward_funcs", None)
    if rewards and trainer not in _RL:
        raise MemfitError("`--reward-func` is for `--trainer grpo` or `rloo` (GRPOTrainer's / RLOOTrainer's "
                          "reward_funcs); " + ("add `--trainer grpo`" if trainer == "trainer"
                                               else f"remove it from `--trainer {trainer}`"))
    if trainer in _RL and not rewards:
        raise MemfitError(f"`--trainer {trainer}` needs a reward: give `--reward-func SPEC` (repeatable), SPEC "
                          "`module:function` (e.g. trl.rewards:think_format_reward), `path/to/file.py:function` or "
                          "a local reward model directory")
    if trainer in _GENERATING and getattr(args, "max_length", None) is not None:
        raise MemfitError(f"`{flag_name(args, 'max_length')}` does not go with `--trainer {trainer}`: "
                          f"{_CONFIGS[trainer]} has no max_length ({_TRAINERS[trainer]} 1.16 does not truncate "
                          "prompts); the completions' length is --max-completion-length: remove it")
    if trainer != "trainer":
        for dest in _CLS_FLAGS:
            if getattr(args, dest, None) is not None:
                if trainer == "reward":  # RewardTrainer.__init__ sets num_labels=1 and reads chosen / rejected
                    raise MemfitError(f"`{flag_name(args, dest)}` is a classification setting; `--trainer reward` "
                                      "trains one score per sequence (num_labels=1) on `chosen`/`rejected` pairs; "
                                      "remove it")
                raise MemfitError(f"`{flag_name(args, dest)}` is a classification setting; `--trainer {trainer}` trains a causal "
                                  "language model" + (" (name the text column with --dataset-text-field)"
                                                      if dest == "text_column" else "") + "; remove it")
        if args.task is not None and str(args.task).lower() not in (
                ("seq-cls",) if trainer == "reward" else ("seq-cls", "causal-lm", "causal_lm")):
            trains = ("a one-score sequence classifier (seq-cls)" if trainer == "reward"
                      else "a causal language model")
            raise MemfitError(f"`--task {args.task}` does not go with `--trainer {trainer}`, which trains {trains}; "
                              "remove --task")
        if getattr(args, "lora_r", None) is not None and args.lora_r <= 0:
            raise MemfitError(f"`{flag_name(args, 'lora_r')}` must be a positive integer; got `{args.lora_r}`")
    elif getattr(args, "lora_r", None) is not None:  # pragma: no cover - caught above
        raise MemfitError("`--lora-r` needs `--trainer sft`, `dpo`, `grpo`, `reward` or `kto`")
    return trainer


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class TrlData:
    """The examples of a TRL dataset file, checked: their format (trl_data.dataset_format) and whether they are
    conversational (lists of chat messages, which need the tokenizer's chat template)."""

    path: str
    format: str
    rows: list[dict[str, Any]]
    conversational: bool


def _read_rows(path: str, trainer: str) -> list[dict[str, Any]]:
    import json

    from memfit.fitting.trl_data import read_jsonl

    if not os.path.isfile(path):
        raise MemfitError(f"data file `{path}` does not exist; pass a .jsonl file with --data")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        kinds = _DATA_COLUMNS.get(trainer, "`messages`, `prompt`/`completion` or `text`")
        raise MemfitError(f"`--trainer {trainer}` reads JSONL (one object per line: {kinds}); "
                          f"`{path}` is a CSV, the classification format: drop `--trainer` to train a classifier on "
                          "it, or convert it to JSONL")
    if ext == ".jsonl":
        return read_jsonl(path)
    if ext == ".json":
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as err:
            raise MemfitError(f"`{path}` is not valid JSON ({err.msg} at line {err.lineno}); fix the file") from None
        except UnicodeDecodeError:
            raise MemfitError(f"data file `{path}` is not UTF-8 text; save it as UTF-8") from None
        rows = data.get("data", data) if isinstance(data, dict) else data
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise MemfitError(f"`{path}` must hold a non-empty list of objects (or {{\"data\": [...]}})")
        return rows
    raise MemfitError(f"data file `{path}` has extension `{ext or '(none)'}`; `--trainer {trainer}` reads .jsonl "
                      "(or .json)")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def read_trl_data(path: str, trainer: str, text_field: str = "text") -> TrlData:
    """The examples of `path` for TRL's `trainer` (`sft` / `dpo` / `grpo` / `reward` / `kto`), every row checked;
    MemfitError on bad input.

    Args:
        path: a .jsonl (or .json list) file.
        trainer: `sft`, `dpo`, `grpo`, `reward` or `kto`.
        text_field: SFTConfig.dataset_text_field.
    """
    from memfit.fitting.trl_data import dataset_format

    rows = _read_rows(path, trainer)
    fmt = dataset_format(rows[0], trainer, text_field)
    columns = {"text": (text_field,), "messages": ("messages",), "prompt-completion": ("prompt", "completion"),
               "preference": ("prompt", "chosen", "rejected"), "prompt-only": ("prompt",),
               "unpaired-preference": ("prompt", "completion")}[fmt]
    if fmt == "preference" and trainer == "reward" and "prompt" not in rows[0]:  # the prompt inside each sequence
        columns = ("chosen", "rejected")
    if fmt == "text" and ({"label", "labels"} & set(rows[0])):
        label = "label" if "label" in rows[0] else "labels"
        raise MemfitError(f"`{path}` has a `{label}` column next to `{text_field}`: a classification dataset; "
                          f"`--trainer {trainer}` trains a language model on the text alone: drop `--trainer` to "
                          f"train a classifier, or remove the `{label}` column")
    conversational = None
    for i, row in enumerate(rows, 1):
        for col in columns:
            if col not in row:
                raise MemfitError(f"example {i} of `{path}` has no `{col}` column, which the first example has "
                                  f"({fmt} format); give every example the same columns")
            value = row[col]
            if fmt == "text" or (fmt != "messages" and isinstance(value, str)):
                ok, conv = isinstance(value, str) and bool(value.strip()), False
                what = "a non-empty string"
            else:
                ok, conv = _is_messages(value), True
                what = "a non-empty list of {\"role\": ..., \"content\": ...} messages" + \
                       (" or a string" if fmt != "messages" else "")
            if not ok:
                raise MemfitError(f"`{col}` of example {i} in `{path}` is not {what}; got `{str(value)[:60]}`")
            if conversational is None:
                conversational = conv
            elif conv != conversational:
                raise MemfitError(f"`{col}` of example {i} in `{path}` is "
                                  f"{'a list of messages' if conv else 'a string'} while earlier columns are "
                                  f"{'strings' if conv else 'messages'}; TRL needs all strings or all messages")
    if fmt == "unpaired-preference":  # KTOTrainer: `label` True for a desirable completion (DataCollatorForUnpaired...)
        for i, row in enumerate(rows, 1):
            if "label" not in row:
                raise MemfitError(f"example {i} of `{path}` has no `label` column, which the first example has "
                                  "(unpaired-preference format); give every example the same columns")
            if not isinstance(row["label"], bool):
                raise MemfitError(f"`label` of example {i} in `{path}` is `{str(row['label'])[:40]}`; KTOTrainer "
                                  "needs true (a desirable completion) or false (an undesirable one)")
    return TrlData(path=path, format=fmt, rows=rows, conversational=bool(conversational))


# --------------------------------------------------------------------------- inputs


@dataclass
class TrlInputs:
    """What `memfit train --trainer sft|dpo|grpo|rloo|reward|kto|distill` asks for, every value checked (the fields that
    memfit.commands._train_common's `fit_and_report` and `set_aside_earlier_results` read are named as in the
    classification run's `_Inputs`)."""

    trainer: str
    model_dir: str
    kwargs: dict[str, Any]  #: SFTConfig / DPOConfig kwargs from the flags and the --args file
    notes: list[str]
    output_dir: str
    use_cpu: bool | None
    budget_bytes: int | None
    data: TrlData
    targs: Any  #: the SFTConfig / DPOConfig / GRPOConfig
    eval_rows: list[dict[str, Any]] = field(default_factory=list)
    #: GRPO: the checked --reward-func values (memfit.commands._reward_funcs.RewardFunc), in order
    reward_funcs: list[Any] = field(default_factory=list)
    #: distillation: the checked --teacher directory
    teacher_dir: str | None = None
    is_default: bool = False
    #: what the trainer writes into output_dir itself: TRL's model card (`_save_checkpoint` -> `create_model_card`
    #: writes `output_dir/README.md`), so an earlier README.md there is moved aside first, this run's kept
    run_files: tuple[str, ...] = ("README.md",)

    @property
    def data_path(self) -> str:
        return self.data.path


def _causal_lm_check(model_dir: str, trainer: str) -> Any:
    """The model's config, or a MemfitError when it is not a causal language model."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as err:
        raise MemfitError(f"the config.json of `{model_dir}` cannot be read ({first_line(err)}); pass a Hugging "
                          "Face model directory") from None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = list(getattr(config, "architectures", None) or [])
    ok = any(a in causal for a in archs) if archs else config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not ok:
        what = f"`{archs[0]}`" if archs else f"model type `{config.model_type}`"
        raise MemfitError(f"model `{model_dir}` is a {what}, not a causal language model; `--trainer {trainer}` "
                          "fine-tunes a causal LM (AutoModelForCausalLM: Llama, Qwen, GPT-2, ...): pass one, or drop "
                          "--trainer to fine-tune a classifier")
    return config


def _reward_model_check(model_dir: str) -> tuple[Any, bool]:
    """RewardTrainer's model: AutoModelForSequenceClassification with num_labels=1 (reward_trainer.py `__init__`:
    `model_init_kwargs["num_labels"] = 1`, `create_model_from_path(model, AutoModelForSequenceClassification)`). A
    causal LM's directory loads too: its body's weights, a new (random) one-score head. The config and whether the
    head is new, or a MemfitError."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as err:
        raise MemfitError(f"the config.json of `{model_dir}` cannot be read ({first_line(err)}); pass a Hugging "
                          "Face model directory") from None
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise MemfitError(f"model `{model_dir}` (model type `{config.model_type}`) has no sequence-classification "
                          "class in transformers; `--trainer reward` loads AutoModelForSequenceClassification with "
                          "num_labels=1 (RewardTrainer): pass a Llama, Qwen, GPT-2, ... directory")
    classifiers = set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())
    archs = list(getattr(config, "architectures", None) or [])
    if any(a in classifiers for a in archs) and getattr(config, "num_labels", 1) != 1:
        raise MemfitError(f"model `{model_dir}` is a `{archs[0]}` with {config.num_labels} labels; RewardTrainer "
                          "loads it with num_labels=1 (one score per sequence), which does not fit its head: pass "
                          "a one-label classifier or the causal LM it was fine-tuned from")
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return config, any(a in causal for a in archs) or not archs


def check_teacher(args: argparse.Namespace, kwargs: dict[str, Any], model_dir: str, config: Any) -> str:
    """The --teacher directory (or `teacher_model_name_or_path` of --args), checked before any model loads: a local
    causal LM directory (no hub: a hub id says how to download it, as --reward-func does) whose vocabulary size is
    the student's (DistillationTrainer.__init__: "requires a shared vocabulary"); a one-line MemfitError otherwise."""
    given = getattr(args, "teacher_model", None) or kwargs.get("teacher_model_name_or_path")
    flag = flag_name(args, "teacher_model") if getattr(args, "teacher_model", None) else "teacher_model_name_or_path"
    if not given:
        raise MemfitError("`--trainer distill` needs the teacher DistillationTrainer distils from: give `--teacher DIR`, "
                          "a local model directory with the student's vocabulary")
    if not isinstance(given, str):
        raise MemfitError(f"`{flag}` must be a model directory; got `{given!r}`")
    if not os.path.isdir(given):
        if given.count("/") == 1 and not given.startswith((".", "/", "~")):
            raise MemfitError(f"`{flag} {given}` is not a local directory; memfit train loads the teacher from a local "
                              f"directory (download it first: `hf download {given} --local-dir DIR`, then --teacher DIR)")
        if os.path.exists(given):
            raise MemfitError(f"`{flag} {given}` is a file, not a model directory; give the teacher's local model "
                              "directory (its config.json and weights)")
        raise MemfitError(f"`{flag} {given}`: the directory does not exist; give the teacher's local model directory")
    check_model_dir(given, given)
    teacher = _causal_lm_check(given, "distill")
    student_vocab = config.get_text_config().vocab_size
    teacher_vocab = teacher.get_text_config().vocab_size
    if student_vocab != teacher_vocab:
        raise MemfitError(f"the teacher `{given}` has vocab_size {teacher_vocab} but the student `{model_dir}` has "
                          f"{student_vocab}; DistillationTrainer compares their next-token distributions over one "
                          "vocabulary (distillation_trainer.py __init__): give a teacher of the student's tokenizer")
    return given


def trl_config(trainer: str, output_dir: str, use_cpu: bool | None, kwargs: dict[str, Any]) -> Any:
    """SFTConfig / DPOConfig / GRPOConfig of `kwargs`, or a one-line MemfitError for what the config rejects.

    Args:
        trainer: `sft`, `dpo`, `grpo`, `reward` or `kto`.
        output_dir: TrainingArguments.output_dir.
        use_cpu: None: the CPU when CUDA is not available.
        kwargs: the other config kwargs (flags and --args).
    """
    import warnings

    import torch

    try:
        import trl
    except ImportError:
        raise MemfitError(f"`--trainer {trainer}` needs TRL and datasets: `pip install trl datasets` "
                          "(memfit's `llm` extra)") from None
    cls = getattr(trl, _CONFIGS[trainer])
    use_cpu = (not torch.cuda.is_available()) if use_cpu is None else use_cpu
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24: gradient_checkpointing's new name
            return cls(output_dir=output_dir, use_cpu=use_cpu, **kwargs)
    except TypeError as err:
        raise MemfitError(f"{cls.__name__} rejected the arguments: {str(err).splitlines()[0]}; fix the --args file") \
            from None
    except (ValueError, KeyError, AttributeError, ZeroDivisionError) as err:  # enum names, TRL's __post_init__
        # checks (GRPOConfig divides by num_generations before it checks it)
        raise MemfitError(f"invalid {cls.__name__}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")\
            from None


def _check_grpo_config(targs: Any, n_rewards: int, source: str | None) -> None:
    """GRPOConfig (and RLOOConfig) values its __post_init__ accepts but the trainer fails on at the first step or in
    __init__: `loss_type` (GRPO only: grpo_trainer.py `_compute_loss` raises "Unknown loss type"), `temperature`
    (transformers' TemperatureLogitsWarper raises at the first generation), `use_vllm` without vLLM (GRPOTrainer /
    RLOOTrainer.__init__ raise ImportError), `reward_weights` (one number per reward function, their __init__)."""
    import difflib
    import math

    from memfit.fitting.grpo_recovery import ROW_MEAN_LOSSES, SUM_LOSSES, TOKEN_MEAN_LOSSES

    where = f" of `{source}`" if source else ""
    losses = SUM_LOSSES + ROW_MEAN_LOSSES + TOKEN_MEAN_LOSSES
    if hasattr(targs, "loss_type") and targs.loss_type not in losses:  # RLOOConfig has no loss_type
        close = difflib.get_close_matches(str(targs.loss_type), losses, n=1)
        raise MemfitError(f"`loss_type: {targs.loss_type!r}`{where} is not a GRPOTrainer loss; use one of "
                          f"{', '.join(losses)}" + (f" (did you mean `{close[0]}`?)" if close else ""))
    t = targs.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise MemfitError(f"`temperature: {t!r}`{where} must be a positive number (the sampling temperature of "
                          f"the generation); {type(targs).__name__}'s default is 1.0")
    if targs.use_vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # GRPOTrainer.__init__ raises ImportError after loading
            raise MemfitError(f"`use_vllm: true`{where} needs vLLM, which is not installed: `pip install trl[vllm]`, "
                              "or remove use_vllm (transformers' generate generates the completions); `memfit "
                              "estimate --trainer grpo --use-vllm` models vLLM without it")
    weights = targs.reward_weights
    if weights is not None:
        if not isinstance(weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
            raise MemfitError(f"`reward_weights: {weights!r}`{where} must be a list of numbers, one per "
                              "--reward-func")
        if len(weights) != n_rewards:
            raise MemfitError(f"`reward_weights`{where} has {len(weights)} weights for {n_rewards} --reward-func; "
                              "give one weight per reward function")


def read_trl_inputs(args: argparse.Namespace, trainer: str) -> TrlInputs:
    """Check the flags, the model directory, the --args file, the output dir, the budget, --resume and the data."""
    if args.model is None or args.data is None:
        raise MemfitError(f"`--trainer {trainer}` needs a model directory and --data (the built-in default is a "
                          "classification run); got " + ("neither" if args.model is None and args.data is None else
                                                          "no --data" if args.data is None else "no model"))
    check_counts(args, ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                        "max_length", "max_steps", "max_recoveries", "num_generations", "max_completion_length",
                        "steps_per_generation", "generation_batch_size", "num_iterations"))
    check_model_dir(args.model, args.model)
    model_dir = args.model
    if trainer == "reward":
        config, new_head = _reward_model_check(model_dir)
    else:
        config, new_head = _causal_lm_check(model_dir, trainer), False
    kwargs, notes = training_kwargs(args, False, trainer=trainer)
    if args.per_device_eval_batch_size is None and "per_device_eval_batch_size" not in kwargs:
        kwargs["per_device_eval_batch_size"] = kwargs["per_device_train_batch_size"]
    output_dir = kwargs.pop("output_dir", None) or "memfit-train-out"
    use_cpu = kwargs.pop("use_cpu", None)
    if use_cpu is not None and not isinstance(use_cpu, bool):
        raise MemfitError(f"`use_cpu` in `{args.args_file}` must be true or false; got `{use_cpu!r}`")
    check_output_dir(output_dir, model_dir)
    budget_bytes = read_budget(args.budget)
    check_resume(args.resume)
    positions = getattr(config, "max_position_embeddings", None)
    if trainer not in _GENERATING and "max_length" not in kwargs and isinstance(positions, int) \
            and positions < TRL_DEFAULT_MAX_LENGTH:
        kwargs["max_length"] = positions
        notes.append(f"max_length {positions}: the model's positions (max_position_embeddings), below TRL's default "
                     f"{TRL_DEFAULT_MAX_LENGTH}")
    if trainer in _GENERATING and "max_completion_length" not in kwargs and isinstance(positions, int) \
            and positions <= GRPO_DEFAULT_MAX_COMPLETION_LENGTH:
        kwargs["max_completion_length"] = positions // 2
        notes.append(f"max_completion_length {positions // 2}: half the model's {positions} positions "
                     f"(max_position_embeddings), the rest for the prompt; {_CONFIGS[trainer]}'s default is "
                     f"{GRPO_DEFAULT_MAX_COMPLETION_LENGTH}")
    if trainer in _RL:  # GRPOConfig.__post_init__ (RLOOConfig's too) divides by num_generations before it checks it
        for name in ("num_generations", "steps_per_generation", "generation_batch_size", "num_iterations",
                     "max_completion_length"):
            value = kwargs.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise MemfitError(f"`{name}` in `{args.args_file}` must be a positive integer; got `{value!r}`")
    teacher_dir = None
    if trainer == "distill":  # the teacher checked before any model loads
        teacher_dir = check_teacher(args, kwargs, model_dir, config)
        kwargs["teacher_model_name_or_path"] = teacher_dir
    targs = trl_config(trainer, output_dir, use_cpu, kwargs)  # every setting checked before the data is read
    from memfit.train_setup import TrainSetup

    TrainSetup.from_training_args(targs, model=config)  # memfit's checks of the TRL settings (packing_strategy, ...)
    max_length = getattr(targs, "max_length", None)
    if isinstance(positions, int) and isinstance(max_length, int) and max_length > positions:
        raise MemfitError(f"`--max-length {max_length}` is longer than the model's {positions} positions "
                          f"(max_position_embeddings); pass --max-length {positions} or less")
    completion = getattr(targs, "max_completion_length", None) if trainer in _GENERATING else None
    if isinstance(positions, int) and isinstance(completion, int) and completion >= positions:
        given = (f"`{flag_name(args, 'max_completion_length')} {completion}`" if args.max_completion_length is not None
                 else f"`max_completion_length: {completion}` of `{args.args_file}`")
        raise MemfitError(f"{given} leaves no room for a prompt in the model's "
                          f"{positions} positions (max_position_embeddings); pass --max-completion-length "
                          f"{positions // 2} or less")
    text_field = getattr(targs, "dataset_text_field", None) or "text"
    data = read_trl_data(args.data, trainer, text_field)
    if getattr(targs, "completion_only_loss", None) and data.format != "prompt-completion":
        raise MemfitError(f"`--completion-only-loss` needs prompt/completion data; `{args.data}` is in {data.format} "
                          "format" + (" (use --assistant-only-loss for chat messages)" if data.format == "messages"
                                      else "") + "; SFTTrainer's collator would fail at the first batch")
    if getattr(targs, "assistant_only_loss", False) and not data.conversational:
        raise MemfitError(f"`--assistant-only-loss` needs conversational data (lists of chat messages); `{args.data}` "
                          f"holds strings ({data.format} format)")
    reward_funcs: list[Any] = []
    if trainer in _RL:
        from memfit.commands._reward_funcs import read_reward_funcs

        columns = tuple(sorted({k for row in data.rows for k in row} - {"prompt", "completion", "completion_ids"}))
        reward_funcs = read_reward_funcs(args.reward_funcs, columns, data.conversational, _TRAINERS[trainer])
        _check_grpo_config(targs, len(reward_funcs), args.args_file)
    if getattr(targs, "activation_offloading", False):
        import torch

        if getattr(torch, "accelerator", None) is not None and torch.accelerator.current_accelerator() is None:
            raise MemfitError("`activation_offloading` needs a GPU: TRL's OffloadActivations reads "
                              "`torch.accelerator.current_accelerator().type` (trl/models/activation_offloading.py), "
                              "None on this machine; remove it from --args")
    eval_rows: list[dict[str, Any]] = []
    if args.eval_data:
        eval_data = read_trl_data(args.eval_data, trainer, text_field)
        if eval_data.format != data.format:
            raise MemfitError(f"--eval-data `{args.eval_data}` is in {eval_data.format} format, --data in "
                              f"{data.format}; give both in the same format")
        eval_rows = eval_data.rows
    elif str(getattr(targs.eval_strategy, "value", targs.eval_strategy)) != "no":
        if len(data.rows) < 2:
            raise MemfitError(f"`{args.data}` has {len(data.rows)} example; give at least 2 (or --eval-data)")
        n_eval = max(1, len(data.rows) // 5)
        eval_rows = data.rows[-n_eval:]
        data = TrlData(data.path, data.format, data.rows[:-n_eval], data.conversational)
    window = targs.per_device_train_batch_size * targs.gradient_accumulation_steps
    if trainer == "distill" and len(data.rows) < window:  # distillation_trainer.py `_get_train_sampler`
        raise MemfitError(f"`--trainer distill` generates for per_device_train_batch_size x gradient_accumulation_steps "
                          f"= {window} prompts at once, and DistillationTrainer's sampler drops a generation batch "
                          f"that is not full: `{args.data}` gives {len(data.rows)} training prompts"
                          + (" (after the eval split)" if eval_rows and not args.eval_data else "")
                          + f"; give at least {window}, or lower --batch-size / --grad-accum")
    if trainer in _RL:  # grpo_trainer.py / rloo_trainer.py RepeatSampler: a generation batch's prompts, full or dropped
        prompts = targs.generation_batch_size // targs.num_generations
        if len(data.rows) < prompts:
            raise MemfitError(
                f"`--trainer {trainer}` generates {targs.num_generations} completions for each of "
                f"generation_batch_size / num_generations = {prompts} prompts at once, and {_TRAINERS[trainer]}'s "
                f"sampler drops a generation batch that is not full: `{args.data}` gives {len(data.rows)} training "
                "prompt" + ("s" if len(data.rows) != 1 else "")
                + (" (after the eval split)" if eval_rows and not args.eval_data else "")
                + f", so no step would run; give at least {prompts}, or lower --batch-size / --grad-accum")
    if new_head:
        notes.append(f"`{os.path.basename(model_dir.rstrip('/'))}` is a causal LM: RewardTrainer's "
                     "AutoModelForSequenceClassification keeps its body and starts a new one-score head (random)")
    return TrlInputs(trainer, model_dir, kwargs, notes, output_dir, use_cpu, budget_bytes, data, targs, eval_rows,
                     reward_funcs=reward_funcs, teacher_dir=teacher_dir)


# --------------------------------------------------------------------------- the trainer


def _tokenizer(inputs: TrlInputs) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(inputs.model_dir)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MemfitError(f"the tokenizer of `{inputs.model_dir}` cannot be loaded ({first_line(err)}); the model "
                          "directory needs its tokenizer files (tokenizer.json, tokenizer_config.json)") from None
    if inputs.data.conversational and not getattr(tok, "chat_template", None):
        raise MemfitError(f"the tokenizer of `{inputs.model_dir}` has no chat template, which the chat messages of "
                          f"`{inputs.data.path}` need (TRL applies it to every example): add `chat_template` to its "
                          "tokenizer_config.json (or a chat_template.jinja), or give the data as strings")
    if getattr(tok, "eos_token", None) is None:
        use = (f"{_TRAINERS[inputs.trainer]} stops each completion at (and pads with, without a pad token)"
               if inputs.trainer in _GENERATING
               else "TRL appends to every example (`add_eos`)")
        raise MemfitError(f"the tokenizer of `{inputs.model_dir}` has no EOS token, which {use}; set `eos_token` in "
                          "its tokenizer_config.json")
    return tok


def _peft_config(args: argparse.Namespace) -> Any:
    if getattr(args, "lora_r", None) is None:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise MemfitError("`--lora-r` needs peft: `pip install peft`") from None
    from memfit.train_setup import TrainSetup

    defaults = TrainSetup()  # memfit's LoRA defaults, as `memfit estimate --lora-r` simulates them
    targets = split_list(args.lora_target_modules or "") or "all-linear"
    # SEQ_CLS for RewardTrainer: peft trains the new score head in full (modules_to_save)
    return LoraConfig(r=args.lora_r, lora_alpha=defaults.lora_alpha, lora_dropout=defaults.lora_dropout,
                      target_modules=targets, task_type="SEQ_CLS" if args.trainer == "reward" else "CAUSAL_LM")


def build_trl_trainer(args: argparse.Namespace, inputs: TrlInputs) -> Any:
    """The model, the datasets and TRL's trainer of `inputs.targs` (its printer callback removed); GRPO's with the
    reward functions of --reward-func (a reward model directory as its path: GRPOTrainer loads it)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    from memfit.fitting.preflight_check import check_budget_covers_model

    try:
        import trl
        from datasets import Dataset
    except ImportError:
        raise MemfitError(f"`--trainer {inputs.trainer}` needs TRL and datasets: `pip install trl datasets` "
                          "(memfit's `llm` extra)") from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()  # TRL's dataset preparation (tokenizing, packing) maps with progress bars
    targs = inputs.targs
    tokenizer = _tokenizer(inputs)
    torch.manual_seed(targs.seed)
    try:
        if inputs.trainer == "reward":  # as RewardTrainer loads a path: one score per sequence
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForSequenceClassification.from_pretrained(inputs.model_dir, num_labels=1)
        else:
            model = AutoModelForCausalLM.from_pretrained(inputs.model_dir)
    except (OSError, ValueError) as err:
        what = "a one-score sequence classifier" if inputs.trainer == "reward" else "a causal LM"
        raise MemfitError(f"the model in `{inputs.model_dir}` cannot be loaded as {what} ({first_line(err)})") \
            from None
    teacher = None
    # the teacher loaded as the student is (DistillationTrainer puts it on the device); with teacher_model_init_kwargs
    # in --args, TRL loads it from the directory with them (it refuses those kwargs with a loaded teacher)
    if inputs.teacher_dir is not None and getattr(targs, "teacher_model_init_kwargs", None) is None:
        try:
            teacher = AutoModelForCausalLM.from_pretrained(inputs.teacher_dir)
        except (OSError, ValueError) as err:
            raise MemfitError(f"the teacher in `{inputs.teacher_dir}` cannot be loaded as a causal LM "
                              f"({first_line(err)})") from None
    check_budget_covers_model(model, inputs.budget_bytes, frozen=(teacher,) if teacher is not None else ())
    try:
        train_ds = Dataset.from_list(inputs.data.rows)
        eval_ds = Dataset.from_list(inputs.eval_rows) if inputs.eval_rows else None
    except Exception as err:  # noqa: BLE001 - pyarrow's type errors: mixed types in a column
        raise MemfitError(f"the examples of `{inputs.data.path}` cannot be made a dataset ({first_line(err)}); give "
                          "each column one type in every example") from None
    cls = getattr(trl, _TRAINERS[inputs.trainer])
    extra = ({"reward_funcs": [r.value for r in inputs.reward_funcs]} if inputs.trainer in _RL
             else {"teacher_model": teacher if teacher is not None else inputs.teacher_dir}
             if inputs.teacher_dir is not None else {})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cls(model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds,
                          processing_class=tokenizer, peft_config=_peft_config(args), **extra)
    except (ValueError, KeyError, TypeError) as err:  # TRL's own checks (a template without generation markers, ...)
        raise MemfitError(f"{cls.__name__} rejected the setup: {first_line(err)}") from None
    except ImportError as err:  # GRPOConfig.use_vllm without vLLM installed (GRPOTrainer.__init__)
        raise MemfitError(f"{cls.__name__} needs a package that is not installed: {first_line(err)}; install it or "
                          "remove the setting that needs it (use_vllm: vLLM) from --args") from None
    if inputs.teacher_dir is not None and teacher is None:  # the teacher TRL loaded
        check_budget_covers_model(model, inputs.budget_bytes, frozen=(trainer.teacher_model,))
    trainer.remove_callback(PrinterCallback)
    from memfit.fitting.resume import resolve_checkpoint

    resolve_checkpoint(trainer, args.resume)
    return Run(trainer, tokenizer, targs)


def _preflight(console: Any, args: argparse.Namespace, inputs: TrlInputs, run: Any) -> Any:
    """Say what runs, then memfit's preflight: the predicted peak and the flags."""
    import memfit.fitting.run as mf
    from memfit.units import format_bytes

    targs, trainer = run.targs, run.trainer
    name = _TRAINERS[inputs.trainer]
    n_train = len(trainer.train_dataset)
    console.print(f"[bold]memfit train[/bold] {os.path.basename(inputs.model_dir.rstrip('/'))} with TRL's {name} on "
                  f"`{os.path.basename(inputs.data.path)}` ({len(inputs.data.rows)} examples, {inputs.data.format}"
                  + (", conversational" if inputs.data.conversational else "") + f"; {n_train} "
                  + ("packs" if getattr(targs, "packing", False) else "prompts" if inputs.trainer in _GENERATING
                     else "train rows")
                  + (f" / {len(inputs.eval_rows)} eval" if inputs.eval_rows else "") + ")")
    lora = f", LoRA r={args.lora_r}" if getattr(args, "lora_r", None) else ""
    if inputs.trainer in _RL:  # GRPOConfig's (RLOOConfig's) derived sizes (grpo_config.py __post_init__)
        lengths = (f"{targs.num_generations} completions per prompt of up to {targs.max_completion_length} tokens, "
                   f"{targs.generation_batch_size} generated at once, beta {targs.beta:g}")
    elif inputs.trainer == "distill":  # DistillationTrainer: one completion per prompt, the window's at once
        lengths = (f"one completion per prompt of up to {targs.max_completion_length} tokens, "
                   f"{targs.per_device_train_batch_size * targs.gradient_accumulation_steps} generated at once, beta "
                   f"{targs.beta:g}, teacher {os.path.basename(str(inputs.teacher_dir).rstrip('/'))}")
    else:
        lengths = f"max_length {targs.max_length}"
    console.print(f"batch {targs.per_device_train_batch_size} x accumulation {targs.gradient_accumulation_steps}, "
                  f"{lengths}, {targs.num_train_epochs:g} epochs{lora}"
                  + (f", emulated GPU of {format_bytes(inputs.budget_bytes)} (memory_budget)" if inputs.budget_bytes
                     else "") + (f", GPU {args.gpu}" if args.gpu else ""))
    if inputs.reward_funcs:
        console.print("rewards: " + ", ".join(f"{r.name} ({'reward model' if r.kind == 'model' else 'function'})"
                                              for r in inputs.reward_funcs))
    for note in inputs.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    models = [r for r in inputs.reward_funcs if r.kind == "model"]
    for i, r in enumerate(models):  # memfit.sim.grpo_steps models one reward model (TrainSetup.reward_model)
        counted = ("memfit's prediction counts its weights and its forward over each generation batch" if i == 0
                   else f"memfit's prediction models one reward model (`{models[0].name}`) and leaves this one out")
        console.print(f"[yellow]note:[/yellow] the reward model `{r.name}` sits on the GPU beside the policy; "
                      f"{counted}", soft_wrap=True)
    pre = mf.preflight(trainer, gpu=args.gpu, budget_bytes=inputs.budget_bytes)
    print_preflight(console, pre, no_plan=args.no_plan)
    return pre


def train_trl_command(args: argparse.Namespace, trainer: str, console: Any) -> int:
    """`memfit train --trainer sft|dpo|grpo|rloo|reward|kto|distill`: check every input, build TRL's trainer, preflight, `memfit.fit`,
    report."""
    inputs = read_trl_inputs(args, trainer)
    run = build_trl_trainer(args, inputs)
    pre = _preflight(console, args, inputs, run)
    set_aside_earlier_results(console, inputs)
    import warnings

    with warnings.catch_warnings():  # transformers 5.24 renames gradient checkpointing; TRL calls the old names
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        return fit_and_report(console, args, inputs, run, pre)
