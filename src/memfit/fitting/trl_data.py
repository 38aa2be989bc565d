"""Token lengths of a TRL dataset file: what SFTTrainer / DPOTrainer (TRL 1.16) would tokenize.

    from memfit.fitting.trl_data import dataset_lengths
    data = dataset_lengths("chat.jsonl", tokenizer, trainer="sft")
    setup = TrainSetup(model=..., trainer="sft", example_lengths=data.lengths, max_length=1024)

A JSONL file of one of TRL's dataset formats (trl.data_utils `is_conversational`): `text`
(language modelling), `messages` (chat), `prompt` / `completion` (either strings or messages), and for
DPO `prompt` / `chosen` / `rejected`. Each example is tokenized as TRL's `_prepare_dataset` does it
(sft_trainer.py / dpo_trainer.py `tokenize_fn`): EOS appended to non-conversational text and completions
(`add_eos`), chat messages through the tokenizer's chat template. With those lengths, `TrainSetup` gives
the worst micro-batch after padding (the longest example, truncated to max_length) or packing
(`padding_free_tokens`), as preflight does from a trainer's processed dataset.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.sim import _trl_adapter as trl_adapter

__all__ = ["DatasetLengths", "dataset_lengths", "read_jsonl", "dataset_format"]


@dataclass(frozen=True)
class DatasetLengths:
    """Token lengths of a dataset's examples as the TRL trainer tokenizes them (for DPO, the longer of
    prompt+chosen and prompt+rejected of each pair)."""

    format: str
    lengths: list[int]

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    def percentile(self, q: float) -> int:
        """The q-th percentile (0-100) of the lengths, nearest rank."""
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered))) - 1))]


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The examples of a JSONL file, or a one-line MemfitError naming the line that is wrong."""
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise MemfitError(f"line {n} of `{path}` is not JSON ({err.msg}); one JSON object per line") from None
                if not isinstance(row, dict):
                    raise MemfitError(f"line {n} of `{path}` is `{type(row).__name__}`, not a JSON object")
                rows.append(row)
    except FileNotFoundError:
        raise MemfitError(f"dataset file `{path}` does not exist; pass a JSONL file") from None
    except UnicodeDecodeError as err:
        raise MemfitError(f"dataset file `{path}` is not UTF-8 text (byte {err.start})") from None
    if not rows:
        raise MemfitError(f"dataset file `{path}` has no examples")
    return rows


def dataset_format(row: dict[str, Any], trainer: str, text_field: str = "text") -> str:
    """`text`, `messages`, `prompt-completion` (SFT), `preference` (DPO; reward: `prompt` optional),
    `unpaired-preference` (KTO) or `prompt-only` (GRPO: a `prompt` column; GRPOTrainer passes the others to the
    reward functions), or a MemfitError listing the columns."""
    keys = set(row)
    if trainer in ("grpo", "rloo", "distill"):  # RLOOTrainer and DistillationTrainer read GRPOTrainer's prompt-only data
        if "prompt" in keys:
            return "prompt-only"
        need = "a `prompt` column of strings or chat messages"
    elif trainer == "dpo":
        if {"prompt", "chosen", "rejected"} <= keys:
            return "preference"
        need = "`prompt`, `chosen` and `rejected`"
    elif trainer == "reward":  # RewardTrainer `_prepare_dataset`: `prompt` optional (implicit in chosen/rejected)
        if {"chosen", "rejected"} <= keys:
            return "preference"
        need = "`chosen` and `rejected` (and optionally `prompt`)"
    elif trainer == "kto":  # KTOTrainer's unpaired preference format: one completion and a desirable flag
        if {"prompt", "completion", "label"} <= keys:
            return "unpaired-preference"
        if {"prompt", "chosen", "rejected"} <= keys:  # kto_trainer.py `_prepare_dataset`: unpair_preference_dataset
            return "preference"
        need = ("`prompt`, `completion` and `label` (true: desirable, false: undesirable), or `prompt`, `chosen` "
                "and `rejected` (KTOTrainer unpairs them)")
    else:
        if {"prompt", "completion"} <= keys:
            return "prompt-completion"
        if "messages" in keys:
            return "messages"
        if text_field in keys:
            return "text"
        need = f"`{text_field}`, `messages` or `prompt` and `completion`"
    from memfit.train_setup import TRL_CONFIG_CLASS_NAMES

    owner = TRL_CONFIG_CLASS_NAMES.get(trainer, trainer).replace("Config", "Trainer")
    raise MemfitError(f"the examples have the columns `{', '.join(sorted(keys))}`; {owner}'s dataset needs "
                      f"{need} (TRL's dataset formats)")


def _with_eos(value: Any, eos: str | None) -> Any:
    """SFTTrainer / DPOTrainer `add_eos`: EOS appended to non-conversational text that does not end with it."""
    if isinstance(value, str) and eos and not value.endswith(eos):
        return value + eos
    return value


def dataset_lengths(path_or_rows: Any, tokenizer: Any, *, trainer: str = "sft",
                    dataset_text_field: str = "text") -> DatasetLengths:
    """Token lengths of a JSONL file (or a list of examples) as TRL's trainer would tokenize them.

    Args:
        path_or_rows: a JSONL path, or the examples as dicts.
        tokenizer: the model's tokenizer (its chat template for `messages`).
        trainer: `sft` or `dpo`.
        dataset_text_field: SFTConfig.dataset_text_field (the text column).
    """
    if trainer not in ("sft", "dpo"):
        raise MemfitError(f"trainer `{trainer}` has no TRL dataset format; use `sft` or `dpo`")
    rows = read_jsonl(path_or_rows) if isinstance(path_or_rows, (str, os.PathLike)) else list(path_or_rows)
    if not rows:
        raise MemfitError("the dataset has no examples")
    fmt = dataset_format(rows[0], trainer, dataset_text_field)
    eos = getattr(tokenizer, "eos_token", None)
    lengths = []
    try:
        for row in rows:
            if fmt == "text":
                lengths.append(len(trl_adapter.tokenize(tokenizer, _with_eos(row[dataset_text_field], eos))))
            elif fmt == "messages":
                lengths.append(len(trl_adapter.tokenize(tokenizer, row["messages"])))
            elif fmt == "prompt-completion":
                lengths.append(len(trl_adapter.tokenize(tokenizer, _join(row["prompt"], _with_eos(row["completion"], eos)))))
            else:
                pair = [len(trl_adapter.tokenize(tokenizer, _join(row["prompt"], _with_eos(row[k], eos))))
                        for k in ("chosen", "rejected")]
                lengths.append(max(pair))
    except KeyError as err:
        raise MemfitError(f"an example lacks the column `{err.args[0]}` that the first one has ({fmt} format)") from None
    except ValueError as err:  # e.g. no chat template
        raise MemfitError(f"the tokenizer cannot tokenize the {fmt} examples: {str(err).splitlines()[0][:200]}") from None
    return DatasetLengths(format=fmt, lengths=lengths)


def _join(prompt: Any, completion: Any) -> Any:
    """prompt + completion as TRL concatenates them (strings, or lists of messages)."""
    if isinstance(prompt, list) != isinstance(completion, list):
        raise MemfitError("an example mixes a conversational prompt with a text completion (or the reverse); "
                          "use both strings or both lists of messages")
    return prompt + completion
