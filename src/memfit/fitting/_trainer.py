"""Every touch of `transformers.Trainer` internals (private attributes) memfit makes, in one place.

Checked against transformers 5.24 (trainer.py). If a future release renames any of these,
only this module changes:

- `Trainer._train_batch_size`: the train dataloader's batch size, copied from
  `args.train_batch_size` in `__init__`; must follow `per_device_train_batch_size` changes.
- `Trainer._save_checkpoint(model, trial)` and `Trainer._get_output_dir(trial)`: checkpoint
  saving, made atomic here (see `install_atomic_checkpoints`) and guarded against OOMs
  (`wrap_checkpoint_save`).
- `Trainer._save(output_dir, state_dict=None)`: writes the model weights of a checkpoint;
  given CPU copies of the weights on a save's retry (`wrap_checkpoint_save`).
- `Trainer._load_best_model()`: load_best_model_at_end's load, guarded against OOMs
  (`wrap_load_best_model`); `Trainer.state.best_model_checkpoint`: its folder, kept pointing
  at a checkpoint that exists (`install_atomic_checkpoints`, `best_model_checkpoint`).
- `Trainer.model_accepts_loss_kwargs`, `Trainer.compute_loss_func`: how the loss of a
  micro-batch is normalised (decides the weights of chunked micro-batches).
- accelerate's `AcceleratorState/PartialState/GradientState._shared_state`: restored after
  memfit's simulations (see `preserve_accelerator_state`).
- `Trainer._eval_dataloaders`: cached eval dataloaders, dropped after the eval batch size changes.
- `Trainer.create_accelerator_and_postprocess()`: rebuilds the Accelerator after a change of
  mixed precision (fp16/bf16) before training starts.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import uuid
from typing import Any, Callable

from memfit.fitting.distributed import is_distributed

logger = logging.getLogger("memfit.fit")

__all__ = ["set_train_batch_size", "install_atomic_checkpoints", "loss_uses_num_items", "rebuild_accelerator",
           "STAGING_DIR", "clean_staging", "preserve_accelerator_state", "reset_eval_dataloaders",
           "wrap_checkpoint_save", "wrap_load_best_model", "best_model_checkpoint", "add_checkpoint_file"]

#: Folder inside output_dir where checkpoints are written before the rename into place.
STAGING_DIR = ".memfit-staging"


def set_train_batch_size(trainer: Any, per_device: int) -> None:
    """Change the micro-batch size before `train()` builds its dataloader."""
    trainer.args.per_device_train_batch_size = int(per_device)
    trainer._train_batch_size = trainer.args.train_batch_size


@contextlib.contextmanager
def preserve_accelerator_state():
    """Keep accelerate's global state across memfit's simulations.

    Creating a `TrainingArguments` (the simulator builds one to make Trainer's optimizer)
    calls `AcceleratorState._reset_state()`, which empties the Borg dicts
    `AcceleratorState._shared_state` / `PartialState._shared_state` that the user's live
    Trainer's Accelerator reads; a following `trainer.train()` then fails with
    "AcceleratorState object has no attribute distributed_type". The dicts are restored here.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls, dict(cls._shared_state)) for cls in (AcceleratorState, PartialState, GradientState)]
    try:
        yield
    finally:
        for cls, state in saved:
            if state and not cls._shared_state:
                cls._shared_state.update(state)


def reset_eval_dataloaders(trainer: Any) -> None:
    """Drop cached eval dataloaders (`Trainer._eval_dataloaders`, kept with persistent workers)."""
    if hasattr(trainer, "_eval_dataloaders"):
        trainer._eval_dataloaders = {}


def rebuild_accelerator(trainer: Any) -> None:
    """Recreate the Accelerator so a changed fp16/bf16 takes effect (before `train()`)."""
    trainer.create_accelerator_and_postprocess()


