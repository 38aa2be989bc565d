"""The planner's predicted-memory model: what every candidate of `memfit.plan` would allocate,
fitted from a few cheap partial simulations (step 2 of memfit.planner.search).

- Optimizer state and the optimizer-step peak do not depend on precision, checkpointing or the
  micro-batch: they come from the baseline estimate and, per alternative optimizer, from one
  simulation of a training step at micro-batch 1 (`optimizer_costs`).
- Forward/backward peaks are linear in the micro-batch (activations are; weights, gradients and
  batch-independent buffers are constant). The setup's own precision / checkpointing is simulated
  at micro-batch 1 and 2, which gives the constant part; every other combination is simulated at
  micro-batch 2 only and shares that part. A combination that changes which parameters train
  (LoRA, frozen embeddings / blocks) is simulated at both with its optimizer (`linear_fits`).
- Evaluation is simulated at the setup's eval batch size and at 1 (`eval_fit`).

Internal to memfit.planner; the public face is `memfit.planner.search.plan`.

Known limitations: the fit is linear in the micro-batch (exact for activations, which dominate);
offload is modelled as "no optimizer state on the GPU".
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

from memfit import progress
from memfit.errors import MemfitError
from memfit.estimator import MemoryReport, estimate
from memfit.gpus.catalog import GpuSpec
from memfit.peaks import peaks
from memfit.sim.program import same_program
from memfit.trace import TRAIN_PHASES
from memfit.train_setup import TrainSetup

__all__ = ["TRAINABLE_KEYS", "WEIGHT_KEYS", "Budget", "Simulations", "PhasePeaks", "OptimizerCost", "LinearFit", "EvalFit",
           "EvalChoice", "TrainPeaks", "Axes", "MemoryModel", "fit_memory_model", "planned_simulations", "train_peaks",
           "eval_choice"]

def simulate(setup: TrainSetup, **kwargs: Any):
    """memfit.sim.engine.simulate, imported on first use: torch and transformers take seconds to import, which a
    plan read from memfit's cache does not need."""
    from memfit.sim.engine import simulate as run

    return run(setup, **kwargs)


#: TrainSetup fields that change which parameters train (their fits simulate the optimizer too)
TRAINABLE_KEYS = ("lora_r", "freeze_embeddings", "freeze_layers")
#: TrainSetup fields that change the weights' storage (their fits, too, share no constant part with the setup's)
WEIGHT_KEYS = ("load_in_4bit", "load_in_8bit")

#: a candidate: one variant dict per axis (memfit.remedies' `variants`), in the order of `Axes.combos`
Combo = tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Budget:
    """What the GPU leaves to the run: the budget with the safety margin, and how it splits."""

    spec: GpuSpec
    margin: float
    budget_bytes: int  #: the GPU's total less the margin
    outside_bytes: int  #: memory outside PyTorch (memfit's table, plus other processes on this machine)
    capacity_bytes: int  #: budget_bytes - outside_bytes: what PyTorch's allocator may use


class PhasePeaks(NamedTuple):
    """One simulation's per-phase peaks (memfit.peaks)."""

    peak_bytes: dict[str, int]  #: phase -> peak allocated bytes
    breakdown_bytes: dict[str, dict[str, int]]  #: phase -> category -> bytes at that peak
    sim: Any  #: the simulation (memfit.sim.engine.simulate): params, trainable_params


class _Counts(NamedTuple):
    """What a fit reads of a simulation besides its trace (memfit.sim.engine.Simulation's fields)."""

    params: int
    trainable_params: int
    paged_bytes: int = 0


def _phase_peaks_of(setup: TrainSetup, kwargs: dict[str, Any]) -> PhasePeaks:
    """One partial simulation's per-phase peaks, by value (picklable: a worker process returns it)."""
    sim = simulate(setup, **kwargs)
    tp = peaks(sim.trace)
    return PhasePeaks({p: pk.bytes for p, pk in tp.by_phase.items()},
                      {p: dict(pk.breakdown) for p, pk in tp.by_phase.items()},
                      _Counts(sim.params, sim.trainable_params, sim.paged_bytes))


