"""The worst batch a data set can put on the GPU: the examples' token lengths, the collator's padding and the
sampler's batches, as pure functions returning records.

    lengths = token_lengths(texts, tokenizer, max_length=512)           # the tokenizer's own counts
    info = data_lengths(lengths, batch_size=8, pad_to_multiple_of=8)    # DataLengths, .worst: WorstBatch
    setup = setup.replace(max_length=info.worst.padded_length)          # simulate the worst batch

The rules, each from the code it mirrors:

* A token length is what the tokenizer gives the example (special tokens included), cut at `max_length` when
  truncating (`tokenizer(text, truncation=True, max_length=...)`).
* Padding: `DataCollatorWithPadding` (transformers data/data_collator.py, default `padding=True`, that is
  "longest") pads each batch to its longest example, then up to a multiple of `pad_to_multiple_of`
  (tokenization_utils_base.py `PreTrainedTokenizerBase._pad`: `max_length = ((max_length //
  pad_to_multiple_of) + 1) * pad_to_multiple_of` when not already a multiple); `padding="max_length"` pads
  every batch to `max_length` (rounded up the same way).
* The worst batch the sampler can form: the training sampler (a `RandomSampler`, or with `group_by_length`
  transformers' `LengthGroupedSampler`) can put the longest example in a batch of `batch_size` examples (fewer
  only when the data set is smaller), and that batch is padded to the longest example. `group_by_length`
  does not make it smaller: it sorts examples by length within mega-batches of 50 batches and moves the batch
  holding the longest example to the front (trainer_pt_utils.py `get_length_grouped_indices`: "the first
  batch is the longest"), so that batch is the first step.
* Packing (TRL `SFTConfig(packing=True)`): examples are concatenated into packs of `max_length` tokens
  (trl data_utils.py `pack_dataset`); a batch is `batch_size` packs, each full but the last; the packs hold
  at most all the data set's (truncated) tokens.

Known limitations: a custom collator or sampler, dynamic batching by tokens, and dropping the last
incomplete batch (`dataloader_drop_last`) are not modelled (the last only ever makes a batch smaller).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from memfit.errors import MemfitError

__all__ = ["PADDINGS", "WorstBatch", "DataLengths", "token_lengths", "padded_length", "worst_batch", "data_lengths"]

#: the collator's `padding`: "longest" (DataCollatorWithPadding's default, `padding=True`) or "max_length"
PADDINGS = ("longest", "max_length")


@dataclass(frozen=True)
class WorstBatch:
    """The batch of the largest padded shape the sampler can form."""

    rows: int
    """Examples (or packs) in the batch."""
    padded_length: int
    """Tokens per row after padding: the simulated batch's max_length."""
    longest_index: int | None
    """0-based index of the longest example (the one the worst batch holds); None with packing."""
    longest_tokens: int
    """Its token length (after truncation)."""
    description: str
    """Which batch this is, in words."""


@dataclass(frozen=True)
class DataLengths:
    """The data set's token lengths and its worst batch."""

    count: int
    lengths: tuple[int, ...]
    """Token lengths, in the data set's order, after truncation."""
    truncated: int
    """Examples longer than max_length (cut when truncating)."""
    min_tokens: int
    median_tokens: float
    max_tokens: int
    worst: WorstBatch

    def summary(self) -> str:
        """One line for a report."""
        cut = f", {self.truncated} truncated" if self.truncated else ""
        return (f"data: {self.count} examples of {self.min_tokens}-{self.max_tokens} tokens (median "
                f"{self.median_tokens:g}{cut}); the worst batch the sampler can form: {self.worst.description}")


def token_lengths(texts: Sequence[str], tokenizer: Any, *, max_length: int | None = None,
                  truncation: bool = True) -> tuple[list[int], int]:
    """(token lengths, how many were longer than `max_length`) of `texts` with `tokenizer` (a transformers
    tokenizer: its own special tokens included; cut at `max_length` when `truncation`)."""
    if not texts:
        raise MemfitError("the data holds no texts; give a file with at least one example")
    full = [len(ids) for ids in tokenizer(list(texts), truncation=False)["input_ids"]]
    if max_length is None:
        return full, 0
    longer = sum(n > max_length for n in full)
    return ([min(n, max_length) for n in full] if truncation else full), longer


