"""Recovery from out-of-memory errors in checkpoint saves and load-best-model of a `transformers.Trainer`.

Checkpoint save (`Trainer._save_checkpoint`, atomic: memfit.fitting._trainer): on an OOM the
partial checkpoint is already removed; memory is freed and the save is retried once with the
model weights copied to the CPU, so `save_pretrained` (which may allocate on the GPU in
transformers 5: reverted weight conversions, contiguous copies) needs no GPU memory. When
the retry runs out of memory too, the checkpoint is skipped: no partial folder is left,
earlier checkpoints are intact, no training state is lost, and the next save tries again.

Load-best-model (`load_best_model_at_end`): on an OOM, memory is freed and the best
checkpoint's safetensors weights are read on the CPU and copied into the model's existing
tensors in place (no new GPU memory). When that fails too (out of memory, or a checkpoint
that does not map one to one onto the model's tensors, e.g. PEFT adapters), the last
weights are kept.

Both phases are measured (`Meter`: "save", "load_best"). Multi-process runs: a checkpoint
save is not retried (it runs collectives: Trainer's flos gather and barriers, memfit's
publishing barrier; a retry on one rank would not meet the others' calls); an OOM there is
raised as before, and the atomic staging keeps earlier checkpoints intact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from memfit.fitting import _trainer as adapter
from memfit.fitting import distributed as dist_sync
from memfit.fitting.recovery import Meter, Recovery, free_memory, is_oom_error, oom_cause

__all__ = ["guard_saving"]


class _NotLoadableInPlace(ValueError):
    """The best checkpoint's weights do not map one to one onto the model's tensors."""


def guard_saving(trainer: Any, *, meter: Meter, recoveries: list[Recovery],
                 on_change: Callable[[str], None]) -> Callable[[], None]:
    """Guard checkpoint saves and load-best-model against OOMs and measure them. Returns an undo.

    Installs memfit's atomic checkpoints first (idempotent): a retried save relies on the
    failed attempt having left nothing behind.
    """
    adapter.install_atomic_checkpoints(trainer)

    def note(phase: str, cause: str, tried: int | None, change: str) -> None:
        step = trainer.state.global_step
        recoveries.append(Recovery(step, phase, change, cause, tried))
        on_change(f"out of memory at optimizer step {step} ({phase}): {cause} -> {change}")

    def around_save(save: Callable[[bool], None]) -> None:
        meter.reset()
        if dist_sync.is_distributed():  # a save has collectives inside (Trainer's flos gather, barriers):
            save(False)  # a retry on one rank would not meet the others' calls, so it is not retried
            meter.record("save")
            return
        failure = _oom_of(save, False)
        if failure is not None:
            free_memory()
            note("save", *failure, _retry_save(save, trainer.state.global_step))
        meter.record("save")

    def around_load_best(load: Callable[[], None]) -> None:
        meter.reset()
        failure = _oom_of(load)
        if failure is not None:
            free_memory()
            note("load_best", *failure, _retry_load_best(trainer))
        meter.record("load_best")

    undo_save = adapter.wrap_checkpoint_save(trainer, around_save)
    undo_load = adapter.wrap_load_best_model(trainer, around_load_best)

    def undo() -> None:
        undo_load()
        undo_save()

    return undo


def _oom_of(call: Callable[..., None], *args: Any) -> tuple[str, int | None] | None:
    """Run `call(*args)`; None when it succeeds, (cause, bytes tried) on an OOM; other errors propagate.

    The error (and the tensors its traceback holds) is released before the caller retries.
    """
    try:
        call(*args)
        return None
    except Exception as exc:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
        if not is_oom_error(exc):
            raise
        return oom_cause(exc)


def _retry_save(save: Callable[[bool], None], step: int) -> str:
    """Save again with the weights copied to the CPU; skip the checkpoint when that runs out of memory too."""
    if _oom_of(save, True) is None:
        return f"checkpoint of step {step} saved on a retry with the model weights copied to the CPU"
    free_memory()
    return (f"checkpoint of step {step} skipped (out of memory again with the weights on the CPU): no partial "
            "folder left, earlier checkpoints intact, training continues and the next save tries again")


def _retry_load_best(trainer: Any) -> str:
    """Load the best weights on the CPU into the model in place; keep the last weights when that fails."""
    folder = adapter.best_model_checkpoint(trainer)
    try:
        weights = _read_weights(folder, trainer.model)
    except _NotLoadableInPlace as exc:
        return f"last weights kept: the best checkpoint {folder} cannot be loaded in place ({exc})"
    except Exception as exc:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
        if not is_oom_error(exc):
            raise
        return f"last weights kept: reading the best checkpoint {folder} on the CPU ran out of memory too"
    with torch.no_grad():
        for target, value in weights:
            target.data.copy_(value)
    return f"best checkpoint {folder} read on the CPU and copied into the model's tensors in place"


def _read_weights(folder: str, model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model tensor, CPU value in its dtype) for every state-dict tensor of `model`, read from `folder`.

    Everything is read and converted before anything is copied, so a failure here leaves the
    model's weights untouched.
    """
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        loaded.update(load_file(path, device="cpu"))
    targets = model.state_dict(keep_vars=True)
    covered = {targets[k].data_ptr() for k in loaded if k in targets}
    missing = [k for k, t in targets.items() if k not in loaded and t.data_ptr() not in covered]
    wrong = [k for k in loaded if k in targets and tuple(loaded[k].shape) != tuple(targets[k].shape)]
    if missing or wrong:
        raise _NotLoadableInPlace(f"{len(missing)} tensor(s) missing, e.g. {missing[:3]}; "
                                  f"{len(wrong)} of another shape, e.g. {wrong[:3]}")
    return [(targets[k], v.to(targets[k].dtype)) for k, v in loaded.items() if k in targets]


def _weight_files(folder: str) -> list[str]:
    """The safetensors weight files of a checkpoint folder: one file, or the shards of its index."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    single = os.path.join(folder, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(folder, name) for name in shards]
    raise _NotLoadableInPlace(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in it")
