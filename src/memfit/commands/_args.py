"""The one reader of `--args FILE` for every verb (estimate, plan, diagnose, train).

An arguments file is a JSON object of `transformers.TrainingArguments` kwargs; memfit's
TrainSetup fields (`"model"`, `"max_length"`, `"task"`, ...) may be in it too. Its names are
checked by `memfit.train_setup.normalize_arg_names`, the same for every verb:

* a legacy name (`evaluation_strategy`, `no_cuda`, `max_seq_length`, ...) is read as its
  current name, with a note; a removed setting is dropped, with a note;
* an unknown name is a one-line MemfitError naming the closest valid name (difflib).

When a command-line flag sets what the file sets too (`--batch-size 4` and
`"per_device_train_batch_size": 8`; `--output-dir` and `"output_dir"`), **the flag wins**, and
a note says so: a flag is the more specific, later choice (as with `python train.py
--config c.json --lr ...` scripts), and a run never stops over an argument it can honour.
Settings memfit itself controls in `memfit train` (`report_to`, `disable_tqdm`) are noted
when the file sets them otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.errors import MemfitError
from memfit.train_setup import normalize_arg_names, read_args_file

__all__ = ["read_args", "train_kwargs_from_file", "FORCED_BY_TRAIN"]

#: TrainingArguments memfit train sets whatever the file says (its progress bar and report replace them).
FORCED_BY_TRAIN = {"report_to": "none", "disable_tqdm": True}

#: TrainSetup fields that `memfit train` takes from a file (it has flags for them; the flag wins).
_TRAIN_SETUP_FIELDS = ("max_length", "num_labels")


def read_args(path: str) -> tuple[dict[str, Any], list[str]]:
    """Read and name-check an arguments file. Returns (settings, notes)."""
    return normalize_arg_names(read_args_file(path), source=f"`{path}`")


def train_kwargs_from_file(path: str, setup_names: set[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """`memfit train --args FILE`: (TrainingArguments kwargs, the TrainSetup fields train uses, notes).

    Args:
        path: the JSON file.
        setup_names: TrainSetup's field names (a memfit setting `memfit train` does not take is an error).
    """
    from memfit.train_setup import TRAINING_ARGS_NAMES

    data, notes = read_args(path)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if key in TRAINING_ARGS_NAMES:
            kwargs[key] = value
        elif key in _TRAIN_SETUP_FIELDS:
            extra[key] = value
        elif key == "model":
            raise MemfitError(f"`model` in `{path}`: `memfit train` takes the model as its first argument "
                              "(`memfit train MODEL --data FILE`); remove it from the file")
        elif key in setup_names or key == "quantization_config":  # quantization (issue 12): estimate/plan only
            raise MemfitError(f"`{key}` in `{path}` is a memfit estimate setting that `memfit train` does not take; "
                              "remove it from the file")
    for key, forced in FORCED_BY_TRAIN.items():
        if key in kwargs and kwargs[key] != forced:
            notes.append(f"`{key}` of `{path}` is replaced by {forced!r}: memfit train reports progress itself")
    return kwargs, extra, notes


def flag_wins(kwargs: dict[str, Any], name: str, value: Any, flag: str, notes: list[str], source: str | None) -> None:
    """Set `kwargs[name] = value` from a flag, with a note when the file had another value."""
    if source is not None and name in kwargs and kwargs[name] != value:
        notes.append(f"`{flag} {value}` overrides `{name}: {kwargs[name]!r}` of `{source}` (the flag wins)")
    kwargs[name] = value


def args_source(args: argparse.Namespace) -> str | None:
    return getattr(args, "args_file", None)