def _estimate_of(setup: TrainSetup, budget: Budget, alloc_conf: str | None) -> MemoryReport:
    """A full estimate with the budget's capacity (a worker process returns it)."""
    return estimate(setup, gpu=budget.spec, alloc_conf=alloc_conf, non_pytorch_bytes=budget.outside_bytes,
                    capacity_bytes=budget.capacity_bytes)


def _reuse_candidate(setup: TrainSetup, kwargs: dict[str, Any], base: TrainSetup) -> bool:
    """What `Simulations._reused` can tell before the baseline ran: the request is the baseline's beginning."""
    return kwargs == {"optimizer_steps": 0} and setup.gradient_accumulation_steps == 2 and \
        base.gradient_accumulation_steps >= 2 and setup == base.replace(gradient_accumulation_steps=2,
                                                                        eval_strategy="no")


@dataclass
class Simulations:
    """Runs the planner's simulations and counts them (`PlanResult.simulations`).

    Simulations submitted ahead (`prefetch`, memfit.planner.workers: in worker processes) are read back when
    asked for in the same way, and counted then, as the serial path counts them: the result is the same.
    """

    count: int = 0
    #: the setup as it is and its full estimate (step 1), whose first micro-steps a fit may reuse (`_reused`)
    baseline: tuple[TrainSetup, MemoryReport] | None = None
    #: recording mode (`planned`): requests are noted, not run, and answered with zeros
    record_for: TrainSetup | None = None
    requests: list[tuple[TrainSetup, dict[str, Any]]] = dataclasses.field(default_factory=list)
    #: submitted ahead: (kind, setup, kwargs or (budget, alloc_conf), handle with .get())
    pending: list[tuple[str, TrainSetup, Any, Any]] = dataclasses.field(default_factory=list)
    ran_here: int = 0  #: simulations run in this process (not prefetched)
    #: the partial simulations answered so far: (setup, kwargs, result); an equal request is answered from them
    answered: list[tuple[TrainSetup, dict[str, Any], PhasePeaks]] = dataclasses.field(default_factory=list)
    #: how many simulations the search runs at most (memfit.progress's total); None: not counted
    expected: int | None = None

    def phase_peaks(self, setup: TrainSetup, **kwargs: Any) -> PhasePeaks:
        """Per-phase peaks of a partial simulation of `setup` (kwargs: memfit.sim.engine.simulate's).

        Evaluation runs only in an evaluation-only simulation (`train=False`)."""
        train = kwargs.get("train", True)
        setup = setup.replace(eval_strategy=setup.eval_strategy if not train else "no")
        if self.record_for is not None:
            if not _reuse_candidate(setup, kwargs, self.record_for) and \
                    not any(a == kwargs and same_program(s, setup) for s, a in self.requests):
                self.requests.append((setup, kwargs))
            return PhasePeaks({}, {}, _Counts(0, 0))
        reused = self._reused(setup, kwargs)
        if reused is not None:
            return reused
        done = next((r for s, a, r in self.answered if a == kwargs and same_program(s, setup)), None)
        if done is not None:  # the same program simulated for another combination (`same_program`)
            return done
        self._tell(setup, kwargs)
        result = self._take("phase_peaks", setup, kwargs)
        if result is None:
            self.ran_here += 1
            result = _phase_peaks_of(setup, kwargs)
        self.count += 1
        self.answered.append((setup, kwargs, result))
        return result

    def prefetch(self, pool: Any, kind: str, setup: TrainSetup, args: Any) -> None:
        """Submit a simulation to `pool` (memfit.planner.workers.WorkerPool) ahead of its request.

        Args:
            pool: where it runs.
            kind: "phase_peaks" (args: simulate's kwargs, the setup as `phase_peaks` passes it) or "estimate"
                (args: (budget, alloc_conf)).
            setup: the setup simulated.
            args: as `kind` says.
        """
        handle = pool.submit(_phase_peaks_of, setup, args) if kind == "phase_peaks" else \
            pool.submit(_estimate_of, setup, *args)
        self.pending.append((kind, setup, args, handle))

    def _take(self, kind: str, setup: TrainSetup, args: Any) -> Any:
        """The prefetched result of this request (raising what its simulation raised), or None."""
        for i, (k, s, a, handle) in enumerate(self.pending):
            if k == kind and a == args and s == setup:
                del self.pending[i]
                return handle.get()
        return None

    def _reused(self, setup: TrainSetup, kwargs: dict[str, Any]) -> PhasePeaks | None:
        """The peaks of `simulate(setup, optimizer_steps=0)` read from the baseline's trace, when that
        simulation is the baseline's beginning: the same setup but for accumulation (2 here, at least 2
        there: both simulate two micro-steps, each dividing the loss by it, memfit.sim.engine `run` and
        `micro_step`) and evaluation (which runs after the optimizer steps). Its events are then those of the
        baseline before the first optimizer-step event, less the cuBLAS workspaces `estimate` adds
        (memfit.estimator `_with_workspaces`). None otherwise. tests/planner/test_planner_reuse.py compares it with the
        simulation."""
        if self.baseline is None:
            return None
        base, report = self.baseline
        if not report.trace or not _reuse_candidate(setup, kwargs, base):
            return None
        events = []
        for ev in report.trace:
            if ev.phase == "optimizer":
                break
            if ev.category != "workspaces":
                events.append(ev)
        else:
            return None  # no optimizer step in the baseline: nothing marks where the micro-steps end
        tp = peaks(events)
        return PhasePeaks({p: pk.bytes for p, pk in tp.by_phase.items()},
                          {p: dict(pk.breakdown) for p, pk in tp.by_phase.items()},
                          _Counts(report.params, report.trainable_params))

    def estimate(self, setup: TrainSetup, budget: Budget, alloc_conf: str | None) -> MemoryReport:
        """A full estimate (simulation + allocator replay) of `setup` with the budget's capacity."""
        self._tell(setup, None)
        report = self._take("estimate", setup, (budget, alloc_conf))
        if report is None:
            self.ran_here += 1
            report = _estimate_of(setup, budget, alloc_conf)
        self.count += 1
        return report

    def _tell(self, setup: TrainSetup, kwargs: dict[str, Any] | None) -> None:
        """memfit.progress: which simulation runs now (kwargs None: a full estimate), after `count` of them."""
        bits = [setup.precision, f"batch {setup.per_device_train_batch_size}"]
        if setup.gradient_checkpointing:
            bits.append("checkpointing")
        bits.append(setup.optim)
        if setup.lora_r is not None:
            bits.append(f"LoRA r={setup.lora_r}" + (" 4-bit" if setup.load_in_4bit else ""))
        if kwargs is None:
            kind = "full estimate"
        elif kwargs.get("optimizer_only"):
            kind = "optimizer step"
        elif not kwargs.get("train", True):
            kind = f"evaluation, batch {setup.per_device_eval_batch_size}"
            bits = bits[:1]
        else:
            kind = "micro-steps"
        progress.report(f"{kind}: {', '.join(str(b) for b in bits)}", self.count, self.expected)


