"""What `memfit train`'s two paths share: transformers' Trainer on a classification set
(memfit.commands.train) and TRL's SFTTrainer / DPOTrainer (memfit.commands.train_trl).

The TrainingArguments kwargs of the flags and the `--args` file (a flag wins, with a note), the checks of the
model and output folders, the memory budget and `--resume`, the preflight lines, and the run under memfit.fit
with its atomic final save, report and summary. Neither command module imports the other's private names.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from memfit.commands._setup_flags import flag_name
from memfit.errors import MemfitError
from memfit.trace import FINAL_SAVE
from memfit.units import format_bytes

__all__ = ["Run", "training_kwargs", "check_counts", "check_model_dir", "check_output_dir", "read_budget",
           "check_resume", "print_preflight", "set_aside_earlier_results", "set_aside_results", "fit_and_report",
           "progress_callback", "first_line", "failure_line", "REPORT_NAME"]


# --------------------------------------------------------------------------- arguments


def training_kwargs(args: argparse.Namespace, is_default: bool,
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
                    notes.append(f"`{flag_name(args, name)} {getattr(args, name)}` overrides `{name}: "
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
    if trainer != "trainer":  # TRL: SFTConfig's (2e-5) / DPOConfig's (1e-6) own learning rate
        del defaults["learning_rate"]
        _trl_kwargs(args, kwargs, notes, source)
    for dest, name in (("per_device_train_batch_size",) * 2, ("per_device_eval_batch_size",) * 2,
                       ("gradient_accumulation_steps",) * 2, ("epochs", "num_train_epochs"), ("max_steps",) * 2,
                       ("learning_rate",) * 2, ("eval_strategy",) * 2, ("save_strategy",) * 2, ("seed",) * 2):
        value = getattr(args, dest)
        if value is not None:
            flag_wins(kwargs, name, value, flag_name(args, dest), notes, source)
        elif name in defaults and name not in kwargs:
            kwargs[name] = defaults[name]
    if is_default and args.per_device_eval_batch_size is None and "per_device_eval_batch_size" not in kwargs:
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


#: GRPOConfig's TrainSetup fields `memfit train --trainer grpo` takes as flags (the vLLM ones through --args).
GRPO_TRAIN_FIELDS = ("num_generations", "max_completion_length", "beta", "steps_per_generation",
                     "generation_batch_size", "num_iterations")


def _trl_kwargs(args: argparse.Namespace, kwargs: dict[str, Any], notes: list[str], source: str | None) -> None:
    """TRL: the SFTConfig / DPOConfig / GRPOConfig settings of the flags into `kwargs` (the flag wins)."""
    from memfit.commands._args import flag_wins

    from memfit.commands._setup_flags import setup_fields

    # the setup flags as TrainSetup reads them (`--packing STRATEGY`: packing and packing_strategy), then TRL's own
    given = setup_fields(args, ("max_length", "packing", "packing_strategy", "padding_free", "completion_only_loss",
                                "assistant_only_loss", "precompute_ref_log_probs", *GRPO_TRAIN_FIELDS))
    if getattr(args, "dataset_text_field", None) is not None:
        given["dataset_text_field"] = args.dataset_text_field
    for name, value in given.items():
        flag = flag_name(args, "packing" if name == "packing_strategy" and args.packing_strategy is None else name)
        flag_wins(kwargs, name, value, flag, notes, source)


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


def check_counts(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """A one-line error for a count flag below 1 (`--max-recoveries`: below 0), named as the user typed it."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and (value < 0 if name == "max_recoveries" else value <= 0):
            raise MemfitError(f"`{flag_name(args, name)}` must be a positive integer; got `{value}`")


def read_budget(budget: str | None) -> int | None:
    """`--budget SIZE` in bytes (None: no emulated GPU); a one-line error for zero or a bad size."""
    if not budget:
        return None
    from memfit.fitting.preflight_check import check_budget

    if str(budget).strip() in ("0", "0.0"):
        raise MemfitError(f"memory budget `{budget}` is zero; give a size such as `800MiB`")
    return check_budget(budget)


def check_resume(resume: Any) -> None:
    """`--resume CHECKPOINT` names a folder (`--resume` alone: True, the last checkpoint in --output-dir)."""
    if isinstance(resume, str) and not os.path.isdir(resume):
        raise MemfitError(f"--resume `{resume}` is not a folder; pass a checkpoint-N folder of an earlier run, "
                          "or --resume alone for the last one in --output-dir")


def progress_callback(console):
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



# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    """The trainer memfit.fit wraps (transformers' Trainer, TRL's SFTTrainer / DPOTrainer), with its tokenizer and
    arguments."""

    trainer: Any
    tokenizer: Any
    targs: Any


def print_preflight(console: Any, pre: Any, *, no_plan: bool) -> None:
    """The preflight's predicted peak, whether it fits, and its flags (both `memfit train` paths)."""
    est = pre.estimate
    console.print(f"plan: predicted peak {format_bytes(est.peak_allocated_bytes)} allocated ({est.peak_phase}); "
                  + ("fits" if pre.fits else "does NOT fit" if pre.fits is False else "no GPU known: fit unknown")
                  + ("; memfit's plan will be applied" if pre.fits is False and not no_plan else ""))
    for f in pre.flags:
        if f.kind != "does_not_fit":
            console.print(f"[yellow]preflight:[/yellow] {f.text} [dim](fix: {f.fix})[/dim]")


def set_aside_earlier_results(console: Any, inputs: Any) -> None:
    """Move an earlier run's results in the output dir aside (memfit deletes nothing it did not write)."""
    output_dir = inputs.output_dir
    os.makedirs(output_dir, exist_ok=True)
    aside = set_aside_results(output_dir, _result_names(inputs.model_dir) | set(getattr(inputs, "run_files", ())))
    if aside:
        console.print(f"[yellow]note:[/yellow] `{output_dir}` held the results of an earlier run "
                      f"({', '.join(sorted(os.listdir(aside)))}): moved to {aside} (memfit deletes nothing it did "
                      "not write in this run)", soft_wrap=True)


def fit_and_report(console: Any, args: argparse.Namespace, inputs: Any, run: Run, pre: Any) -> int:
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
                        progress=progress_callback(console), optimizer_snapshot=args.optimizer_snapshot,
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
        print(f"memfit train: error: {failure_line(failed, report_path)}", file=sys.stderr)
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


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


def failure_line(report: Any, report_path: str) -> str:
    """One line for a failed run: where it failed, the error, the report, where a resume would start."""
    e = report.error or {}
    resume = (f"; the newest checkpoint is {e['last_checkpoint']} (continue with --resume)"
              if e.get("last_checkpoint") else "")
    return (f"training failed after optimizer step {e.get('steps_completed', report.steps_completed)}/"
            f"{report.steps_expected} ({e.get('phase', '?')} phase): {e.get('type', 'error')}: "
            f"{e.get('message', '')}; report: {report_path}{resume}")


def check_model_dir(model_dir: str, given: str) -> None:
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


def check_output_dir(output_dir: str, model_dir: str) -> None:
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
        report.error = failure_record(err, phase=FINAL_SAVE, step=report.steps_completed,
                                      checkpoints=report.checkpoints)
        report.status = "failed"
        try:
            write_report(report, report_path)
        except OSError:
            pass
        return failure_line(report, report_path)
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
