"""`memfit.plan(setup, gpu=...) -> PlanResult`: the fastest configuration that fits.

The search never assumes what a remedy saves; every number comes from simulation:

1. Estimate the setup as it is (full simulation + allocator replay).
2. Fit how memory grows: for each combination of precision, checkpointing (and, when
   allowed, length / LoRA / frozen embeddings) simulate micro-batches 1 and 2 and take the
   per-phase peaks as linear in the micro-batch (activations are; states are constant).
   Each alternative optimizer is simulated once; its state difference shifts the
   forward/backward peaks and its own optimizer-step peak replaces the user's.
   Evaluation is simulated at two eval batch sizes.
3. Rank every combination (with the micro-batch split keeping the effective batch size
   exactly) that fits by the fitted model with the safety margin, by modelled step time
   (memfit.planner.throughput).
4. Verify the best with a full simulation and the allocator replay with the budget as the
   memory available to PyTorch (the GPU's total less the margin and the memory outside
   PyTorch; free-and-retry, OOM and the steady state of a long run modelled, memfit.allocator.bounded),
   including the allocator settings of memfit.remedies.allocator: a plan fits iff that
   replay does not run out of memory. The first verified plan that fits is chosen.

Every reserved figure of a plan is what the GPU's allocator reaches (at most the budget);
`headroom_bytes` is the budget minus what the plan needs, negative by as much as it is short.

`plan` reads as these steps; step 2 is memfit.planner.memory_model, step 3 memfit.planner.ranking.

Known limitations: the fit is linear in the micro-batch (exact for activations, which
dominate); what unverified plans need is scaled from the baseline's ratio of needed
(smallest capacity that completes, memfit.allocator.bounded.smallest_capacity) to allocated memory;
offload is modelled as "no optimizer state on the GPU".
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from memfit import progress
from memfit.allocator.conf import parse_alloc_conf
from memfit.errors import MemfitError
from memfit.estimator import MemoryReport
from memfit.gpus.catalog import CATALOG, GpuSpec, as_gpu_spec
from memfit.models.resolve import resolve
from memfit.remedies import OPT_IN, REGISTRY, conflict, implied_changes, remedy_id
from memfit.allocator.bounded import bounded_reserved
from memfit.planner.memory_model import Axes, Budget, Simulations, fit_memory_model, planned_simulations
from memfit.planner.ranking import Candidate, StepTimer, rank
from memfit.planner.throughput import paged_traffic_bytes
from memfit.planner.workers import WorkerPool, worker_count
from memfit.train_setup import GENERATING_TRAINERS, TrainSetup

if TYPE_CHECKING:
    from memfit.sim.media_dtypes import DtypeFix

__all__ = ["Plan", "PlanResult", "SearchedCandidate", "plan", "DEFAULT_MARGIN"]

#: Fraction of the GPU kept free: allocator and library behaviour we do not model
#: (cuDNN, NCCL, driver differences) and the error of the estimate itself.
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Plan:
    """One configuration: what to change, and what memfit predicts for it."""

    remedies: list[str]
    setup_changes: dict[str, Any]
    changes: dict[str, Any]  #: TrainingArguments kwargs to set
    env: dict[str, str]
    code: list[str]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    """What the GPU's allocator reaches with the budget available (until an OOM); fitted plans:
    the fitted need, at most the budget."""
    device_used_bytes: int  #: peak_reserved_bytes + memory outside PyTorch
    headroom_bytes: int  #: budget minus what the plan needs; negative: how much it is short
    relative_step_time: float
    fits: bool  #: verified: the replay with the budget does not run out of memory; fitted: need <= budget
    verified: bool  #: full simulation + allocator replay (else: fitted model)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SearchedCandidate:
    """One configuration the search weighed (memfit.planner.ranking.rank), as the fitted memory model of its partial
    simulations predicts it: the points of the plan page. The returned `Plan`s are the best of them, some verified."""

    setup_changes: dict[str, Any]  #: TrainSetup changes (only those that differ from the setup)
    need_bytes: int  #: predicted need on the GPU: peak allocated x the baseline's need ratio + memory outside PyTorch
    relative_step_time: float  #: modelled step time over the setup's
    fits: bool  #: need_bytes <= the budget


@dataclass(frozen=True)
class PlanResult:
    fits_as_is: bool
    baseline: Plan
    plans: list[Plan]
    chosen: int | None
    gpu: dict[str, Any]
    margin: float
    budget_bytes: int
    miss_bytes: int | None  #: when nothing fits: how far the closest plan is over the budget
    suggestions: list[str]
    not_applicable: dict[str, str]
    elapsed_s: float
    simulations: int
    cached: bool = False  #: read from memfit's cache (memfit.cache.plan_key): `simulations` ran before
    #: every configuration the search ranked, in ranking order (best first); empty for a plan searched otherwise
    searched: list[SearchedCandidate] = field(default_factory=list)
    config_class: str = "TrainingArguments"  #: the class whose kwargs `Plan.changes` are (`GRPOConfig` for GRPO)
    #: the change the search started from because the setup as given cannot run (memfit.sim.media_dtypes: 16-bit
    #: weights meeting float32 inputs without autocast): {"changes", "flags", "cause", "why"}; every plan and the
    #: baseline include it. None: the search started from the setup as given.
    started_from: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["schema"] = "memfit.plan/1"
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanResult:
        """The PlanResult `to_json` wrote (memfit's cache of plans)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in fields}
        kw["baseline"] = Plan(**kw["baseline"])
        kw["plans"] = [Plan(**p) for p in kw["plans"]]
        kw["searched"] = [SearchedCandidate(**c) for c in kw.get("searched", [])]
        return cls(**kw)


class GrpoParts(NamedTuple):
    """What memfit.planner.grpo_plan builds a GRPO PlanResult with: the result classes and the helpers here that
    describe a change and what a plan misses by (handed to it, so that it does not import this module)."""

    plan_cls: Any
    result_cls: Any
    describe: Any
    miss: Any


def _describe(base: TrainSetup, changes: dict[str, Any], checkpointing_kind: str | None):
    """Remedy names, TrainingArguments diff, env and code for a set of TrainSetup changes.

    Each changed field goes to the remedy that owns it (memfit.remedies, in REGISTRY's order),
    which says what the user changes (`Remedy.apply`).
    """
    args: dict[str, Any] = {}
    env: dict[str, str] = {}
    code: list[str] = []
    names: list[str] = []
    for remedy in REGISTRY.values():
        # alloc_conf (remedies.allocator) is no TrainSetup field: getattr with a default
        own = {k: changes[k] for k in remedy.fields if k in changes and changes[k] != getattr(base, k, None)}
        if not own or (remedy.owns is not None and not remedy.owns(own, base)):
            continue
        names.append(remedy.name)
        a, e, c = remedy.apply(own, base, kind=checkpointing_kind)
        args.update(a)
        env.update(e)
        code += c
    return names, args, env, code


def _plan_from_report(base, changes, report: MemoryReport, rel_time: float, budget: int, *, verified: bool,
                      alloc_conf: str | None = None, reserved: int | None = None) -> Plan:
    """A verified plan from an estimate replayed with the budget (`reserved`: from a replay with
    `alloc_conf` that completes)."""
    changes = dict(changes)
    if alloc_conf:
        changes["alloc_conf"] = alloc_conf
    names, args, env, code = _describe(base, changes, report.checkpointing)
    fits = report.fits is True if reserved is None else True
    reserved = report.peak_reserved_bytes if reserved is None else reserved
    used = reserved + report.non_pytorch_bytes
    short = report.shortfall_bytes if not fits else None
    headroom = -short if short is not None else budget - used
    return Plan(names, {k: v for k, v in changes.items() if k != "alloc_conf"}, args, env, code,
                report.peak_allocated_bytes, reserved, used, headroom, round(rel_time, 3),
                fits, verified, list(report.notes))


def _other_processes_bytes(spec: GpuSpec) -> int | None:
    """On a machine with this GPU: memfit's table for this process plus what other processes hold now (NVML).

    None (use memfit's table alone) without a GPU or without nvidia-ml-py.
    """
    import os

    import torch

    from memfit.gpus.outside_pytorch import gpu_processes

    if not torch.cuda.is_available():
        return None
    procs = gpu_processes()
    if procs is None:  # no NVML: nothing to count
        return None
    device = torch.cuda.current_device()
    others = sum(b for dev, pid, b in procs if dev == device and pid != os.getpid())
    from memfit.gpus.outside_pytorch import non_pytorch_bytes as table

    return table(spec).total_bytes + others


def plan(
    setup: TrainSetup | str,
    *,
    gpu: str | GpuSpec | None = None,
    allow: tuple[str, ...] | list[str] = (),
    margin: float = DEFAULT_MARGIN,
    alloc_conf: str | None = None,
    verify_top: int = 2,
    max_plans: int = 8,
    non_pytorch_bytes: int | None = None,
    exclude: tuple[str, ...] = (),
    cache: bool = False,
    workers: int | None = None,
) -> PlanResult:
    """Search the remedies for the fastest configuration of `setup` that fits `gpu`.

    Args:
        setup: a TrainSetup, or a model id (its defaults).
        gpu: catalog name, size (e.g. "24GiB"), "auto" or GpuSpec of the GPU to plan for.
        allow: opt-in remedies (memfit.remedies.OPT_IN: truncation, lora, qlora, freeze, offload) the search may
            use; `qlora` allows `lora` too.
        margin: fraction of the GPU kept free, in [0, 0.5).
        alloc_conf: the run's PYTORCH_CUDA_ALLOC_CONF, for every allocator replay.
        verify_top: how many of the best-ranked plans to verify by a full simulation before giving up.
        max_plans: how many plans to return (the verified ones and the best fitted ones).
        non_pytorch_bytes: memory outside PyTorch (None: memfit's table, plus what other processes
            hold on this machine's GPU when there is one, memfit.gpus.outside_pytorch).
        exclude: remedy names (memfit.remedies.REGISTRY) not to search, e.g. `("mixed_precision",)`
            when the run cannot use it (memfit.fit on the CPU).
        cache: read and write memfit's cache of plans (memfit.cache.plan_key; the CLI's default).
        workers: processes that run the independent simulations (memfit.planner.workers.worker_count; None:
            `MEMFIT_WORKERS`, else this process's CPUs where forking is safe; 1: all in this process). The
            result does not depend on it.
    """
    started = time.perf_counter()
    exclude = tuple(map(remedy_id, exclude))  # an earlier remedy name is accepted (memfit.remedies.ALIASES)
    allow = _check_options(margin=margin, allow=allow, exclude=exclude)
    setup = _as_setup(setup)
    if gpu is None:  # a GPU is what the plan is for (a MemfitError, not a TypeError on the missing keyword)
        raise MemfitError("plan() needs `gpu`; `None` is not a GPU: pass gpu=\"V100-16GB\", a size like "
                          "gpu=\"24GiB\", or gpu=\"auto\"")
    spec = as_gpu_spec(gpu, required=True)
    setup = setup.replace(compute_capability=tuple(spec.compute_capability))
    key = _cache_key(setup, gpu, spec, allow=allow, margin=margin, alloc_conf=alloc_conf, verify_top=verify_top,
                     max_plans=max_plans, non_pytorch_bytes=non_pytorch_bytes, exclude=exclude) if cache else None
    if key is not None:
        from memfit.cache import load_plan

        stored = load_plan(key)
        if stored is not None:
            try:
                hit = PlanResult.from_json(stored)
            except (TypeError, ValueError, KeyError):  # an entry of another shape: ignored, planned again
                hit = None
            if hit is not None:
                return dataclasses.replace(hit, cached=True, elapsed_s=round(time.perf_counter() - started, 2))
    budget = _budget_for(spec, margin, non_pytorch_bytes)
    from memfit.sim.media_dtypes import setup_dtype_fix  # imports torch: not on the warm (cached) path above

    typed, fix = setup, setup_dtype_fix(setup, spec.compute_capability)
    if fix is not None:  # the setup as given stops at its first convolution: plan from the change that runs
        setup = setup.replace(**fix.changes)
    if setup.trainer in GENERATING_TRAINERS:  # GRPO, RLOO: the generation batch and vLLM's share (grpo_plan)
        from memfit.planner.grpo_plan import plan_grpo

        # grpo_plan builds its plans with this module's classes and helpers, handed over (it imports nothing here)
        result = plan_grpo(setup, budget, allow=allow, exclude=exclude, alloc_conf=alloc_conf, max_plans=max_plans,
                           started=started, parts=GrpoParts(Plan, PlanResult, _describe, _miss))
        if key is not None:
            _store(key, result)
        return result
    n_workers = worker_count(workers)
    sims = Simulations()
    verdicts = {name: r.check(setup, spec) for name, r in REGISTRY.items()}
    axes = _candidate_axes(setup, spec, verdicts, allow=allow, exclude=exclude)
    planned = planned_simulations(setup, axes) if n_workers > 1 or progress.is_listening() else []
    # memfit.progress's total: the baseline, the partial simulations, the candidates verified at most
    sims.expected = 1 + len(planned) + verify_top if planned else None
    if n_workers == 1:
        planned = []  # counted, not prefetched
    if planned:  # the baseline and every partial simulation are known now: start them all
        _warm_up(sims, planned)
    with WorkerPool(n_workers if planned else 1) as pool:
        if pool.workers > 1:
            sims.prefetch(pool, "estimate", setup, (budget, alloc_conf))  # the longest first
            for s, kwargs in planned[1:]:
                sims.prefetch(pool, "phase_peaks", s, kwargs)
        base = _estimate_baseline(setup, budget, alloc_conf, sims)
        axes = dataclasses.replace(axes, generations=_generation_axis(setup, spec, base.report, verdicts, allow=allow,
                                                                      exclude=exclude))
        model = fit_memory_model(setup, base.report, axes, sims)
    ranked = rank(setup, axes, model, budget=budget, need_ratio=base.need_ratio, timer=base.timer,
                  base_time_s=base.step_time_s)
    # the candidates are verified one by one, here, after the workers are stopped: the first one usually fits, and
    # estimating the next ones ahead cost 2.4-2.7 s CPU more per seed plan for nothing (bench/README.md)
    verified = _verify(setup, ranked, base, budget, sims, alloc_conf=alloc_conf, verify_top=verify_top,
                       max_plans=max_plans)
    chosen = _choose(verified, base.plan)
    miss = _miss(base.plan, verified.plans, chosen, budget, verdicts, allow)
    result = PlanResult(
        fits_as_is=base.plan.fits, baseline=base.plan, plans=verified.plans, chosen=chosen,
        gpu={"name": spec.name, "total_bytes": spec.total_bytes}, margin=margin, budget_bytes=budget.budget_bytes,
        miss_bytes=miss.miss_bytes, suggestions=miss.suggestions,
        not_applicable={name: v.reason for name, v in verdicts.items()
                        if not v.applies and REGISTRY[name].serves(setup.trainer)},
        elapsed_s=round(time.perf_counter() - started, 2), simulations=sims.count,
        searched=[SearchedCandidate(c.changes, c.used_bytes, round(c.relative_step_time, 3), c.fits) for c in ranked],
    )
    if fix is not None:
        result = _started_from(typed, fix, result)
    if key is not None:
        _store(key, result)
    return result


def _started_from(typed: TrainSetup, fix: "DtypeFix", result: PlanResult) -> PlanResult:
    """`result`, searched from `typed` with `fix` applied, as a plan of `typed`: the fix is in the baseline and in
    every plan (its changes first), the setup as given does not fit (it does not run), and when no faster plan
    was chosen the fix alone is the chosen plan, where it fits."""
    names, args, env, code = _describe(typed, dict(fix.changes), None)
    if "weights_dtype" in fix.changes:  # no TrainingArguments field: how the model is loaded
        from memfit.train_setup import TASKS

        model = typed.model if isinstance(typed.model, str) else "..."
        code = [f"model = {TASKS[typed.task]}.from_pretrained({model!r}, dtype=torch.float32)  # not the "
                f"checkpoint's {fix.weights_dtype} (transformers 5's default dtype='auto')"] + code
    why = f"planned from `{fix.flags}`: {fix.why_changes}"

    def with_fix(p: Plan) -> Plan:
        return dataclasses.replace(
            p, remedies=list(dict.fromkeys(names + p.remedies)), setup_changes={**fix.changes, **p.setup_changes},
            changes={**args, **p.changes}, env={**env, **p.env}, code=code + p.code, notes=[why, *p.notes])

    baseline = with_fix(result.baseline)
    plans = [with_fix(p) for p in result.plans]
    chosen = result.chosen
    if chosen is None and baseline.fits:  # the fix alone fits, and nothing faster does: that is the plan
        plans, chosen = [baseline, *plans], 0
    searched = [dataclasses.replace(c, setup_changes={**fix.changes, **c.setup_changes}) for c in result.searched]
    # a remedy the fix already is (mixed precision) is not "not applicable" but applied first
    not_applicable = {k: (f"applied first (`{fix.flags}`)" if k in names else v)
                      for k, v in result.not_applicable.items()}
    return dataclasses.replace(
        result, fits_as_is=False, baseline=baseline, plans=plans, chosen=chosen, searched=searched,
        not_applicable=not_applicable,
        suggestions=result.suggestions if chosen is None else [],
        started_from={"changes": dict(fix.changes), "flags": fix.flags, "cause": fix.cause, "why": fix.why_changes})


def _warm_up(sims: Simulations, planned: list) -> None:
    """Run the first planned training simulation here, before the workers are forked, and keep its result for
    its request (`Simulations.prefetch` on a serial pool). The first simulation in a process pays several seconds
    of CPU the next ones do not (the model's transformers modules imported, the first meta model built, the
    fake-tensor kernels' first dispatch: 2.7 s CPU for the seed case's first `build_meta_model`, 0.02 s for the
    next, measured under load on the 2-core machine); paid here once, each worker inherits it by the fork.
    `planned` is reordered so that it comes first."""
    first = next((i for i, (_, kw) in enumerate(planned) if kw.get("train", True) and not kw.get("optimizer_only")),
                 0)
    planned.insert(0, planned.pop(first))
    setup, kwargs = planned[0]
    sims.prefetch(WorkerPool(1), "phase_peaks", setup, kwargs)
    try:
        sims.pending[-1][3].get()  # computed now; a MemfitError is raised again where the fit asks for it
    except MemfitError:
        pass


def _cache_key(setup: TrainSetup, gpu: Any, spec: GpuSpec, **options: Any) -> str | None:
    """memfit.cache.plan_key of this plan; None when its result depends on this machine's GPU now (`gpu="auto"`,
    or no `non_pytorch_bytes` where NVML sees a GPU: `_other_processes_bytes` then counts other processes)."""
    from memfit.cache import plan_key
    from memfit.gpus.outside_pytorch import gpu_processes

    if isinstance(gpu, str) and gpu.strip().lower() == "auto":
        return None
    if options["non_pytorch_bytes"] is None and gpu_processes() is not None:
        return None
    options = {**options, "allow": sorted(options["allow"]), "exclude": sorted(options["exclude"])}
    return plan_key(setup, gpu=spec, options=options)


def _store(key: str, result: PlanResult) -> None:
    """Cache `result` when its JSON reads back as the same PlanResult (a tuple that JSON makes a list is not)."""
    import json

    from memfit.cache import store_plan

    try:
        data = json.loads(json.dumps(result.to_json()))
    except (TypeError, ValueError):
        return
    if PlanResult.from_json(data) == result:
        store_plan(key, data)


def _check_options(*, margin: float, allow: tuple[str, ...] | list[str], exclude: tuple[str, ...]) -> tuple[str, ...]:
    """Clear errors for a bad margin, exclusion or opt-in, before anything runs. Returns `allow`, stripped."""
    if not 0 <= margin < 0.5:
        raise MemfitError(f"margin `{margin}` must be between 0 and 0.5 (a fraction of the GPU kept free)")
    allow = tuple(remedy_id(a.strip()) for a in allow if a.strip())
    bad = [x for x in exclude if x not in REGISTRY]
    if bad:
        raise MemfitError(f"cannot exclude `{bad[0]}`; remedies are: {', '.join(REGISTRY)}")
    unknown = [a for a in allow if a not in OPT_IN]
    if unknown:
        raise MemfitError(f"cannot allow `{unknown[0]}`; opt-in remedies are: {', '.join(sorted(OPT_IN))}")
    if "qlora" in allow and "lora" not in allow:  # a 4-bit base trains only through adapters
        allow += ("lora",)
    return allow


def _as_setup(setup: Any) -> TrainSetup:
    """The TrainSetup to plan, resolved (memfit.models.resolve): `setup` itself, or a model id's defaults; a clear
    error for anything else."""
    if isinstance(setup, str):  # a model id
        setup = TrainSetup(model=setup)
    if not isinstance(setup, TrainSetup):
        raise MemfitError(f"setup `{type(setup).__name__}` is not a TrainSetup; pass TrainSetup(...), "
                          "TrainSetup.from_kwargs(model, training_args={...}) or a model id")
    return resolve(setup)


def _budget_for(spec: GpuSpec, margin: float, non_pytorch_bytes: int | None) -> Budget:
    """The GPU's total less the margin, less the memory outside PyTorch; an error when nothing is left."""
    budget = int(spec.total_bytes * (1 - margin))
    if non_pytorch_bytes is None:
        non_pytorch_bytes = _other_processes_bytes(spec)
    if non_pytorch_bytes is None:
        from memfit.gpus.outside_pytorch import non_pytorch_bytes as table

        non_pytorch_bytes = table(spec).total_bytes
    outside = non_pytorch_bytes
    capacity = budget - outside  # what PyTorch's allocator may use within the budget
    if capacity <= 0:
        raise MemfitError(f"gpu `{spec.name}` leaves no memory to PyTorch: its budget with margin {margin} is "
                          f"{budget} bytes and {outside} bytes are outside PyTorch; use a larger GPU or a "
                          "smaller margin")
    return Budget(spec, margin, budget, outside, capacity)


class _Baseline(NamedTuple):
    """The setup as it is: its estimate, its plan, and what the fitted candidates are scaled by."""

    report: MemoryReport
    plan: Plan
    need_ratio: float  #: what the run needs over what it allocates (>= 1): scales the fitted plans' memory
    timer: StepTimer
    step_time_s: float  #: its modelled step time (candidates' times are relative to it)


def _estimate_baseline(setup: TrainSetup, budget: Budget, alloc_conf: str | None, sims: Simulations) -> _Baseline:
    """Estimate the setup as it is (full simulation + allocator replay with the budget's capacity)."""
    report = sims.estimate(setup, budget, alloc_conf)
    sims.baseline = (setup, report)  # its first micro-steps are a training fit's (memory_model.Simulations._reused)
    need = report.required_bytes if report.required_bytes is not None else report.peak_reserved_bytes
    ratio = max(1.0, need / max(1, report.peak_allocated_bytes))
    timer = StepTimer.for_setup(setup, budget.spec)
    # a paged optimizer's page traffic when the run leaves its state no room (as ranking.rank)
    traffic = paged_traffic_bytes(report.paged_bytes, budget.budget_bytes - need - budget.outside_bytes)
    base_time = timer.seconds(setup, report.params, report.trainable_params, paged_traffic=traffic)
    return _Baseline(report, _plan_from_report(setup, {}, report, 1.0, budget.budget_bytes, verified=True),
                     ratio, timer, base_time)


def _candidate_axes(setup: TrainSetup, spec: GpuSpec, verdicts: dict[str, Any], *, allow: tuple[str, ...],
                    exclude: tuple[str, ...]) -> Axes:
    """Per remedy the setup's own value and, where the remedy applies, is allowed and not excluded, its
    variants; the micro-batches that divide the effective batch size."""
    def axis(name: str, current: dict[str, Any]) -> list[dict[str, Any]]:
        r = REGISTRY[name]
        if (r.opt_in and name not in allow) or not verdicts[name].applies or name in exclude:
            return [current]
        return [current] + r.variants(setup, spec)

    e = setup.effective_batch_size
    return Axes(
        precisions=axis("mixed_precision", {"precision": setup.precision}),
        checkpointing=axis("gradient_checkpointing", {"gradient_checkpointing": setup.gradient_checkpointing})
        + [{"gradient_checkpointing": True, **v} for v in axis("checkpoint_offload", {})[1:]]
        + [{"gradient_checkpointing": True, **v} for v in axis("reentrant_checkpointing", {})[1:]],
        optimizers=axis("optimizer", {"optim": setup.optim}),
        # smaller images and no pan-and-scan crops shorten the sequence as truncation does; freezing the vision
        # tower is a freeze
        lengths=axis("truncation", {}) + axis("smaller_images", {})[1:] + axis("no_pan_and_scan", {})[1:],
        loras=axis("lora", {}),
        freezes=axis("freeze", {}) + axis("freeze_vision_tower", {})[1:],
        offloads=axis("offload", {}),
        micro_batches=[b for b in range(1, e + 1) if e % b == 0],
        kernels=_kernel_axis(setup, spec, verdicts, allow=allow, exclude=exclude),
    )


#: The remedies of the evaluation's `generate` (Seq2SeqTrainer predict_with_generate), in `Axes.generations`.
GENERATION_REMEDIES = ("fewer_beams", "shorter_generation")


def _generation_axis(setup: TrainSetup, spec: GpuSpec, report: MemoryReport, verdicts: dict[str, Any], *,
                     allow: tuple[str, ...], exclude: tuple[str, ...]) -> list[dict[str, Any]]:
    """The setup's own generation settings ({}), then each allowed generation remedy's variant and, with both,
    the two together. They are searched only where the evaluation sets the peak of the setup as it is (its
    estimate, `report`): elsewhere a shorter evaluation saves nothing the run needs, and `verdicts` says so."""
    from memfit.remedies import Applicability

    usable = [n for n in GENERATION_REMEDIES if verdicts[n].applies]
    if usable and report.peak_phase != "eval":
        for n in usable:
            verdicts[n] = Applicability(False, f"the evaluation's generate does not set the peak (the "
                                               f"{report.peak_phase} does)")
        return [{}]
    variants = [REGISTRY[n].variants(setup, spec)[0] for n in usable if n in allow and n not in exclude]
    return [{}] + variants + ([{k: v for v in variants for k, v in v.items()}] if len(variants) > 1 else [])


def _kernel_axis(setup: TrainSetup, spec: GpuSpec, verdicts: dict[str, Any], *, allow: tuple[str, ...],
                 exclude: tuple[str, ...]) -> list[dict[str, Any]]:
    """The setup's kernels, then all the leaner kernels that apply together (FlashAttention-2 and Liger cost
    no speed, so they are one step, not a product), then QLoRA on top of them when allowed: at most three
    entries, so that the search does not multiply its simulations."""
    def usable(name: str) -> bool:
        r = REGISTRY[name]
        return verdicts[name].applies and name not in exclude and (not r.opt_in or name in allow)

    lean: dict[str, Any] = {}
    for name in ("flash_attention", "liger"):
        if usable(name):
            lean.update(REGISTRY[name].variants(setup, spec)[0])
    out: list[dict[str, Any]] = [{}]
    if lean:
        out.append(lean)
    if usable("qlora"):
        out.append({**lean, **REGISTRY["qlora"].variants(setup, spec)[0]})
    return out


class _Verified(NamedTuple):
    """The plans shown, best first, and the first verified one that fits."""

    plans: list[Plan]
    chosen: int | None  #: index into `plans`


def _verify(setup: TrainSetup, ranked: list[Candidate], base: _Baseline, budget: Budget, sims: Simulations, *,
            alloc_conf: str | None, verify_top: int, max_plans: int) -> _Verified:
    """Verify the best candidates until one fits (at most `verify_top`); the next ones as fitted plans.

    Args:
        setup: the setup as it is.
        ranked: the candidates, best first (memfit.planner.ranking.rank).
        base: the baseline.
        budget: the GPU's budget.
        sims: runs and counts the simulations.
        alloc_conf: the run's PYTORCH_CUDA_ALLOC_CONF.
        verify_top: how many candidates to verify at most.
        max_plans: how many plans to return.
    """
    plans: list[Plan] = []
    chosen = None
    verified = 0
    for c in _distinct_candidates(setup, ranked, base):
        if verified < verify_top and chosen is None:
            verified += 1
            plans.append(_verified_plan(setup, c, budget, sims, alloc_conf))
            if plans[-1].fits:
                chosen = len(plans) - 1
        elif len(plans) < max_plans:
            plans.append(_fitted_plan(setup, c, base, budget))
        if len(plans) >= max_plans and chosen is not None:
            break
    return _Verified(plans, chosen)


def _distinct_candidates(setup: TrainSetup, ranked: list[Candidate], base: _Baseline):
    """The ranked candidates a plan may show, best first: each set of changes once, none that conflict."""
    seen = set()
    for c in ranked:
        # a change the others already make (checkpointing under kbit prep) is not proposed
        c = dataclasses.replace(c, changes=implied_changes(setup, c.changes).changes)
        key = tuple(sorted(c.changes.items()))
        if key in seen or not c.changes:
            continue
        seen.add(key)
        if conflict(_describe(setup, c.changes, base.report.checkpointing)[0]):
            continue  # e.g. ZeRO-Offload with an 8-bit optimizer (memfit.remedies: `incompatible`)
        yield c


def _verified_plan(setup: TrainSetup, c: Candidate, budget: Budget, sims: Simulations,
                   alloc_conf: str | None) -> Plan:
    """A candidate estimated in full and replayed with the budget; when it does not fit, replayed again with
    `expandable_segments:True`, then `max_split_size_mb:128` (memfit.remedies.allocator)."""
    report = sims.estimate(setup.replace(**c.changes), budget, alloc_conf)
    candidate = _plan_from_report(setup, c.changes, report, c.relative_step_time, budget.budget_bytes, verified=True)
    if not candidate.fits:
        for conf_text in ("expandable_segments:True", "max_split_size_mb:128"):
            alt = bounded_reserved(report.trace, conf=parse_alloc_conf(conf_text), capacity_bytes=budget.capacity_bytes,
                                   search=False)
            if alt.oom is None:
                return _plan_from_report(setup, c.changes, report, c.relative_step_time, budget.budget_bytes,
                                         verified=True, alloc_conf=conf_text, reserved=alt.report.peak_reserved_bytes)
    return candidate


def _fitted_plan(setup: TrainSetup, c: Candidate, base: _Baseline, budget: Budget) -> Plan:
    """A candidate as the fitted model predicts it (not verified)."""
    names, args, env, code = _describe(setup, c.changes, base.report.checkpointing)
    # a GPU's allocator stops at the budget
    reserved = min(int(c.peak_allocated_bytes * base.need_ratio), budget.capacity_bytes)
    return Plan(names, c.changes, args, env, code, int(c.peak_allocated_bytes), reserved,
                reserved + budget.outside_bytes, budget.budget_bytes - c.used_bytes, round(c.relative_step_time, 3), c.fits, False,
                ["fitted model, not verified by a full simulation"]
                + [n for n in setup.replace(**c.changes).notes if n not in setup.notes])  # e.g. kbit prep's checkpointing


def _choose(verified: _Verified, baseline: Plan) -> int | None:
    """The verified plan that fits, unless the setup already fits and that plan is not faster."""
    if baseline.fits and verified.chosen is not None and verified.plans[verified.chosen].relative_step_time >= 1.0:
        return None  # nothing faster than what already fits
    return verified.chosen


class _Miss(NamedTuple):
    """When nothing fits: how far the closest plan is over the budget, and what would help."""

    miss_bytes: int | None
    suggestions: list[str]


def _miss(baseline: Plan, plans: list[Plan], chosen: int | None, budget: Budget, verdicts: dict[str, Any],
          allow: tuple[str, ...]) -> _Miss:
    """How far the closest plan misses, the opt-ins not allowed that apply, and a GPU that would do."""
    if chosen is not None or baseline.fits:
        return _Miss(None, [])
    # a fitted plan that "fits" but was not verified says nothing about how far the others miss
    closest = max([p for p in [baseline] + plans if p.verified or not p.fits], key=lambda p: p.headroom_bytes)
    miss = -closest.headroom_bytes
    suggestions: list[str] = []
    for name, r in REGISTRY.items():
        if r.opt_in and name not in allow and verdicts[name].applies:
            suggestions.append(f"allow `{name}` ({r.title}: saves {r.saves}; costs: {r.costs})")
    need = (budget.budget_bytes + miss) / (1 - budget.margin)
    bigger = sorted((g for g in CATALOG.values() if g.total_bytes >= need), key=lambda g: g.total_bytes)
    if bigger:
        suggestions.append(f"a GPU with at least {need / 2**30:.1f} GiB, e.g. {bigger[0].name}")
    return _Miss(miss, suggestions)