def planned_simulations(setup: TrainSetup, axes: Axes) -> list[tuple[TrainSetup, dict[str, Any]]]:
    """The partial simulations `fit_memory_model` will ask for (setup as `Simulations.phase_peaks` passes it,
    simulate's kwargs), in its order, found by running it with every answer zero; without the one the
    baseline's trace answers (`Simulations._reused`). A combination whose micro-batch-2 simulation fails is
    asked for at micro-batch 1 too (its request is then unused). Nothing is simulated."""
    rec = Simulations(record_for=setup)
    fit_memory_model(setup, _ZeroReport(), axes, rec)  # type: ignore[arg-type]
    return rec.requests


class _ZeroReport:
    """The baseline report `planned_simulations` hands `fit_memory_model`: only what `_optimizer_costs` reads."""

    phase_breakdowns: dict = {}
    phases: dict = {}
    paged_bytes = 0


@dataclass(frozen=True)
class OptimizerCost:
    """What an optimizer costs, whatever the precision, checkpointing or micro-batch."""

    state_bytes: int  #: its state (alive during the forward / backward of every step after the first)
    step_peak_bytes: int  #: the peak allocated in its step
    paged_bytes: int = 0  #: state in CUDA managed memory (bitsandbytes paged optimizers), not in the peaks


