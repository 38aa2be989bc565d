"""`memfit.MemfitCallback`: memfit inside an unchanged `trainer.train()`.

    from memfit import MemfitCallback
    trainer = SFTTrainer(..., callbacks=[MemfitCallback(gpu="auto")])   # any Trainer or TRL trainer
    trainer.train()

At `on_train_begin` it runs memfit's preflight (memfit.fitting.preflight_check) on the trainer's model,
arguments, training dataset and collator, and warns (`on_oom="warn"`) or raises a MemfitError
(`on_oom="stop"`) when the run is predicted not to fit. During training it records the measured peak
of each phase (micro-steps up to `on_pre_optimizer_step`, the optimizer step up to
`on_optimizer_step`, evaluation up to `on_evaluate`) with `torch.cuda.max_memory_allocated` when
CUDA is in use, or with a `memfit.testing.memory_budget` given as `measure=` (CPU runs, tests), and
writes the report (predicted vs measured per phase) with `memfit.files.write_json_atomic`.

What it cannot do that `memfit.fit(trainer)` does, and why:

- recover from an out-of-memory error: the error is raised inside `Trainer.training_step` and unwinds
  `trainer.train()`; callbacks are called between steps and never around one, so no callback can
  catch it, split the micro-batch, recompute the accumulation window or undo an optimizer step.
  `memfit.fit` owns the loop's `training_step` / `optimizer.step` and can.
- apply a plan: at `on_train_begin` the dataloader, the optimizer and accelerate's wrappers exist
  already, so changing the batch size, the precision or the optimizer there would not be honoured.
  The callback reports the problem (and `memfit plan` / `memfit.fit` give the change).
- stop before the first step via `control.should_training_stop`: Trainer reads it only after a step
  (trainer.py `_run_epoch`), which is the step that runs out of memory; so `on_oom="stop"` raises.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

from transformers import TrainerCallback

from memfit.errors import MemfitError
from memfit.trace import BACKWARD, EVAL, FORWARD, OPTIMIZER, RL_PHASES, TRAINING

__all__ = ["MemfitCallback", "ON_OOM"]

#: What the callback does when the run is predicted not to fit.
ON_OOM = ("warn", "stop")
_REPORT_NAME = "memfit-callback-report.json"


class _TrainerView:
    """What preflight reads from a trainer, from what a callback is given (callbacks get no trainer)."""

    def __init__(self, args: Any, model: Any, processing_class: Any, train_dataloader: Any, eval_dataloader: Any):
        self.args = args
        self.model = model
        self.processing_class = processing_class
        self.train_dataset = getattr(train_dataloader, "dataset", None)
        self.data_collator = getattr(train_dataloader, "collate_fn", None)
        self.eval_dataset = getattr(eval_dataloader, "dataset", None)
        # SFTTrainer: the collator holds the padding-free decision (bfd packing implies it)
        self.padding_free = bool(getattr(self.data_collator, "padding_free", getattr(args, "padding_free", False)))
        self.precompute_ref_logps = bool(getattr(args, "precompute_ref_log_probs", False))

    def train(self) -> None:  # pragma: no cover - preflight only checks that a trainer can train
        raise MemfitError("MemfitCallback's view of the trainer cannot train")


class MemfitCallback(TrainerCallback):
    """Preflight at `on_train_begin`, measured vs predicted peaks per phase, and the report.

    Args:
        gpu: the GPU to check against: a catalog name, a size, `auto` (the GPU in use; none on a CPU
            machine) or None (no fit verdict unless `budget_bytes` or `measure` give one).
        budget_bytes: an emulated GPU of that many bytes (an int or a size such as "800MiB").
        on_oom: `warn` (a warning, training goes on) or `stop` (a MemfitError from `on_train_begin`,
            before any step) when the run is predicted not to fit.
        report_path: where the JSON report goes; None: `<output_dir>/memfit-callback-report.json`.
        measure: a `memfit.testing.memory_budget` object whose peaks are measured (CPU runs); None:
            `torch.cuda.max_memory_allocated` when CUDA is available, else nothing is measured.
    """

    def __init__(self, gpu: Any = "auto", *, budget_bytes: int | str | None = None, on_oom: str = "warn",
                 report_path: str | os.PathLike | None = None, measure: Any = None) -> None:
        if on_oom not in ON_OOM:
            raise MemfitError(f"on_oom `{on_oom}` is not one of {', '.join(ON_OOM)}; `warn` warns, `stop` raises "
                              "before the first step")
        if measure is not None and not (hasattr(measure, "peak_bytes") and hasattr(measure, "reset_peak")):
            raise MemfitError(f"measure `{type(measure).__name__}` is not a memfit.testing.memory_budget; pass one, "
                              "or None to measure CUDA")
        self.gpu = gpu
        self.budget_bytes = budget_bytes
        self.on_oom = on_oom
        self.report_path = None if report_path is None else os.fspath(report_path)
        self.measure = measure
        self.preflight: Any = None
        self.measured: dict[str, int] = {}
        self.steps_measured = 0
        self.report: dict[str, Any] | None = None

    # -- measuring -----------------------------------------------------------------------
    def _peak(self) -> int | None:
        if self.measure is not None:
            return int(self.measure.peak_bytes)
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
        return None

    def _reset(self) -> None:
        if self.measure is not None:
            self.measure.reset_peak()
            return
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def _record(self, phase: str) -> None:
        peak = self._peak()
        if peak is not None:
            self.measured[phase] = max(self.measured.get(phase, 0), peak)

    # -- events --------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, train_dataloader=None,
                       eval_dataloader=None, **kwargs):
        from memfit.fitting.preflight_check import preflight

        view = _TrainerView(args, model, processing_class, train_dataloader, eval_dataloader)
        budget = self.budget_bytes
        gpu = self.gpu
        if budget is None and self.measure is not None and hasattr(self.measure, "limit_bytes"):
            budget, gpu = self.measure.limit_bytes, None  # the emulated GPU being measured
        if gpu == "auto":
            import torch

            # an emulated budget replaces `auto`; `auto` without CUDA has no GPU to check against
            gpu = "auto" if budget is None and torch.cuda.is_available() else None
        pause = self.measure.paused() if self.measure is not None else contextlib.nullcontext()
        with pause:  # the estimate's own CPU tensors are not the run's memory
            self.preflight = preflight(view, gpu, budget_bytes=budget)
        self._write(args, done=False)
        if self.preflight.fits is False:
            flag = next(f for f in self.preflight.flags if f.kind == "does_not_fit")
            text = f"memfit: {flag.text}; {flag.fix}"
            if self.on_oom == "stop":
                raise MemfitError(f"{text} (MemfitCallback(on_oom='stop') stopped before the first step)")
            warnings.warn(text, stacklevel=2)
        self._reset()

    def on_step_begin(self, args, state, control, **kwargs):
        self._reset()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._record(TRAINING)  # the micro-steps (forward, backward) and gradient clipping
        self._reset()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._record(OPTIMIZER)
        self.steps_measured += 1

    def on_step_end(self, args, state, control, **kwargs):
        self._reset()  # what follows (logging, evaluation) starts from the memory live now

    def on_evaluate(self, args, state, control, **kwargs):
        self._record(EVAL)

    def on_train_end(self, args, state, control, **kwargs):
        self._write(args, done=True)

    # -- the report ----------------------------------------------------------------------
    def _write(self, args: Any, *, done: bool) -> None:
        from memfit.files import write_json_atomic

        pre = self.preflight
        phases = dict(pre.estimate.phases) if pre is not None else {}
        # GRPO: generation and scoring run inside the micro-steps (GRPOTrainer._prepare_inputs)
        predicted = {TRAINING: max(phases.get(p, 0) for p in (FORWARD, BACKWARD) + RL_PHASES),
                     OPTIMIZER: phases.get(OPTIMIZER, 0), EVAL: phases.get(EVAL, 0)}
        self.report = {
            "finished": done,
            "trainer": pre.setup.trainer if pre is not None else None,
            "preflight": pre.to_json() if pre is not None else None,
            "predicted_peak_allocated_bytes_by_phase": predicted,
            "measured_peak_allocated_bytes_by_phase": dict(self.measured),
            "measured_by": ("memory_budget" if self.measure is not None else
                            "torch.cuda.max_memory_allocated" if self.measured else None),
            "optimizer_steps_measured": self.steps_measured,
            "notes": list(pre.estimate.notes) if pre is not None else [],
        }
        path = self.report_path or os.path.join(getattr(args, "output_dir", None) or ".", _REPORT_NAME)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomic(path, self.report, indent=2, default=str)