def loss_uses_num_items(trainer: Any, model: Any, num_items_in_batch: Any) -> bool:
    """True when a micro-batch's loss is sum / num_items_in_batch (not a mean over the micro-batch).

    Trainer passes `num_items_in_batch` to models that accept **kwargs and to
    `compute_loss_func`; whether the model uses it is read from its forward's source: models
    that compute their loss with `self.loss_function(...)` (causal LMs, ...) normalise by it,
    models with an inline `CrossEntropyLoss()` (sequence classification heads) take the mean.
    """
    if num_items_in_batch is None:
        return False
    if getattr(trainer, "compute_loss_func", None) is not None:
        return True
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        return False
    base = getattr(model, "module", model)
    base = getattr(base, "base_model", base) if hasattr(base, "peft_config") else base
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return True
    return "loss_function" in source


def clean_staging(run_dir: str) -> None:
    """Remove checkpoints a crashed save left half-written in the staging folder."""
    staging = os.path.join(run_dir, STAGING_DIR)
    if os.path.isdir(staging):
        shutil.rmtree(staging, ignore_errors=True)


def install_atomic_checkpoints(trainer: Any, log: list[str] | None = None) -> None:
    """Make `Trainer._save_checkpoint` atomic: write into `output_dir/.memfit-staging/`, then rename.

    transformers 5 writes `checkpoint-N` in place (save_model, optimizer, scheduler, RNG,
    trainer_state.json one after the other), so a crash or a full disk mid-save leaves a
    `checkpoint-N` that `get_last_checkpoint` would pick up and fail to resume from. Here
    the whole checkpoint is written under the staging folder (a name `get_last_checkpoint`
    ignores) and moved into place with one `os.replace` once complete; a failure removes the
    partial folder, restores `state.best_model_checkpoint` (Trainer may have pointed it at the
    staged folder) and re-raises. Rotation (`save_total_limit`) runs on the real folder after
    the rename.

    Multi-process runs: every rank writes its part (its `rng_state_<rank>.pth`; the main
    process the rest) into one staging folder named after the step; after a barrier, only the
    process that saves (`args.should_save`) publishes it and removes the staging folder.
    """
    if getattr(trainer, "_memfit_atomic_checkpoints", False):
        return
    original_save = trainer._save_checkpoint
    original_output_dir = trainer._get_output_dir

    def _save_checkpoint(model, trial, *args, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = original_output_dir(trial=trial)
        distributed = is_distributed()
        publisher = bool(trainer.args.should_save)
        tag = f"step-{trainer.state.global_step}" if distributed else uuid.uuid4().hex[:8]  # shared by the ranks
        staging_root = os.path.join(run_dir, STAGING_DIR, tag)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        final = os.path.join(run_dir, folder)
        os.makedirs(staging_root, exist_ok=True)
        trainer._get_output_dir = lambda trial=None: staging_root
        saved_limit = trainer.args.save_total_limit
        trainer.args.save_total_limit = None  # rotate on the real folder, after the rename
        best_before = trainer.state.best_model_checkpoint
        try:
            original_save(model, trial, *args, **kwargs)
            if distributed:
                import torch.distributed as dist

                dist.barrier()  # every rank's files are in the staging folder before it is published
            staged = os.path.join(staging_root, folder)
            best = trainer.state.best_model_checkpoint
            if best and best.startswith(staging_root):
                trainer.state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(best, staging_root))
                if trainer.args.should_save and os.path.isdir(staged):
                    from transformers.trainer import TRAINER_STATE_NAME

                    trainer.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
            if os.path.isdir(staged) and publisher:
                for write in getattr(trainer, "_memfit_checkpoint_extras", ()):
                    write(staged)  # inside the staging folder: published with the checkpoint, atomically
            if os.path.isdir(staged) and (publisher or not distributed):
                if os.path.isdir(final):  # a checkpoint of the same step (resumed run): replace it
                    old = os.path.join(run_dir, STAGING_DIR, f"old-{uuid.uuid4().hex[:8]}")
                    os.replace(final, old)
                    os.replace(staged, final)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(staged, final)
        except BaseException:
            trainer.state.best_model_checkpoint = best_before  # not the staging folder about to be removed
            logger.warning("memfit: checkpoint save of step %s failed; the partial checkpoint was removed, "
                           "earlier checkpoints are intact", trainer.state.global_step)
            raise
        finally:
            trainer._get_output_dir = original_output_dir
            trainer.args.save_total_limit = saved_limit
            if publisher or not distributed:  # the other ranks may still be writing until the barrier
                shutil.rmtree(staging_root, ignore_errors=True)
                try:
                    os.rmdir(os.path.join(run_dir, STAGING_DIR))
                except OSError:
                    pass
        if trainer.args.should_save:
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir, save_total_limit=saved_limit,
                               best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
        if log is not None:
            log.append(f"checkpoint {final} written atomically")

    trainer._save_checkpoint = _save_checkpoint
    trainer._memfit_atomic_checkpoints = True