@dataclass(frozen=True)
class LinearFit:
    """Per-phase peak allocated bytes, linear in the micro-batch b: p1_bytes + slope_bytes * (b - 1)."""

    p1_bytes: dict[str, int]  #: phase -> peak at micro-batch 1
    slope_bytes: dict[str, int]  #: phase -> bytes per extra sample of the micro-batch
    state_bytes: int  #: optimizer state in the peaks (has_state only, else 0)
    params: int
    trainable_params: int
    has_state: bool = False  #: peaks include the optimizer state (LoRA / frozen embeddings fits)

    def at(self, micro_batch: int) -> dict[str, int]:
        """Phase -> predicted peak allocated bytes at this micro-batch."""
        return {k: self.p1_bytes[k] + self.slope_bytes[k] * (micro_batch - 1) for k in self.p1_bytes}


@dataclass(frozen=True)
class EvalFit:
    """The evaluation peak, linear in the eval batch size."""

    peak_bytes: int  #: at the setup's eval batch size, without optimizer state
    slope_bytes: float  #: bytes per sample of the eval batch
    outputs_bytes: int  #: accumulated eval outputs at that peak (freed by eval_accumulation_steps=1)


class TrainPeaks(NamedTuple):
    """A candidate's predicted training peaks."""

    phase_peak_bytes: dict[str, int]  #: forward / backward / optimizer -> peak allocated bytes
    state_bytes: int  #: optimizer state on the GPU (0 when offloaded)


class EvalChoice(NamedTuple):
    """The largest eval batch size (at most the setup's) whose predicted peak fits, and that peak."""

    peak_bytes: float
    changes: dict[str, Any]  #: TrainSetup changes of the eval settings (empty: as is)


@dataclass(frozen=True)
class Axes:
    """The search space: per remedy, the setup's own value first, then its variants (TrainSetup changes)."""

    precisions: list[dict[str, Any]]
    checkpointing: list[dict[str, Any]]
    optimizers: list[dict[str, Any]]
    lengths: list[dict[str, Any]]
    loras: list[dict[str, Any]]
    freezes: list[dict[str, Any]]
    offloads: list[dict[str, Any]]
    micro_batches: list[int]  #: divisors of the effective batch size
    #: kernels and weight storage (memfit.remedies attention, liger, qlora): the setup's own, then the leaner ones
    kernels: list[dict[str, Any]] = dataclasses.field(default_factory=lambda: [{}])
    #: the evaluation's `generate` (memfit.remedies fewer_beams, shorter_generation): the setup's own ({}), then
    #: the variants; they change the evaluation only, each gets its own `EvalFit`
    generations: list[dict[str, Any]] = dataclasses.field(default_factory=lambda: [{}])

    def memory_combos(self) -> Iterator[Combo]:
        """The combinations that change the forward / backward peaks (each gets a `LinearFit`)."""
        return itertools.product(self.precisions, self.checkpointing, self.lengths, self.loras, self.freezes,
                                 self.kernels)

    def combos(self) -> Iterator[Combo]:
        """Every combination: `memory_combos` x optimizers x offload (`optim` at index 6, offload at 7)."""
        return itertools.product(self.precisions, self.checkpointing, self.lengths, self.loras, self.freezes,
                                 self.kernels, self.optimizers, self.offloads)


def _combo_key(parts: Combo) -> tuple:
    """The `MemoryModel.fits` key of a memory combination: its merged changes, sorted."""
    return tuple(sorted({k: v for part in parts for k, v in part.items()}.items()))


