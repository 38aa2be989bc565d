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
- `args.save_total_limit`: set to None while memfit trains, so that Trainer's own rotation
  (`rotate_checkpoints` in `_save_checkpoint`, and the end-of-training removal of every
  checkpoint but the best when the limit is 1, in `_inner_training_loop`) never deletes
  checkpoints of earlier runs; memfit applies the limit to this run's checkpoints
  (`begin_checkpoint_run`, `rotate_run_checkpoints`, `end_checkpoint_run`).
- `Trainer.is_deepspeed_enabled` / `is_fsdp_enabled`: checkpoints in another layout
  (`uses_sharded_checkpoints`).
- (transformers.integrations.deepspeed `_hf_deepspeed_config_weak_ref`, the live ZeRO config a DeepSpeed
  Trainer registers, is hidden by every meta model build: memfit.models.build.without_hf_deepspeed_config, re-exported here.)
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
from memfit.models.build import without_hf_deepspeed_config  # re-exported: moved to the model builds

logger = logging.getLogger("memfit.fit")

__all__ = ["inner_optimizer", "replace_inner_optimizer", "set_train_batch_size", "install_atomic_checkpoints", "loss_uses_num_items", "rebuild_accelerator",
           "STAGING_DIR", "clean_staging", "preserve_accelerator_state", "reset_eval_dataloaders",
           "wrap_checkpoint_save", "wrap_load_best_model", "best_model_checkpoint", "add_checkpoint_file",
           "STAGING_MARKER", "begin_checkpoint_run", "end_checkpoint_run", "run_checkpoints", "rotate_run_checkpoints",
           "set_aside_checkpoints", "uses_sharded_checkpoints", "without_hf_deepspeed_config"]

#: Folder inside output_dir where checkpoints are written before the rename into place.
STAGING_DIR = ".memfit-staging"


def uses_sharded_checkpoints(trainer: Any) -> bool:
    """True when DeepSpeed or FSDP writes the checkpoints (`Trainer.is_deepspeed_enabled` / `is_fsdp_enabled`):
    their weights and optimizer state are not the single-process files `resume.check_checkpoint` reads."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False))


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


#: File memfit writes into every staging folder it creates; `clean_staging` removes only folders holding it.
STAGING_MARKER = ".memfit-owned"


def _make_staging(path: str) -> None:
    """Create a staging folder and mark it as memfit's (see `clean_staging`)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, STAGING_MARKER), "a", encoding="utf-8"):
        pass


