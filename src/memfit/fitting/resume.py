"""What memfit changed in a run, saved with every checkpoint and re-applied when the run resumes.

Every checkpoint written under `memfit.fit` holds `memfit-state.json` (written inside the
staging folder, so it is published atomically with the checkpoint): the training arguments
memfit may have changed (by the plan or by a recovery: micro-batch and accumulation, eval
batch, mixed precision, gradient checkpointing, optimizer), the number of chunks micro-batches
run as, and the optimizer step mode. `fit(trainer, resume_from_checkpoint=...)` applies them
before `trainer.train(resume_from_checkpoint=...)`, so Trainer rebuilds the optimizer the
checkpoint's `optimizer.pt` belongs to (Adafactor's state does not load into AdamW), the
dataloader skips the right number of batches, and the first window after the resume does not
run out of memory again. A checkpoint without the file resumes with the trainer's arguments.

Which checkpoint (`resolve_checkpoint`): only an intact one (memfit.fitting.checkpoint_files);
with `resume_from_checkpoint=True` the newest intact `checkpoint-N`, the newer damaged ones
skipped and named with the reason, never a silent resume with lost optimizer state. "Newest" is
the one written last (`written_unix_s` in memfit's state file, which survives copies that reset
file times) when every candidate has that time: an output_dir can hold the larger-step
checkpoints of an earlier run that a new run (started without resuming) did not overwrite, and
resuming "the last run" means the new one. Otherwise it is the largest step, as Trainer's
`get_last_checkpoint` chooses. When the two orders differ, the choice is said.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.files import write_json_atomic

__all__ = ["STATE_FILE", "SCHEMA", "run_state", "write_state", "read_state", "changes_to_apply",
           "resolve_checkpoint", "ResumeChoice", "checkpoint_problems", "numbered_checkpoints"]

STATE_FILE = "memfit-state.json"
SCHEMA = "memfit.fit-state/1"


def _optim_name(args: Any) -> str:
    return str(getattr(args.optim, "value", args.optim))


def run_state(trainer: Any, *, micro_batch_chunks: int, optimizer_step_mode: str,
              memfit_checkpointing: bool) -> dict[str, Any]:
    """The run's memory settings now (what a resume must reproduce)."""
    args = trainer.args
    return {
        "schema": SCHEMA,
        "step": int(trainer.state.global_step),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "per_device_eval_batch_size": int(args.per_device_eval_batch_size),
        "eval_accumulation_steps": args.eval_accumulation_steps,
        "optim": _optim_name(args),
        "precision": "fp16" if args.fp16 else ("bf16" if args.bf16 else "fp32"),
        "gradient_checkpointing": bool(args.gradient_checkpointing or memfit_checkpointing),
        "micro_batch_chunks": int(micro_batch_chunks),
        "optimizer_step_mode": optimizer_step_mode,
        "written_unix_s": time.time(),  #: orders checkpoints by when they were written (resolve_checkpoint)
    }


def write_state(folder: str, state: dict[str, Any]) -> None:
    """Write the state into a checkpoint folder (temporary file + rename: never half-written)."""
    write_json_atomic(os.path.join(folder, STATE_FILE), state, indent=2)


def read_state(folder: str) -> dict[str, Any] | None:
    """The state saved in a checkpoint folder, or None when it has none (not written by memfit.fit)."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MemfitError(f"the checkpoint's memfit state `{path}` cannot be read ({exc}); delete that file to "
                          "resume with the trainer's own arguments") from None
    if not isinstance(state, dict) or state.get("schema") != SCHEMA:
        raise MemfitError(f"the checkpoint's memfit state `{path}` is not a {SCHEMA} file; delete it to resume "
                          "with the trainer's own arguments")
    return state


def changes_to_apply(trainer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The saved settings that differ from the trainer's, as `fitting.apply_plan` changes."""
    now = run_state(trainer, micro_batch_chunks=1, optimizer_step_mode="", memfit_checkpointing=False)
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size",
            "eval_accumulation_steps", "optim", "precision")
    changes = {k: state[k] for k in keys if k in state and state[k] != now[k]}
    if state.get("gradient_checkpointing") and not now["gradient_checkpointing"]:
        changes["gradient_checkpointing"] = True
    return changes


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a run resumes from, and the newer ones skipped because they are damaged."""

    path: str
    skipped: tuple[tuple[str, str], ...] = ()  #: (checkpoint folder, why it was skipped), newest first
    notes: tuple[str, ...] = ()  #: state that is not restored (e.g. no RNG file)


def numbered_checkpoints(folder: str) -> list[str]:
    """checkpoint-N folders of `folder`, newest (largest N) first, as `get_last_checkpoint` names them."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # trainer_utils._re_checkpoint
    found = [(int(m.group(1)), name) for name in os.listdir(folder)
             if (m := pattern.match(name)) and os.path.isdir(os.path.join(folder, name))]
    return [os.path.join(folder, name) for _, name in sorted(found, reverse=True)]


