"""`--data FILE --tokenizer ID|DIR` for `memfit estimate` and `memfit plan`: the worst batch of the user's own
data is simulated instead of every batch padded to `--max-length`.

    memfit estimate bert-base-uncased --data src/memfit/data/sentiment.csv --tokenizer bert-base-uncased
    memfit plan ./my-model --data train.jsonl --tokenizer ./my-model --pad-to-multiple-of 8 --gpu T4

The examples are read by memfit.inputs.data_file (the reader of `memfit train --data`), tokenized by the
tokenizer given (transformers' `AutoTokenizer`, offline where it is a folder), and memfit.inputs.lengths
finds the worst batch the sampler can form with the collator's padding (`--padding`, `--pad-to-multiple-of`),
`--group-by-length` and TRL packing (`--packing`). That batch's padded length becomes the simulated
`max_length` (with packing, the lengths go to TrainSetup.example_lengths, whose packs the simulation fills); a
note says which batch it is.
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.errors import MemfitError

__all__ = ["add_data_arguments", "apply_data", "data_note"]


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    from memfit.inputs.lengths import PADDINGS

    g = p.add_argument_group("the training data (the worst batch it makes is simulated)")
    g.add_argument("--data", dest="data_file", default=None, metavar="FILE",
                   help="training data: .csv, .json, .jsonl or a folder saved by `datasets` (as `memfit train "
                        "--data`); needs --tokenizer")
    g.add_argument("--tokenizer", default=None, metavar="ID|DIR", help="the tokenizer that counts the tokens of --data")
    g.add_argument("--text-column", default=None, help="the text column of --data (default text)")
    g.add_argument("--padding", choices=PADDINGS, default=None,
                   help="the collator's padding: longest (DataCollatorWithPadding's default) or max_length")
    g.add_argument("--pad-to-multiple-of", type=int, default=None, metavar="N",
                   help="the collator's pad_to_multiple_of (e.g. 8 for tensor cores)")
    g.add_argument("--group-by-length", action="store_true",
                   help="TrainingArguments.group_by_length (the batch with the longest example comes first)")


def _load_tokenizer(name: str) -> Any:
    import os

    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=not os.path.isdir(name) and
                                             os.environ.get("HF_HUB_OFFLINE") == "1")
    except (OSError, ValueError, KeyError) as err:
        raise MemfitError(f"cannot load the tokenizer `{name}` ({str(err).splitlines()[0][:160]}); pass --tokenizer "
                          "with a folder holding tokenizer files or a hub id this machine can download") from err


#: how the note of apply_data begins (data_note finds it among the setup's notes)
NOTE_PREFIX = "data: "


def data_note(args: argparse.Namespace, setup) -> str | None:
    """The note apply_data added (which batch was simulated), or None without `--data`."""
    if getattr(args, "data_file", None) is None:
        return None
    return next((n for n in reversed(setup.notes) if n.startswith(NOTE_PREFIX)), None)


def apply_data(args: argparse.Namespace, setup):
    """The setup with the worst batch of `--data` (module docstring); the setup as it is without `--data`."""
    path = getattr(args, "data_file", None)
    if path is None:
        for flag in ("tokenizer", "text_column", "padding", "pad_to_multiple_of"):
            if getattr(args, flag, None) is not None:
                raise MemfitError(f"`--{flag.replace('_', '-')}` describes the training data: give the data with "
                                  "`--data FILE` as well")
        if getattr(args, "group_by_length", False):
            raise MemfitError("`--group-by-length` describes the training data: give it with `--data FILE`")
        return setup
    if not args.tokenizer:
        raise MemfitError(f"`--data {path}` needs the tokenizer that counts its tokens: pass `--tokenizer ID|DIR` "
                          "(the model's own, e.g. its hub id or folder)")
    from memfit.inputs.data_file import read_texts
    from memfit.inputs.lengths import data_lengths, token_lengths

    column = args.text_column or "text"
    texts = read_texts(path, column)
    lengths, longer = token_lengths(texts, _load_tokenizer(args.tokenizer), max_length=setup.max_length,
                                    truncation=setup.truncation)
    packing = setup.trainer == "sft" and bool(setup.packing)
    info = data_lengths(lengths, setup.per_device_train_batch_size, truncated=longer if setup.truncation else 0,
                        padding=args.padding or "longest", max_length=setup.max_length,
                        pad_to_multiple_of=args.pad_to_multiple_of, group_by_length=args.group_by_length,
                        packing=packing)
    notes = [*setup.notes, f"{info.summary()}; simulated at {info.worst.rows} x {info.worst.padded_length} tokens"
                          f" (`{path}`, tokenizer `{args.tokenizer}`)"]
    if not setup.truncation and longer:
        notes.append(f"{longer} examples are longer than max_length {setup.max_length} and not truncated")
    if packing:  # TrainSetup.padding_free_tokens / the packed rows read the lengths themselves
        return setup.replace(example_lengths=list(lengths), notes=notes)
    return setup.replace(max_length=info.worst.padded_length, example_lengths=None, notes=notes)
