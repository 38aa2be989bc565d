"""Are the files of a checkpoint (or a model directory) intact? Read their headers, never unpickle them.

What `Trainer.train(resume_from_checkpoint=...)` reads from a checkpoint folder (transformers
5.24, trainer.py), and what happens when it is missing or damaged:

- `trainer_state.json` (`TrainerState.load_from_json` in `train`): missing -> FileNotFoundError.
- the weights (`_load_from_checkpoint`): `model.safetensors`, `model.safetensors.index.json`
  with its shards, `pytorch_model.bin` (+ index) or PEFT's `adapter_model.safetensors/.bin`;
  none -> "Can't find a valid checkpoint"; a truncated safetensors file -> SafetensorError.
- `optimizer.pt` and `scheduler.pt` (`_load_optimizer_and_scheduler`): loaded only when both
  exist, so a missing one silently resumes with a fresh optimizer and learning-rate schedule.
- `rng_state.pth` (`_load_rng_state`): missing -> only an info log, the data order and dropout
  after the resume differ from an uninterrupted run.
- `scaler.pt` (`_load_scaler`, fp16 on CUDA): missing -> the loss scale restarts.

Safetensors files are checked by `safetensors.safe_open`, which parses the header and rejects
a file whose data does not cover the tensors' offsets ("incomplete metadata, file not fully
covered") without reading the weights. `torch.save` files are zip archives (PyTorch >= 1.6,
`torch/serialization.py` `_save` with `_use_new_zipfile_serialization=True`): their central
directory, at the end of the file, is read with `zipfile` (a truncated file has none), and
`<archive>/data.pkl` must be listed; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import zipfile

__all__ = ["safetensors_problem", "torch_file_problem", "weights_problem", "checkpoint_problems",
           "TRAINER_STATE_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SCALER_NAME", "RNG_STATE_NAME"]

# transformers/trainer.py (5.24): TRAINER_STATE_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME;
# "rng_state.pth" is written by Trainer._save_rng_state (rng_state_<rank>.pth with several processes)
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "rng_state.pth"

# transformers/utils/__init__.py (5.24): SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
# WEIGHTS_INDEX_NAME; peft's ADAPTER_SAFE_WEIGHTS_NAME / ADAPTER_WEIGHTS_NAME
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"
_BIN_WEIGHTS = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"
_ADAPTER_SAFE = "adapter_model.safetensors"
_ADAPTER_BIN = "adapter_model.bin"


def safetensors_problem(path: str) -> str | None:
    """None when `path` is a complete safetensors file, else what is wrong with it (header only)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"no {name}"
    if os.path.getsize(path) == 0:
        return f"{name} is empty (0 bytes)"
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            fh.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError and OSError: the file is damaged either way
        return f"{name} is damaged ({str(exc).splitlines()[0][:160]})"
    return None


def torch_file_problem(path: str) -> str | None:
    """None when `path` looks like a complete `torch.save` zip archive, else what is wrong (never unpickled)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"no {name}"
    size = os.path.getsize(path)
    if size == 0:
        return f"{name} is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{name} is damaged or truncated ({size} bytes; {exc})"
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return f"{name} is not a torch.save archive (no data.pkl in it)"
    return None


def weights_problem(folder: str) -> str | None:
    """None when `folder` holds complete model weights (one file or every shard of its index), else why not."""
    single_safe = os.path.join(folder, _SAFE_WEIGHTS)
    if os.path.isfile(single_safe):
        return safetensors_problem(single_safe)
    for index_name, check in ((_SAFE_INDEX, safetensors_problem), (_BIN_INDEX, torch_file_problem)):
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as fh:
                    shards = sorted(set(json.load(fh)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return f"{index_name} cannot be read ({type(exc).__name__}: {exc})"
            for shard in shards:
                problem = check(os.path.join(folder, shard))
                if problem:
                    return f"shard of {index_name}: {problem}"
            return None
    for name, check in ((_BIN_WEIGHTS, torch_file_problem), (_ADAPTER_SAFE, safetensors_problem),
                        (_ADAPTER_BIN, torch_file_problem)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return check(path)
    return f"no model weights ({_SAFE_WEIGHTS}, {_SAFE_INDEX} or {_BIN_WEIGHTS})"


def _trainer_state_problem(folder: str) -> str | None:
    path = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return f"no {TRAINER_STATE_NAME} (the step, epoch and schedule position would be lost)"
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"{TRAINER_STATE_NAME} cannot be read ({str(exc)[:120]})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{TRAINER_STATE_NAME} has no global_step"
    return None


def checkpoint_problems(folder: str, *, optimizer_state: bool = True,
                        rng_file: str = RNG_STATE_NAME) -> tuple[list[str], list[str]]:
    """(problems, notes) of a checkpoint folder: a problem makes resuming from it lose state or fail.

    Args:
        folder: the checkpoint-N folder.
        optimizer_state: check the single-process weights, optimizer and scheduler files (False
            for DeepSpeed / FSDP checkpoints, which keep them in their own layout).
        rng_file: the RNG state file this process reads (`rng_state_<rank>.pth` with several).

    Notes are what is lost without making the resume wrong (a missing RNG state file).
    """
    if not os.path.isdir(folder):
        return [f"`{folder}` is not a folder"], []
    if not os.listdir(folder):
        return ["empty folder"], []
    problems: list[str] = []
    notes: list[str] = []
    problem = _trainer_state_problem(folder)
    if problem:
        problems.append(problem)
    if optimizer_state:
        problem = weights_problem(folder)
        if problem:
            problems.append(problem)
        for name, what in ((OPTIMIZER_NAME, "optimizer state"), (SCHEDULER_NAME, "learning-rate schedule")):
            problem = torch_file_problem(os.path.join(folder, name))
            if problem:
                lost = f" (Trainer would resume with a fresh {what})" if problem.startswith("no ") else ""
                problems.append(problem + lost)
    for name, what in ((rng_file, "the random state (data order and dropout differ from an uninterrupted run)"),
                       (SCALER_NAME, "the fp16 loss scale")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            problem = torch_file_problem(path)
            if problem:
                problems.append(problem)
        elif name == rng_file:
            notes.append(f"{os.path.basename(folder)} has no {name}: {what} is not restored")
    return problems, notes
