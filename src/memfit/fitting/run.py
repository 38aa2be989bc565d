"""`memfit.fit(trainer)`: train a real `transformers.Trainer` so that it fits, and recover when it does not.

    import memfit
    report = memfit.fit(trainer, gpu="auto")
    print(report.steps_completed, report.oom_recoveries)

1. `preflight` (memfit.fitting.preflight_check): the setup of the trainer, the estimate, the traps.
2. When a GPU (or an emulated budget) is known and the setup does not fit, memfit's plan
   (memfit.planner.search) is applied to `trainer.args` before training: micro-batch / accumulation,
   fp16/bf16 (CUDA only), optimizer, eval batch size / eval_accumulation_steps, gradient
   checkpointing (Hugging Face's, or memfit's per-block wrapper where the model has none).
3. Training runs with recovery (memfit.fitting.recovery): an OOM inside a micro-step splits the
   micro-batch into chunks and recomputes the accumulation window, without losing an
   optimizer step or changing the effective batch size; an OOM in evaluation lowers the eval
   batch size and reruns the evaluation. Checkpoints are written atomically
   (memfit.fitting._trainer); an OOM in a checkpoint save retries it once with the weights
   copied to the CPU, else skips that checkpoint, and an OOM in load-best-model copies the
   best weights, read on the CPU, into the model in place, else keeps the last weights
   (memfit.fitting.saving). An OOM in the optimizer step is undone (host copy of parameters and
   state, or proof that nothing changed) and retried per parameter where foreach
   temporaries were the cause, or, at the first step, with a smaller optimizer
   (memfit.fitting.optimizer_step).
4. Measured per-phase peaks (torch.cuda's, or the memory_budget's) are reported next to the
   prediction.
5. Each checkpoint carries the memory settings memfit changed; a resumed run re-applies them
   (memfit.fitting.resume), from the newest intact checkpoint (damaged ones are skipped and named).
6. Nothing of earlier runs is deleted: `save_total_limit` counts only this run's checkpoints, an
   earlier checkpoint of the same step is renamed `earlier-checkpoint-N` (memfit.fitting._trainer).
7. A run that fails part-way still writes its report (`status`, `error`: type, message, phase,
   steps completed, last checkpoint) before the error propagates; SIGINT / SIGTERM finish the
   optimizer step, save a checkpoint, write the report and raise `FitInterrupted` (exit status
   130 / 143; memfit.fitting.interrupt).

Multi-process runs: every rank applies rank 0's plan and the largest chunk count at each
optimizer step; with DDP, gradients are averaged by memfit after each accumulation window so
that a rank that recovers never leaves the others waiting in a collective, and a rank that
fails for good makes the others stop (memfit.fitting.distributed). Under DeepSpeed and FSDP2 the preflight is
rank 0's estimate of the trainer's own parallel settings, no one-GPU plan is applied, and the ranks vote after
each chunk's forward and split together, the engine's accumulation boundary kept on the last chunk
(memfit.fitting.engines). Not coordinated: retries of a checkpoint save or load-best-model on one rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from memfit.errors import MemfitError
from memfit.files import write_json_atomic
from memfit.trace import FINAL_EVAL, OPTIMIZER, RL_PHASES, RUN_PHASES, TRAINING
from memfit.fitting.preflight_check import (PreflightFlag, PreflightReport, check_budget, check_budget_covers_model,
                                     check_trainer, preflight)
from memfit.gpus.catalog import as_gpu_spec
from memfit.fitting.recovery import OOM_FRAGMENTS, ChunkedTrainingStep, Meter, Recovery, guard_evaluation, is_oom_error
from memfit.fitting.saving import guard_saving

logger = logging.getLogger("memfit.fit")

__all__ = ["fit", "FitReport", "preflight", "PreflightReport", "PreflightFlag", "is_oom_error", "OOM_FRAGMENTS",
           "apply_plan", "steps_expected", "write_report", "failure_record"]


@dataclass
class FitReport:
    steps_completed: int
    steps_expected: int
    effective_batch_size: int
    oom_recoveries: list[dict[str, Any]]
    plan_applied: dict[str, Any] | None
    changes: list[str]
    phases: dict[str, dict[str, int | None]]  #: phase -> predicted_bytes, measured_bytes
    train_metrics: dict[str, Any]
    final_metrics: dict[str, Any]
    preflight: dict[str, Any]
    micro_batch_chunks: int
    elapsed_s: float
    measured_with: str | None  #: "cuda", "memory_budget" or None
    report_path: str | None = None
    notes: list[str] = field(default_factory=list)
    #: measured / predicted - 1 per phase (positive: memfit under-predicted)
    prediction_error: dict[str, float] = field(default_factory=dict)
    #: safety margin for the next plan of this run: max(margin, worst under-prediction + 2%)
    suggested_margin: float | None = None
    #: "completed", "failed" (see `error`) or "interrupted" (SIGINT / SIGTERM: see `interrupted`)
    status: str = "completed"
    #: a failed run: {"type", "message", "phase", "steps_completed", "last_checkpoint"} (`failure_record`)
    error: dict[str, Any] | None = None
    #: the signal that stopped the run after saving a checkpoint ("SIGINT", "SIGTERM"), else None
    interrupted: str | None = None
    #: the checkpoint folders this run wrote and kept, oldest first
    checkpoints: list[str] = field(default_factory=list)
    #: GRPO / RLOO: generation_batch_size, steps_per_generation, num_generations, generation_calls_per_batch,
    #: scoring_batch_size, generate_calls (memfit.fitting.grpo_recovery); distillation the same but scoring's
    #: (memfit.fitting.distill_recovery); None for other trainers
    rl: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["schema"] = "memfit.fit/1"
        return out


def steps_expected(trainer: Any) -> int:
    """Optimizer steps `trainer.train()` will take (transformers 5's own arithmetic)."""
    args = trainer.args
    if args.max_steps and args.max_steps > 0:
        return int(args.max_steps)
    from memfit.sim._trl_adapter import trainer_kind

    if trainer_kind(trainer) in ("grpo", "rloo", "distill"):
        # GRPOTrainer's (and RLOOTrainer's) dataloader yields each generation batch steps_per_generation x
        # num_iterations times (grpo_trainer.py / rloo_trainer.py `get_train_dataloader`, RepeatSampler), and
        # DistillationTrainer's gradient_accumulation_steps times (distillation_trainer.py `_get_train_sampler`): its
        # length is the micro-steps of an epoch
        batches = len(trainer.get_train_dataloader())
        per_epoch = max(batches // args.gradient_accumulation_steps + int(batches % args.gradient_accumulation_steps > 0), 1)
        return int(math.ceil(args.num_train_epochs * per_epoch))
    n = len(trainer.train_dataset)
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    n = -(-n // world) if world > 1 else n  # each rank's share (DistributedSampler / accelerate's even batches)
    batches = math.ceil(n / args.train_batch_size) if not args.dataloader_drop_last else n // args.train_batch_size
    per_epoch = max(batches // args.gradient_accumulation_steps + int(batches % args.gradient_accumulation_steps > 0), 1)
    return int(math.ceil(args.num_train_epochs * per_epoch))


def apply_plan(trainer: Any, setup_changes: dict[str, Any], log: list[str]) -> dict[str, Any]:
    """Apply a plan's TrainSetup changes to a Trainer before `train()`. Returns what was applied.

    Each change goes to the remedy that owns its field (memfit.remedies: `fields`,
    `apply_to_trainer`); a change whose remedy has no `apply_to_trainer` (it changes the training
    method, or needs code the user writes) is logged, not applied.
    """
    from memfit.fitting import _trainer as adapter
    from memfit.remedies import remedy_for_field

    applied: dict[str, Any] = {}
    for key, value in setup_changes.items():
        remedy = remedy_for_field(key)
        if remedy is None or remedy.apply_to_trainer is None:
            log.append(f"{key}={value!r} not applied automatically (changes the training method); see `memfit plan`")
            continue
        applied.update(remedy.apply_to_trainer(trainer, {key: value}, log, adapter))
    return applied


def _make_callback(meter: Meter, step: Any = None, optimizer_guard: Any = None):
    from transformers import TrainerCallback

    from memfit.fitting.distributed import agree_max

    class _PhaseMeter(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if step is not None:  # a recovery on any rank splits micro-batches on every rank
                step.chunks = agree_max(step.chunks)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if optimizer_guard is not None:  # the optimizer exists from here on
                optimizer_guard.install()
            meter.reset()

        def on_evaluate(self, args, state, control, **kwargs):
            if optimizer_guard is not None:  # memory layout changed: keep a host copy at the next step
                optimizer_guard.evaluated = True

        def on_optimizer_step(self, args, state, control, **kwargs):
            meter.record(OPTIMIZER)

    return _PhaseMeter()


def fit(trainer: Any, *, gpu: Any = None, budget_bytes: int | str | None = None, plan: bool = True,
        max_recoveries: int = 4, report_path: str | None = None, progress: Any = None,
        margin: float | None = None, optimizer_snapshot: str = "auto",
        allow_optimizer_switch: bool = True, resume_from_checkpoint: Any = None) -> FitReport:
    """Preflight, plan, train with OOM recovery and report (see the module docstring).

    Args:
        trainer: a `transformers.Trainer`, not yet trained.
        gpu: catalog name, size, `auto` or GpuSpec for the estimate and plan (None: `auto` on a
            CUDA machine, else unknown).
        budget_bytes: run under `memfit.testing.memory_budget` (an emulated GPU of that size on the
            CPU; bytes or a size such as "800MiB").
        plan: apply memfit's plan when the setup is predicted not to fit.
        max_recoveries: how many times each guard (micro-step, evaluation, optimizer step) may recover.
        report_path: write the report as JSON there.
        progress: an optional TrainerCallback (e.g. the CLI's progress bar).
        margin: the planner's safety margin; pass a previous report's `suggested_margin` to feed the
            observed prediction error back into the next plan.
        optimizer_snapshot: when to keep a host copy of the parameters and optimizer state before an
            optimizer step, so that a step that runs out of memory after modifying them can be undone
            and retried (memfit.fitting.optimizer_step): "auto" (first step, and the first after an
            evaluation or a recovery), "always" or "never".
        allow_optimizer_switch: when the optimizer state does not fit at the first step, replace the
            optimizer by one with a smaller state (8-bit AdamW / Adafactor) instead of stopping.
        resume_from_checkpoint: a checkpoint folder, or True for the newest intact one in output_dir;
            passed to `trainer.train`, after the memory settings memfit saved with that checkpoint
            (memfit.fitting.resume) are applied to the trainer.

    Raises `FitInterrupted` (a SystemExit: 130 / 143) after SIGINT / SIGTERM, once the checkpoint
    and the report are written; any other error after training started is re-raised after the
    report is written, with the report as `error.memfit_report`.
    """
    import torch

    budget_bytes = _check_inputs(budget_bytes=budget_bytes, max_recoveries=max_recoveries, margin=margin,
                                 optimizer_snapshot=optimizer_snapshot, plan=plan,
                                 allow_optimizer_switch=allow_optimizer_switch,
                                 resume_from_checkpoint=resume_from_checkpoint)
    check_trainer(trainer)
    as_gpu_spec(gpu)  # a clear error for a bad gpu before anything runs
    check_budget_covers_model(trainer.model, budget_bytes)
    started = time.perf_counter()
    log = _RunLog()
    if gpu is None and budget_bytes is None and torch.cuda.is_available():
        gpu = "auto"
    resumed = _resume_state(trainer, resume_from_checkpoint, log)
    planned = _preflight_and_plan(trainer, gpu=gpu, budget_bytes=budget_bytes, plan=plan, margin=margin,
                                  memfit_checkpointing=resumed.memfit_checkpointing, log=log)
    run = _Run(planned.pre, planned.plan_applied, steps_expected(trainer),
               trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps,
               margin, started, report_path, log)
    guards = _install_guards(trainer, budget_bytes=budget_bytes, max_recoveries=max_recoveries,
                             optimizer_snapshot=optimizer_snapshot, allow_optimizer_switch=allow_optimizer_switch,
                             progress=progress, saved=resumed.saved,
                             memfit_checkpointing=planned.memfit_checkpointing, log=log)
    outcome = _train(trainer, guards, run, resume_dir=resumed.checkpoint_dir)
    return _finish(trainer, guards, run, outcome)


@dataclass
class _RunLog:
    """What `fit` changed on the trainer and what it noticed (each also logged as a warning)."""

    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def change(self, text: str) -> None:
        logger.warning("memfit: %s", text)
        self.changes.append(text)

    def note(self, text: str) -> None:
        logger.warning("memfit: %s", text)
        self.notes.append(text)


@dataclass(frozen=True)
class _Resumed:
    """Where the run resumes, and the memory settings memfit saved with that checkpoint."""

    checkpoint_dir: str | None  #: passed to `trainer.train(resume_from_checkpoint=...)`
    saved: dict[str, Any] | None  #: memfit.fitting.resume.read_state of it
    memfit_checkpointing: bool  #: memfit's per-block checkpointing was re-enabled from it


def _resume_state(trainer: Any, resume_from_checkpoint: Any, log: _RunLog) -> _Resumed:
    """Choose the checkpoint to resume from (damaged ones skipped and named) and re-apply its memory settings."""
    from memfit.fitting import resume as fit_resume

    choice = fit_resume.resolve_checkpoint(trainer, resume_from_checkpoint)
    resume_dir = choice.path if choice else None
    if choice:
        for folder, why in choice.skipped:
            log.note(f"resume: {folder} skipped ({why}); resuming from {resume_dir}, the newest intact checkpoint")
        for line in choice.notes:
            log.note(f"resume: {line}")
    saved = fit_resume.read_state(resume_dir) if resume_dir else None
    memfit_checkpointing = False
    if saved:
        resumed_log: list[str] = []
        restored = apply_plan(trainer, fit_resume.changes_to_apply(trainer, saved), resumed_log)
        memfit_checkpointing = bool(restored.get("gradient_checkpointing")) and not trainer.args.gradient_checkpointing
        for line in resumed_log:
            log.change(f"resume from {resume_dir}: {line}")
    return _Resumed(resume_dir, saved, memfit_checkpointing)


@dataclass(frozen=True)
class _Planned:
    """The preflight the run trains with, and the plan applied before it."""

    pre: PreflightReport  #: of the trainer as it trains (after the plan, when one was applied)
    plan_applied: dict[str, Any] | None  #: FitReport.plan_applied
    memfit_checkpointing: bool  #: memfit's per-block checkpointing is on (resumed or planned)


def _preflight_and_plan(trainer: Any, *, gpu: Any, budget_bytes: int | None, plan: bool, margin: float | None,
                        memfit_checkpointing: bool, log: _RunLog) -> _Planned:
    """Preflight the trainer; when it is predicted not to fit (and `plan`), apply rank 0's plan and preflight again.

    Args:
        trainer: the Trainer.
        gpu: the GPU to plan for (`fit`'s, after `auto`).
        budget_bytes: the emulated budget, or None.
        plan: apply memfit's plan when the setup is predicted not to fit.
        margin: the planner's safety margin (None: its default).
        memfit_checkpointing: memfit's per-block checkpointing is already on (resumed).
        log: where the changes and notes go.
    """
    pre = preflight(trainer, gpu=gpu, budget_bytes=budget_bytes)
    for f in pre.flags:
        logger.warning("memfit preflight: %s (fix: %s)", f.text, f.fix)
    if not (plan and pre.fits is False):
        return _Planned(pre, None, memfit_checkpointing)
    if pre.parallel is not None:  # memfit's plan is a one-GPU plan; not applied to a sharded run
        log.note(f"the setup is predicted not to fit per rank under {pre.parallel.strategy}; memfit.fit does not "
                 "apply a plan to a DeepSpeed / FSDP2 run (`memfit plan` across GPUs gives one); training with recovery")
        return _Planned(pre, None, memfit_checkpointing)
    spec = pre.estimate.gpu
    chosen = _agreed_plan(trainer, pre, gpu=gpu, budget_bytes=budget_bytes, margin=margin)
    if chosen.setup_changes is None:
        log.notes.append("the setup is predicted not to fit and memfit's plan found nothing that fits; "
                         "training as is, with recovery")
        return _Planned(pre, None, memfit_checkpointing)
    applied_log: list[str] = []
    applied = apply_plan(trainer, chosen.setup_changes, applied_log)
    for line in applied_log:
        log.change(f"plan: {line}")
    memfit_checkpointing |= bool(applied.get("gradient_checkpointing")) and not trainer.args.gradient_checkpointing
    plan_applied = {"remedies": chosen.plan.remedies if chosen.plan else [], "setup_changes": applied,
                    "predicted_peak_allocated_bytes": chosen.plan.peak_allocated_bytes if chosen.plan else None,
                    "gpu": spec["name"] if spec else None}
    if applied:
        pre = preflight(trainer, gpu=gpu, budget_bytes=budget_bytes)
    return _Planned(pre, plan_applied, memfit_checkpointing)


class _AgreedPlan(NamedTuple):
    """The plan every rank applies: rank 0's changes, and this rank's own chosen plan (None where it has none)."""

    setup_changes: dict[str, Any] | None  #: None: nothing fits (on rank 0)
    plan: Any  #: memfit.planner.search.Plan or None


def _agreed_plan(trainer: Any, pre: PreflightReport, *, gpu: Any, budget_bytes: int | None,
                 margin: float | None) -> _AgreedPlan:
    """memfit's plan for the preflight's setup (without mixed precision off CUDA); every rank takes rank 0's."""
    import torch

    from memfit.fitting import _trainer as adapter
    from memfit.planner.search import plan as make_plan

    with adapter.preserve_accelerator_state():
        result = make_plan(pre.setup, gpu=_spec_for(gpu, budget_bytes),
                           non_pytorch_bytes=0 if budget_bytes is not None and gpu is None else None,
                           # apply_plan applies mixed precision only on CUDA: do not plan on it elsewhere
                           exclude=() if torch.cuda.is_available() else ("mixed_precision",),
                           workers=1,  # plan speed: never fork the training process (memfit.planner.workers)
                           **({} if margin is None else {"margin": margin}))
    from memfit.fitting.distributed import agree

    # every rank applies rank 0's plan
    chosen_changes = agree(result.plans[result.chosen].setup_changes if result.chosen is not None else None)
    return _AgreedPlan(chosen_changes, result.plans[result.chosen] if result.chosen is not None else None)


@dataclass(frozen=True)
class _Run:
    """What the report of a run says about its start."""

    pre: PreflightReport
    plan_applied: dict[str, Any] | None
    steps_expected: int
    effective_batch_size: int  #: at the start (after the plan)
    margin: float | None
    started: float  #: time.perf_counter() at the start
    report_path: str | None
    log: _RunLog


@dataclass(frozen=True)
class _Guards:
    """Everything `fit` installs on the trainer for one run, and the emulated budget it trains under."""

    budget: Any  #: memory_budget context, or None
    meter: Meter
    recoveries: list[Recovery]
    step: ChunkedTrainingStep
    optimizer_guard: Any  #: memfit.fitting.optimizer_step.OptimizerStepGuard
    undo_eval: Callable[[], None]
    undo_save: Callable[[], None]
    undo_state_file: Callable[[], None]
    callback: Any
    signals: Any  #: memfit.fitting.interrupt.stop_on_signals()
    stop: Any
    progress: Any

    def remove(self, trainer: Any, *, finished: bool) -> None:
        """Undo everything `fit` installed on the trainer; give `save_total_limit` back (`end_checkpoint_run`)."""
        from memfit.fitting import _trainer as adapter

        self.step.uninstall()
        self.optimizer_guard.uninstall()
        self.undo_eval()
        self.undo_save()
        self.undo_state_file()
        adapter.end_checkpoint_run(trainer, finished=finished)
        for cb in (self.callback, self.stop, self.progress):
            if cb is not None:
                trainer.remove_callback(cb)


def _install_guards(trainer: Any, *, budget_bytes: int | None, max_recoveries: int, optimizer_snapshot: str,
                    allow_optimizer_switch: bool, progress: Any, saved: dict[str, Any] | None,
                    memfit_checkpointing: bool, log: _RunLog) -> _Guards:
    """Install the recovery guards, atomic checkpoints, the memory settings saved with each checkpoint, the
    callbacks and the signal handlers (in this order: each wraps what the one before installed).

    Args:
        trainer: the Trainer.
        budget_bytes: the emulated budget, or None.
        max_recoveries: per guard.
        optimizer_snapshot: memfit.fitting.optimizer_step's policy.
        allow_optimizer_switch: the optimizer guard may switch to a smaller optimizer.
        progress: an optional TrainerCallback.
        saved: the memory settings of the checkpoint the run resumes from.
        memfit_checkpointing: memfit's per-block checkpointing is on (saved with each checkpoint).
        log: where the changes and notes go.
    """
    from memfit.fitting import _trainer as adapter
    from memfit.fitting import interrupt
    from memfit.fitting import resume as fit_resume
    from memfit.fitting.optimizer_step import MODES, OptimizerStepGuard

    budget = None
    if budget_bytes is not None:
        from memfit.testing import memory_budget

        from memfit.sim._trl_adapter import grpo_reward_models

        ref = getattr(trainer, "ref_model", None)  # TRL: DPOTrainer's / GRPOTrainer's reference copy is on the GPU too
        rewards = tuple(m for _, m, _ in grpo_reward_models(trainer))  # and GRPOTrainer's reward models
        teacher = getattr(trainer, "teacher_model", None)  # and DistillationTrainer's teacher
        budget = memory_budget(budget_bytes, count=(trainer.model,) + ((ref,) if ref is not None else ()) + rewards
                               + ((teacher,) if teacher is not None else ()))
    meter = Meter(budget)
    recoveries: list[Recovery] = []
    from memfit.sim._trl_adapter import trainer_kind

    kind = trainer_kind(trainer)
    if kind in ("grpo", "rloo"):  # generation, scoring and RL micro-batches (memfit.fitting.grpo_recovery)
        from memfit.fitting.grpo_recovery import GrpoTrainingStep
        from memfit.fitting.rloo_recovery import RlooTrainingStep

        step = (GrpoTrainingStep if kind == "grpo" else RlooTrainingStep)(
            trainer, max_recoveries=max_recoveries, meter=meter, recoveries=recoveries, on_change=log.change,
            on_note=log.note)
    elif kind == "distill":  # on-policy generation and distillation micro-batches (memfit.fitting.distill_recovery)
        from memfit.fitting.distill_recovery import DistillTrainingStep

        step = DistillTrainingStep(trainer, max_recoveries=max_recoveries, meter=meter, recoveries=recoveries,
                                   on_change=log.change, on_note=log.note)
    else:
        step = ChunkedTrainingStep(trainer, max_recoveries=max_recoveries, meter=meter, recoveries=recoveries,
                                   on_change=log.change)
    optimizer_guard = OptimizerStepGuard(trainer, meter=meter, recoveries=recoveries, on_change=log.change,
                                         snapshot=optimizer_snapshot, max_recoveries=max_recoveries,
                                         allow_optimizer_switch=allow_optimizer_switch)
    undo_eval = guard_evaluation(trainer, max_recoveries=max_recoveries, meter=meter, recoveries=recoveries,
                                 on_change=log.change)
    for folder in adapter.clean_staging(trainer.args.output_dir):
        log.note(f"removed {folder}, a half-written checkpoint memfit's staging left behind")
    adapter.install_atomic_checkpoints(trainer)
    _note_checkpoint_policy(trainer, log.note)
    if saved:
        step.chunks = max(1, int(saved.get("micro_batch_chunks", 1)))
        if saved.get("optimizer_step_mode") in MODES:
            optimizer_guard.mode = saved["optimizer_step_mode"]
    undo_state_file = adapter.add_checkpoint_file(trainer, lambda folder: fit_resume.write_state(
        folder, fit_resume.run_state(trainer, micro_batch_chunks=step.chunks, optimizer_step_mode=optimizer_guard.mode,
                                     memfit_checkpointing=memfit_checkpointing)))
    undo_save = guard_saving(trainer, meter=meter, recoveries=recoveries, on_change=log.change)
    callback = _make_callback(meter, step, optimizer_guard)
    signals = interrupt.stop_on_signals()
    stop = interrupt.stop_callback(signals)
    for cb in (callback, stop) + ((progress,) if progress is not None else ()):
        trainer.add_callback(cb)
    return _Guards(budget, meter, recoveries, step, optimizer_guard, undo_eval, undo_save, undo_state_file,
                   callback, signals, stop, progress)


@dataclass
class _Outcome:
    """How far training got (filled in as it goes, so that a failure's report says it)."""

    phase: str = TRAINING  #: memfit.trace.TRAINING, then FINAL_EVAL
    finished: bool = False  #: `trainer.train` returned
    train_metrics: dict[str, Any] = field(default_factory=dict)
    final_metrics: dict[str, Any] = field(default_factory=dict)


def _train(trainer: Any, guards: _Guards, run: _Run, *, resume_dir: str | None) -> _Outcome:
    """Train (and evaluate at the end, unless a signal stopped the run) under the signal handlers and the
    budget; on any error, remove the guards, write the report and re-raise."""
    outcome = _Outcome()
    try:
        with guards.signals, (guards.budget if guards.budget is not None else contextlib.nullcontext()):
            out = trainer.train(resume_from_checkpoint=resume_dir)
            outcome.finished = True
            outcome.train_metrics = dict(out.metrics)
            outcome.phase = FINAL_EVAL
            if trainer.eval_dataset is not None and guards.signals.received is None:
                outcome.final_metrics = dict(trainer.evaluate())
    except BaseException as exc:
        _report_failure(exc, trainer, guards, run, outcome)
        raise
    return outcome


def _report_failure(exc: BaseException, trainer: Any, guards: _Guards, run: _Run, outcome: _Outcome) -> None:
    """Log an unrecoverable OOM's diagnosis, remove the guards and attach (and write) the failed run's report."""
    from memfit.fitting import _trainer as adapter

    if is_oom_error(exc):
        from memfit.diagnosis import diagnose

        d = diagnose(exc)
        logger.error("memfit: unrecoverable out-of-memory error in the %s phase: %s", d.phase,
                     d.causes[0].text if d.causes else exc)
    error = failure_record(exc, phase=outcome.phase, step=int(trainer.state.global_step),
                           checkpoints=adapter.run_checkpoints(trainer))
    with contextlib.suppress(Exception):  # neither the cleanup nor the report may hide the error itself
        guards.remove(trainer, finished=False)
    with contextlib.suppress(Exception):
        report = _report(trainer, run, guards, outcome, error=error)
        if run.report_path:
            write_report(report, run.report_path)
            exc.add_note(f"memfit: the report of this run ({report.status}) is in {run.report_path}")
        exc.memfit_report = report  # type: ignore[attr-defined]  (read by `memfit train`)
    if getattr(exc, "abort_peers", False):  # an OOM between an engine's all-gathers (fitting/engines.py)
        from memfit.fitting.engines import abort_peers

        abort_peers()  # after the report: the peers see an error instead of waiting (gloo), or time out (NCCL)


def _finish(trainer: Any, guards: _Guards, run: _Run, outcome: _Outcome) -> FitReport:
    """Remove the guards, write the report; after a signal raise `FitInterrupted` with it, else return it."""
    from memfit.fitting import _trainer as adapter
    from memfit.fitting import interrupt

    # after a signal the newest checkpoint is where the run resumes: not removed by the save_total_limit=1 rule
    guards.remove(trainer, finished=outcome.finished and guards.signals.received is None)
    report = _report(trainer, run, guards, outcome, error=None)
    if run.report_path:
        try:
            write_report(report, run.report_path)
        except OSError as exc:  # the run itself succeeded: say so instead of losing its result
            run.log.note(f"the report could not be written to {run.report_path} ({exc}); it is returned only")
    if guards.signals.received is not None:
        written = adapter.run_checkpoints(trainer)
        raise interrupt.FitInterrupted(guards.signals.signal_name, guards.signals.received, report,
                                       written[-1] if written else None)
    return report


def _note_checkpoint_policy(trainer: Any, note: Any) -> None:
    """Take save_total_limit over from Trainer (this run's checkpoints only) and say what is kept."""
    from memfit.fitting import _trainer as adapter
    from memfit.fitting.resume import numbered_checkpoints

    out = trainer.args.output_dir
    earlier = numbered_checkpoints(out) if os.path.isdir(out) else []
    limit = adapter.begin_checkpoint_run(trainer)
    saves = str(getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy)) != "no"
    names = ", ".join(os.path.basename(e) for e in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
    if limit is not None and limit > 0 and saves:
        note(f"save_total_limit={limit}: only the newest {limit} checkpoint(s) this run writes are kept"
             + (f"; the {len(earlier)} checkpoint(s) already in `{out}` ({names}) are never deleted" if earlier else ""))
    elif earlier and saves:
        note(f"`{out}` already holds {len(earlier)} checkpoint(s) ({names}); they are kept")


def failure_record(exc: BaseException, *, phase: str, step: int, checkpoints: list[str]) -> dict[str, Any]:
    """What the report says about a run that failed: error type and first line, phase, steps completed.

    Args:
        exc: the exception that ended the run.
        phase: where the caller was, one of memfit.trace.FAILURE_PHASES (TRAINING: inside `trainer.train`, then
            refined from the exception's traceback frames by memfit.diagnosis.phase, the table diagnose reads
            tracebacks with; FINAL_EVAL: the evaluation after it; FINAL_SAVE: `memfit train`'s save of the model).
        step: optimizer steps completed (`trainer.state.global_step`).
        checkpoints: the checkpoints this run wrote (the newest is where a resume starts).
    """
    from memfit.diagnosis.phase import phase_of_exception
    from memfit.trace import UNKNOWN

    message = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
    where = phase
    if phase == TRAINING:
        found = phase_of_exception(exc)
        where = found if found != UNKNOWN else phase
    return {"type": type(exc).__name__, "message": message, "phase": where, "steps_completed": step,
            "last_checkpoint": checkpoints[-1] if checkpoints else None}


def write_report(report: "FitReport", path: str) -> None:
    """Write the report as JSON (temporary file + rename: never half-written, never a torn earlier report)."""
    write_json_atomic(path, report.to_json(), indent=2, default=str)


def _report(trainer: Any, run: _Run, guards: _Guards, outcome: _Outcome, *,
            error: dict[str, Any] | None) -> "FitReport":
    """The FitReport of a run, finished or not.

    Args:
        trainer: the Trainer.
        run: the run's start (preflight, plan applied, steps expected, ...).
        guards: what `fit` installed (the meter, the recoveries, the chunked step, the signal handlers).
        outcome: how far training got.
        error: a failed run's `failure_record`, else None.
    """
    pre, meter, budget, step, effective = run.pre, guards.meter, guards.budget, guards.step, run.effective_batch_size
    effective_after = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
    notes = list(run.log.notes)
    if effective_after != effective:  # never expected: recovery keeps the effective batch size
        notes.append(f"effective batch size changed from {effective} to {effective_after}")
    predicted = dict(pre.estimate.phases)
    step_end = pre.estimate.phase_breakdowns.get(OPTIMIZER)
    if step_end:
        # Trainer saves (and loads the best model) after the step and zero_grad: weights and optimizer
        # state stay; safetensors copies to the host one tensor at a time and load_best copies in place
        resident = step_end.get("weights", 0) + step_end.get("optimizer_state", 0)
        if str(getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy)) != "no":
            predicted["save"] = resident
        if trainer.args.load_best_model_at_end:
            predicted["load_best"] = resident
    phases = {p: {"predicted_bytes": int(predicted.get(p, 0)) if predicted.get(p) is not None else None,
                  "measured_bytes": meter.peaks.get(p)}
              for p in RUN_PHASES + tuple(p for p in RL_PHASES if p in predicted)}
    from memfit.planner.search import DEFAULT_MARGIN

    # measured / predicted - 1 per phase; the worst under-prediction becomes the next run's margin
    errors = {p: round(v["measured_bytes"] / v["predicted_bytes"] - 1, 4) for p, v in phases.items()
              if v.get("measured_bytes") and v.get("predicted_bytes")}
    under = max([e for e in errors.values() if e > 0], default=0.0)
    suggested = round(min(0.45, max(DEFAULT_MARGIN if run.margin is None else run.margin, under + 0.02)), 3)
    from memfit.fitting import _trainer as adapter

    interrupted = guards.signals.signal_name
    for old, aside in adapter.set_aside_checkpoints(trainer):
        notes.append(f"{old} (written before this run) was renamed to {aside}: this run wrote a checkpoint "
                     "of the same step")
    return FitReport(
        prediction_error=errors, suggested_margin=suggested,
        steps_completed=int(trainer.state.global_step), steps_expected=run.steps_expected,
        effective_batch_size=effective_after, oom_recoveries=[dataclasses.asdict(r) for r in guards.recoveries],
        plan_applied=run.plan_applied, changes=run.log.changes, phases=phases, train_metrics=outcome.train_metrics,
        final_metrics=outcome.final_metrics, preflight=pre.to_json(), micro_batch_chunks=step.chunks,
        elapsed_s=round(time.perf_counter() - run.started, 2),
        measured_with="memory_budget" if budget is not None else ("cuda" if meter.cuda else None),
        report_path=run.report_path, notes=notes, error=error, interrupted=interrupted,
        status="failed" if error else ("interrupted" if interrupted else "completed"),
        checkpoints=adapter.run_checkpoints(trainer),
        rl=step.summary() if hasattr(step, "summary") else None)


def _check_inputs(*, budget_bytes: Any, max_recoveries: Any, margin: Any, optimizer_snapshot: Any, plan: Any,
                  allow_optimizer_switch: Any, resume_from_checkpoint: Any) -> int | None:
    """Clear errors for bad arguments of `fit`, before anything runs. Returns the budget in bytes."""
    import os

    from memfit.fitting.optimizer_step import SNAPSHOT_POLICIES

    budget_bytes = check_budget(budget_bytes)
    if isinstance(max_recoveries, bool) or not isinstance(max_recoveries, int) or max_recoveries < 0:
        raise MemfitError(f"max_recoveries `{max_recoveries!r}` is not a whole number >= 0; pass e.g. 4")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 <= margin < 0.5):
        raise MemfitError(f"margin `{margin!r}` must be between 0 and 0.5 (a fraction of the GPU kept free); "
                          "pass e.g. 0.1")
    if optimizer_snapshot not in SNAPSHOT_POLICIES:
        raise MemfitError(f"optimizer_snapshot `{optimizer_snapshot!r}` is not a policy; "
                          f"use one of {', '.join(SNAPSHOT_POLICIES)}")
    for name, value in (("plan", plan), ("allow_optimizer_switch", allow_optimizer_switch)):
        if not isinstance(value, bool):
            raise MemfitError(f"{name} `{value!r}` is not a bool; pass True or False")
    if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, (bool, str, os.PathLike)):
        raise MemfitError(f"resume_from_checkpoint `{resume_from_checkpoint!r}` is not a path or a bool; pass a "
                          "checkpoint-N folder, or True for the last one in output_dir")
    return budget_bytes


def _spec_for(gpu: Any, budget_bytes: int | None):
    if gpu is not None:
        return as_gpu_spec(gpu)
    from memfit.fitting.preflight_check import budget_spec

    return budget_spec(budget_bytes)