@dataclass(frozen=True)
class MemoryModel:
    """The fitted model of every candidate's peaks."""

    optimizers: dict[str, OptimizerCost]  #: optim name -> its cost
    fits: dict[tuple, LinearFit]  #: memory combination (`_combo_key`) -> its fit
    eval_fit: EvalFit | None  #: None: the setup does not evaluate
    #: per generation variant of `Axes.generations` (its sorted items), its evaluation fit
    generation_fits: dict[tuple, EvalFit] = dataclasses.field(default_factory=dict)

    def eval_fit_for(self, generation: dict[str, Any]) -> EvalFit | None:
        """The evaluation fit of a generation variant ({}: the setup's own)."""
        return self.generation_fits[tuple(sorted(generation.items()))] if generation else self.eval_fit

    def fit_for(self, combo: Combo) -> LinearFit | None:
        """The fit of a full combination (`Axes.combos`): that of its memory part; None when that
        combination cannot run (its simulation refused it, e.g. FlashAttention in fp32)."""
        return self.fits.get(_combo_key(combo[:6]))


def fit_memory_model(setup: TrainSetup, base_report: MemoryReport, axes: Axes, sims: Simulations) -> MemoryModel:
    """Simulate what the model needs (optimizers, then training fits, then evaluation).

    Args:
        setup: the setup as it is (with the GPU's compute capability).
        base_report: its full estimate (the user's optimizer costs come from it).
        axes: the search space.
        sims: runs and counts the simulations.
    """
    eval_fit = _eval_fit(setup, sims)
    generation_fits = {tuple(sorted(g.items())): _eval_fit(setup.replace(**g), sims)
                       for g in axes.generations if g and eval_fit is not None}
    return MemoryModel(_optimizer_costs(setup, base_report, axes.optimizers, sims), _linear_fits(setup, axes, sims),
                       eval_fit, generation_fits)


def _optimizer_costs(setup: TrainSetup, base_report: MemoryReport, optimizers: list[dict[str, Any]],
                     sims: Simulations) -> dict[str, OptimizerCost]:
    """The user's optimizer from the baseline; each other one from one optimizer step at micro-batch 1."""
    base_state = base_report.phase_breakdowns.get("optimizer", {}).get("optimizer_state", 0)
    costs = {setup.optim: OptimizerCost(base_state, base_report.phases.get("optimizer", 0), base_report.paged_bytes)}
    for o in optimizers:
        if o["optim"] in costs:
            continue
        by, bd, sim = sims.phase_peaks(setup.replace(optim=o["optim"]), optimizer_steps=1, optimizer_only=True)
        costs[o["optim"]] = OptimizerCost(bd.get("optimizer", {}).get("optimizer_state", 0), by.get("optimizer", 0),
                                          getattr(sim, "paged_bytes", 0))
    return costs