def clean_staging(run_dir: str) -> list[str]:
    """Remove staging folders a crashed save of memfit left half-written. Returns what was removed.

    Only folders under `run_dir/.memfit-staging/` that hold memfit's marker file are removed;
    anything else there (not written by memfit) is left alone, and so is the staging folder
    itself unless it is empty.
    """
    staging = os.path.join(run_dir, STAGING_DIR)
    removed: list[str] = []
    if not os.path.isdir(staging):
        return removed
    for name in sorted(os.listdir(staging)):
        folder = os.path.join(staging, name)
        if os.path.isdir(folder) and not os.path.islink(folder) and os.path.isfile(os.path.join(folder, STAGING_MARKER)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    try:
        os.rmdir(staging)  # only when empty
    except OSError:
        pass
    return removed


def _set_aside(path: str) -> str:
    """Rename a folder memfit must not delete to `earlier-<name>` (a name `get_last_checkpoint` and the
    rotation's `checkpoint-*` glob ignore). Returns the new path."""
    parent, name = os.path.split(path)
    target = os.path.join(parent, f"earlier-{name}")
    n = 2
    while os.path.exists(target):
        target = os.path.join(parent, f"earlier-{name}-{n}")
        n += 1
    os.replace(path, target)
    return target


def begin_checkpoint_run(trainer: Any) -> int | None:
    """Start a run's own checkpoint bookkeeping; take `save_total_limit` over from Trainer. Returns the limit.

    Trainer's rotation deletes the oldest `checkpoint-*` folders of output_dir, whoever wrote
    them: `rotate_checkpoints` in `Trainer._save_checkpoint`, and at the end of `train()` (with
    `save_total_limit == 1` and a best checkpoint) every checkpoint but the best
    (`Trainer._inner_training_loop`, transformers 5.24). memfit sets `args.save_total_limit` to
    None while training (`end_checkpoint_run` restores it) and applies the limit itself, to the
    checkpoints written in this run only (`rotate_run_checkpoints`).
    """
    limit = trainer.args.save_total_limit
    trainer.__dict__["_memfit_run"] = {"written": [], "limit": limit, "set_aside": []}
    trainer.args.save_total_limit = None
    return limit


def end_checkpoint_run(trainer: Any, *, finished: bool) -> None:
    """Restore `args.save_total_limit`; after a finished `train()`, Trainer's end-of-training rule on this run's
    checkpoints: with `save_total_limit == 1` and a best checkpoint, only the best one is kept."""
    run = trainer.__dict__.get("_memfit_run")
    if run is None:
        return
    trainer.args.save_total_limit = run["limit"]
    best = trainer.state.best_model_checkpoint
    if finished and run["limit"] == 1 and best is not None and trainer.args.should_save:
        for folder in list(run["written"]):
            if os.path.isdir(folder) and os.path.abspath(folder) != os.path.abspath(best):
                shutil.rmtree(folder, ignore_errors=True)
                run["written"].remove(folder)


def run_checkpoints(trainer: Any) -> list[str]:
    """The checkpoint folders written in this run (oldest first) that still exist."""
    run = trainer.__dict__.get("_memfit_run") or {"written": []}
    return [f for f in run["written"] if os.path.isdir(f)]


def set_aside_checkpoints(trainer: Any) -> list[tuple[str, str]]:
    """(old path, new path) of earlier checkpoints renamed because this run wrote a checkpoint of the same step."""
    run = trainer.__dict__.get("_memfit_run") or {"set_aside": []}
    return list(run["set_aside"])


def rotate_run_checkpoints(trainer: Any) -> list[str]:
    """`save_total_limit` applied to the checkpoints written in this run; returns the removed folders.

    As transformers' `rotate_checkpoints` (trainer_utils.py): the newest and the best checkpoint
    are kept, then the oldest are removed until `save_total_limit` are left. Checkpoints of
    earlier runs are never counted nor removed.
    """
    run = trainer.__dict__.get("_memfit_run")
    if run is None:
        return []
    limit = run["limit"]
    written = [f for f in run["written"] if os.path.isdir(f)]
    run["written"] = written
    if limit is None or limit <= 0 or len(written) <= limit:
        return []
    best = trainer.state.best_model_checkpoint
    protected = {os.path.abspath(written[-1])} | ({os.path.abspath(best)} if best else set())
    keep = max(limit, len([w for w in written if os.path.abspath(w) in protected]))
    removed = []
    for folder in list(written):
        if len(written) - len(removed) <= keep:
            break
        if os.path.abspath(folder) not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    run["written"] = [w for w in written if w not in removed]
    return removed


def install_atomic_checkpoints(trainer: Any, log: list[str] | None = None) -> None:
    """Make `Trainer._save_checkpoint` atomic: write into `output_dir/.memfit-staging/`, then rename.

    transformers 5 writes `checkpoint-N` in place (save_model, optimizer, scheduler, RNG,
    trainer_state.json one after the other), so a crash or a full disk mid-save leaves a
    `checkpoint-N` that `get_last_checkpoint` would pick up and fail to resume from. Here
    the whole checkpoint is written under the staging folder (a name `get_last_checkpoint`
    ignores) and moved into place with one `os.replace` once complete; a failure removes the
    partial folder, restores `state.best_model_checkpoint` (Trainer may have pointed it at the
    staged folder) and re-raises. A `checkpoint-N` that exists already is replaced only when
    this run wrote it; one of an earlier run is renamed `earlier-checkpoint-N`, never deleted.
    `save_total_limit` is applied after the rename, to this run's checkpoints only
    (`rotate_run_checkpoints`). Staging folders carry a marker file (`STAGING_MARKER`) so that
    `clean_staging` removes only what memfit created.

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
        _make_staging(staging_root)
        trainer._get_output_dir = lambda trial=None: staging_root
        saved_limit = trainer.args.save_total_limit
        trainer.args.save_total_limit = None  # rotation: memfit's own, after the rename (rotate_run_checkpoints)
        run = trainer.__dict__.setdefault("_memfit_run", {"written": [], "limit": saved_limit, "set_aside": []})
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
                if os.path.lexists(final):
                    if final in run["written"]:  # this run's own checkpoint of the same step: replace it
                        old = os.path.join(staging_root, f"old-{folder}")
                        os.replace(final, old)  # removed with the staging folder below
                        run["written"].remove(final)
                    else:  # an earlier run's (or a damaged one a resume skipped): never deleted, set aside
                        aside = _set_aside(final)
                        run["set_aside"].append((final, aside))
                        logger.warning("memfit: %s already existed (not written by this run): renamed to %s, "
                                       "and the new checkpoint of step %s written in its place", final, aside,
                                       trainer.state.global_step)
                os.replace(staged, final)
                run["written"].append(final)
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
            if run.get("limit") is None and saved_limit is not None:  # installed without begin_checkpoint_run
                run["limit"] = saved_limit
            rotate_run_checkpoints(trainer)
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


# -- the optimizer under accelerate's wrapper ---------------------------------------------------------------

def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's `AcceleratedOptimizer` (an Optimizer subclass whose
    `.optimizer` is the real one; accelerate/optimizer.py)."""
    import torch

    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def replace_inner_optimizer(trainer: Any, wrapped: Any, old: Any, new: Any) -> None:
    """Put `new` in place of `old` under accelerate's wrapper `wrapped` (its step, state and
    param_groups read `.optimizer`) and under the Trainer's LR scheduler (accelerate's
    `AcceleratedScheduler.scheduler.optimizer`), so both step the new optimizer."""
    wrapped.optimizer = new
    scheduler = getattr(trainer, "lr_scheduler", None)
    inner_scheduler = getattr(scheduler, "scheduler", scheduler)
    if getattr(inner_scheduler, "optimizer", None) is old:
        inner_scheduler.optimizer = new