def _round_up(n: int, multiple: int | None) -> int:
    if multiple is None or n % multiple == 0:
        return n
    return (n // multiple + 1) * multiple


def padded_length(longest: int, *, padding: str = "longest", max_length: int | None = None,
                  pad_to_multiple_of: int | None = None) -> int:
    """Tokens per row of a batch whose longest example has `longest` tokens (module docstring: padding)."""
    if padding not in PADDINGS:
        raise MemfitError(f"padding `{padding}` is not one of {', '.join(PADDINGS)}")
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 1):
        raise MemfitError(f"pad_to_multiple_of `{pad_to_multiple_of}` must be a whole number >= 1")
    if padding == "max_length":
        if max_length is None:
            raise MemfitError("padding `max_length` needs a max_length; pass --max-length N")
        return _round_up(max(max_length, longest), pad_to_multiple_of)
    return _round_up(longest, pad_to_multiple_of)


def has_padding(setup: Any, seq: int) -> bool:
    """Whether the worst batch of `setup`'s examples, padded to `seq` tokens, has padding (so the attention mask is
    built): unknown lengths count as padded."""
    if setup.example_lengths is None:
        return True
    cut = [min(n, setup.max_length) if setup.truncation else n for n in setup.example_lengths]
    return min(cut) < seq


def worst_batch(lengths: Sequence[int], batch_size: int, *, padding: str = "longest", max_length: int | None = None,
                pad_to_multiple_of: int | None = None, group_by_length: bool = False,
                packing: bool = False) -> WorstBatch:
    """The worst batch of `batch_size` the sampler can form from examples of `lengths` tokens (module docstring).

    Args:
        lengths: token lengths (after truncation).
        batch_size: the per-device batch size.
        padding: the collator's padding, `longest` or `max_length`.
        max_length: the truncation / padding length, or None.
        pad_to_multiple_of: the collator's `pad_to_multiple_of`, or None.
        group_by_length: TrainingArguments.group_by_length (the worst batch comes first).
        packing: TRL SFT packing into packs of `max_length` tokens.
    """
    if not lengths:
        raise MemfitError("the data holds no examples; give a file with at least one example")
    if isinstance(batch_size, bool) or batch_size < 1:
        raise MemfitError(f"batch size `{batch_size}` must be a whole number >= 1")
    if packing:
        if max_length is None:
            raise MemfitError("packing needs a max_length (the pack size); pass --max-length N")
        total = sum(lengths)
        packs = math.ceil(total / max_length)
        rows = min(batch_size, packs)
        per_row = max_length if packs > 1 else total
        return WorstBatch(rows, per_row, None, max(lengths),
                          f"{rows} pack(s) of {per_row} tokens ({total} tokens in all packed into {packs} pack(s) "
                          f"of {max_length})")
    longest_index = max(range(len(lengths)), key=lambda i: lengths[i])
    longest = lengths[longest_index]
    rows = min(batch_size, len(lengths))
    per_row = padded_length(longest, padding=padding, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
    how = (f"padded to {per_row} (max_length)" if padding == "max_length" else
           f"padded to {per_row}" + (f" (the longest, {longest}, up to a multiple of {pad_to_multiple_of})"
                                     if per_row != longest else " (the longest)"))
    where = ("the first batch (group_by_length puts the longest first)" if group_by_length else
             "any batch the random sampler puts it in")
    return WorstBatch(rows, per_row, longest_index, longest,
                      f"{rows} examples {how}: the batch holding example {longest_index + 1} ({longest} tokens), "
                      f"{where}")


def data_lengths(lengths: Sequence[int], batch_size: int, *, truncated: int = 0, **collator: Any) -> DataLengths:
    """The data set's lengths and its worst batch (`collator`: worst_batch's keyword arguments)."""
    worst = worst_batch(lengths, batch_size, **collator)
    return DataLengths(len(lengths), tuple(lengths), truncated, min(lengths), statistics.median(lengths),
                       max(lengths), worst)
