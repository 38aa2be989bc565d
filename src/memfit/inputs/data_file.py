"""The rows of a data file: CSV, JSON (a list of objects, or `{"data": [...]}`), JSONL, or a folder written by
`datasets` (`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, read with `datasets.load_from_disk`; a
DatasetDict gives its `train` split). One reader for `memfit train --data` and `memfit estimate / plan --data`;
every bad input is a one-line MemfitError.

    rows = read_rows("src/memfit/data/sentiment.csv")       # [{"text": ..., "label": "0"}, ...]
    texts = read_texts("src/memfit/data/sentiment.csv", "text")
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any

from memfit.errors import MemfitError

__all__ = ["read_rows", "read_texts"]


def read_rows(path: str) -> list[dict[str, Any]]:
    """The examples of `path` as one dict per row (module docstring)."""
    if os.path.isdir(path):
        return _dataset_folder(path)
    if not os.path.isfile(path):
        raise MemfitError(f"data file `{path}` does not exist; pass a .csv, .json or .jsonl file (or a folder saved "
                          "by `datasets`) with --data")
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
    return rows


def _dataset_folder(path: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise MemfitError(f"`{path}` is a folder: reading a `datasets` folder needs the datasets package "
                          "(`pip install datasets`), or pass a .csv, .json or .jsonl file") from err
    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as err:
        raise MemfitError(f"`{path}` is a folder but not one `datasets.save_to_disk` wrote ({err}); pass a .csv, "
                          ".json or .jsonl file or such a folder") from err
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise MemfitError(f"the datasets folder `{path}` has no `train` split (splits: {', '.join(ds)}); save "
                              "the training split")
        ds = ds["train"]
    if len(ds) == 0:
        raise MemfitError(f"the datasets folder `{path}` has no examples; give one with at least one row")
    return ds.to_list()


def read_texts(path: str, column: str) -> list[str]:
    """The `column` text of every example of `path`; a missing column or an empty text is a MemfitError."""
    rows = read_rows(path)
    if column not in rows[0]:
        raise MemfitError(f"column `{column}` is not in `{path}` (columns: {', '.join(map(str, rows[0]))}); name the "
                          "text column with --text-column")
    texts = []
    for i, r in enumerate(rows, 1):
        text = r.get(column)
        if not isinstance(text, str) or not text.strip():
            raise MemfitError(f"example {i} of `{path}` has no text in column `{column}`; fill or remove it")
        texts.append(text)
    return texts