def checkpoint_problems(trainer: Any, folder: str) -> tuple[list[str], list[str]]:
    """(problems, notes) of resuming `trainer` from `folder`: its Trainer files and memfit's state file."""
    from memfit.fitting import _trainer as adapter
    from memfit.fitting.checkpoint_files import RNG_STATE_NAME, checkpoint_problems as file_problems

    world = int(getattr(trainer.args, "world_size", 1) or 1)
    rng = f"rng_state_{trainer.args.process_index}.pth" if world > 1 else RNG_STATE_NAME
    problems, notes = file_problems(folder, optimizer_state=not adapter.uses_sharded_checkpoints(trainer),
                                    rng_file=rng)
    if problems == ["empty folder"]:
        return problems, notes
    try:
        read_state(folder)
    except MemfitError as exc:
        problems.append(str(exc).split(";")[0].replace("the checkpoint's memfit state", STATE_FILE))
    return problems, notes


def _written_at(folder: str) -> float | None:
    try:
        state = read_state(folder)
    except MemfitError:
        return None
    t = state.get("written_unix_s") if state else None
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def _newest_first(candidates: list[str]) -> tuple[list[str], str | None]:
    """`candidates` (largest step first) in the order they were written, newest first, and a note when that
    order puts another checkpoint first; the step order when any of them lacks memfit's write time."""
    times = [_written_at(c) for c in candidates]
    if len(candidates) < 2 or any(t is None for t in times):
        return candidates, None
    ordered = [c for _, c in sorted(zip(times, candidates), key=lambda tc: -tc[0])]
    if ordered[0] == candidates[0]:
        return ordered, None
    return ordered, (f"{os.path.basename(ordered[0])} was written after {os.path.basename(candidates[0])} (an "
                     f"earlier run's larger step): resuming the run written last; pass `{candidates[0]}` to "
                     "resume the other")


def resolve_checkpoint(trainer: Any, resume_from_checkpoint: Any) -> ResumeChoice | None:
    """The checkpoint `trainer.train(resume_from_checkpoint=...)` will resume from, checked.

    True: the newest intact `checkpoint-N` of output_dir; newer damaged ones are skipped and
    listed (`ResumeChoice.skipped`). A folder: that checkpoint, or a clear error when it is
    damaged. A checkpoint is damaged when resuming from it would fail or lose state
    (memfit.fitting.checkpoint_files): no or unreadable trainer_state.json, truncated weights,
    a missing optimizer.pt or scheduler.pt (Trainer would silently restart the optimizer), an
    unreadable memfit-state.json.
    """
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        out = trainer.args.output_dir
        candidates = numbered_checkpoints(out) if os.path.isdir(out) else []
        if not candidates:
            raise MemfitError(f"resume_from_checkpoint=True but output_dir `{out}` holds no checkpoint-N folder; "
                              "pass the checkpoint's path, or start without resuming")
        candidates, order_note = _newest_first(candidates)
        skipped: list[tuple[str, str]] = []
        for folder in candidates:
            problems, notes = checkpoint_problems(trainer, folder)
            if not problems:
                if order_note and folder == candidates[0]:
                    notes = [*notes, order_note]
                return ResumeChoice(folder, tuple(skipped), tuple(notes))
            skipped.append((folder, ", ".join(problems)))
        listed = "; ".join(f"{os.path.basename(f)}: {why}" for f, why in skipped)
        hint = (" (save_only_model=True checkpoints hold no optimizer state)"
                if getattr(trainer.args, "save_only_model", False) else "")
        raise MemfitError(f"no intact checkpoint to resume from in `{out}` ({listed}){hint}; start without "
                          "resuming, or pass a checkpoint folder explicitly")
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise MemfitError(f"resume_from_checkpoint `{path}` is not a folder; pass a checkpoint-N folder of an "
                          "earlier run (or True for the last one in output_dir)")
    problems, notes = checkpoint_problems(trainer, path)
    if problems:
        raise MemfitError(f"checkpoint `{path}` cannot be resumed without losing state: {', '.join(problems)}; "
                          "pass another checkpoint, or resume_from_checkpoint=True for the newest intact one")
    return ResumeChoice(path, (), tuple(notes))