def _cpu_copies(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`.detach().cpu()` of every tensor; tensors that share a view (tied weights) share one copy."""
    import torch

    copies: dict[tuple, Any] = {}
    out = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride(), value.device)
            if key not in copies:
                copies[key] = value.detach().cpu()
            value = copies[key]
        out[name] = value
    return out


@contextlib.contextmanager
def _weights_from_cpu(trainer: Any):
    """While active, `Trainer._save` writes CPU copies of the weights (save_pretrained then needs no GPU memory)."""
    original = trainer._save

    def _save(output_dir=None, state_dict=None):
        weights = trainer.model.state_dict() if state_dict is None else state_dict
        original(output_dir, state_dict=_cpu_copies(weights))

    trainer._save = _save
    try:
        yield
    finally:
        trainer._save = original


def wrap_checkpoint_save(trainer: Any, around: Callable[[Callable[[bool], None]], None]) -> Callable[[], None]:
    """Route `Trainer._save_checkpoint` through `around(save)`. Returns an undo.

    `save(cpu_weights)` runs the checkpoint save as installed (atomic, when
    `install_atomic_checkpoints` ran first); with `cpu_weights` the model weights reach
    `Trainer._save` as CPU copies.
    """
    original = trainer._save_checkpoint

    def _save_checkpoint(model, trial, *args, **kwargs):
        def save(cpu_weights: bool) -> None:
            with _weights_from_cpu(trainer) if cpu_weights else contextlib.nullcontext():
                original(model, trial, *args, **kwargs)

        around(save)

    return _replace(trainer, "_save_checkpoint", _save_checkpoint)


def wrap_load_best_model(trainer: Any, around: Callable[[Callable[[], None]], None]) -> Callable[[], None]:
    """Route `Trainer._load_best_model` (load_best_model_at_end) through `around(load)`. Returns an undo."""
    original = trainer._load_best_model
    return _replace(trainer, "_load_best_model", lambda: around(original))


def best_model_checkpoint(trainer: Any) -> str | None:
    """The folder of the best checkpoint so far (`Trainer.state.best_model_checkpoint`)."""
    return trainer.state.best_model_checkpoint


def _replace(trainer: Any, name: str, new: Any) -> Callable[[], None]:
    """Set `trainer.<name>` to `new`; the returned undo puts the previous one back."""
    old = getattr(trainer, name)
    setattr(trainer, name, new)

    def undo() -> None:
        setattr(trainer, name, old)

    return undo


def add_checkpoint_file(trainer: Any, write: Callable[[str], None]) -> Callable[[], None]:
    """Call `write(folder)` for every checkpoint before it is published (atomic checkpoints). Returns an undo."""
    extras = trainer.__dict__.setdefault("_memfit_checkpoint_extras", [])
    extras.append(write)

    def undo() -> None:
        if write in extras:
            extras.remove(write)

    return undo