def _linear_fits(setup: TrainSetup, axes: Axes, sims: Simulations) -> dict[tuple, LinearFit]:
    """Forward/backward peaks without optimizer state, per memory combination.

    The micro-steps of one optimizer step run with accumulation 2, so the second micro-step runs
    with live gradients. The setup's own combination (first of the product) gives the part that
    does not grow with the batch; a combination that keeps the trainable parameters shares it.
    """
    e = setup.effective_batch_size
    fits: dict[tuple, LinearFit] = {}
    const: dict[str, int] | None = None  #: phase -> bytes that do not grow with the micro-batch
    for combo in axes.memory_combos():
        changes = {k: v for part in combo for k, v in part.items() if getattr(setup, k) != v}
        method = any(k in changes for k in TRAINABLE_KEYS + WEIGHT_KEYS)
        steps = 2 if method else 0  # a changed set of trainable parameters: simulate its optimizer too
        try:
            s2 = setup.replace(**changes, per_device_train_batch_size=min(2, e), gradient_accumulation_steps=min(2, e))
            p2, bd2, sim = sims.phase_peaks(s2, optimizer_steps=steps)
        except MemfitError:
            if not changes:
                raise
            continue  # a combination that cannot run (FlashAttention with fp32, ...): no candidate
        keys = ("forward", "backward", "optimizer") if method else ("forward", "backward")
        # an effective batch of 1: s2 ran at micro-batch 1, the only one there is, so its peaks are the prediction
        if method or not changes or const is None or e == 1:
            p1 = sims.phase_peaks(s2.replace(per_device_train_batch_size=1), optimizer_steps=steps).peak_bytes \
                if e > 1 else p2
            slope = {k: p2.get(k, 0) - p1.get(k, 0) for k in keys}
            if not method and not changes:
                const = {k: p1.get(k, 0) - slope[k] for k in keys}
        else:
            slope = {k: (p2.get(k, 0) - const[k]) // 2 for k in keys}
            p1 = {k: const[k] + slope[k] for k in keys}
        state = bd2.get("optimizer", {}).get("optimizer_state", 0) if method else 0
        fits[_combo_key(combo)] = LinearFit({k: p1.get(k, 0) for k in keys}, slope, state, sim.params,
                                            sim.trainable_params, method)
    return fits


def _eval_fit(setup: TrainSetup, sims: Simulations) -> EvalFit | None:
    """Evaluation simulated at the setup's eval batch size and, when it is larger, at 1."""
    if not setup.does_eval:
        return None
    eb0 = setup.per_device_eval_batch_size
    e_a, bd_a, _ = sims.phase_peaks(setup, train=False)
    slope = 0
    if eb0 > 1:
        e_b = sims.phase_peaks(setup.replace(per_device_eval_batch_size=1), train=False).peak_bytes
        slope = (e_a.get("eval", 0) - e_b.get("eval", 0)) / (eb0 - 1)
    return EvalFit(e_a.get("eval", 0), slope, bd_a.get("eval", {}).get("eval_outputs", 0))


def train_peaks(model: MemoryModel, fit: LinearFit, optim: str, offload: bool, micro_batch: int) -> TrainPeaks:
    """A candidate's predicted forward / backward / optimizer peaks.

    Args:
        model: the fitted model.
        fit: the fit of the candidate's memory combination (`MemoryModel.fit_for`).
        optim: the candidate's optimizer (ignored where the fit has its own state).
        offload: the optimizer state is offloaded (not on the GPU).
        micro_batch: the candidate's per-device train batch size.
    """
    by = fit.at(micro_batch)
    if fit.has_state:
        state = fit.state_bytes
    else:
        cost = model.optimizers[optim]
        state = cost.state_bytes
        for ph in ("forward", "backward"):
            by[ph] += state  # the second optimizer step's micro-steps run with the state alive
        by["optimizer"] = cost.step_peak_bytes
    if offload:
        for ph in TRAIN_PHASES:
            by[ph] -= state
        state = 0
    return TrainPeaks(by, state)


def eval_choice(fit: EvalFit, state_bytes: int, eval_batch_size: int, micro_batch: int,
                fits: Callable[[float], bool]) -> EvalChoice:
    """The eval settings of a candidate: its eval batch size, else the train micro-batch or 1, else
    eval batch 1 with eval_accumulation_steps=1 (outputs moved to the CPU after each batch).

    Args:
        fit: the evaluation fit.
        state_bytes: optimizer state on the GPU during evaluation.
        eval_batch_size: the setup's per-device eval batch size.
        micro_batch: the candidate's per-device train batch size.
        fits: whether a peak allocated (bytes) fits the budget.
    """
    eval_peak = fit.peak_bytes + state_bytes
    for candidate_eb in sorted({eval_batch_size, micro_batch, 1}, reverse=True):
        if candidate_eb > eval_batch_size:
            continue
        pk = eval_peak - fit.slope_bytes * (eval_batch_size - candidate_eb)
        if fits(pk):
            return EvalChoice(pk, {} if candidate_eb == eval_batch_size
                              else {"per_device_eval_batch_size": candidate_eb})
    return EvalChoice(eval_peak - fit.slope_bytes * (eval_batch_size - 1) - fit.outputs_bytes,
                      {"per_device_eval_batch_size": 1, "eval_accumulation_steps": 1})
