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

Known limitations: the fit is linear in the micro-batch (exact for activations, which
dominate); what unverified plans need is scaled from the baseline's ratio of needed
(smallest capacity that completes, memfit.allocator.bounded.smallest_capacity) to allocated memory;
offload is modelled as "no optimizer state on the GPU".
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from memfit.allocator.conf import parse_alloc_conf
from memfit.errors import MemfitError
from memfit.estimator import MemoryReport, estimate
from memfit.gpus.catalog import CATALOG, GpuSpec, as_gpu_spec
from memfit.remedies import OPT_IN, REGISTRY
from memfit.peaks import peaks
from memfit.allocator.bounded import bounded_reserved
from memfit.sim.engine import simulate
from memfit.planner.throughput import StepCost, step_time_s
from memfit.trace import TRAIN_PHASES
from memfit.train_setup import TrainSetup

__all__ = ["Plan", "PlanResult", "plan", "DEFAULT_MARGIN"]

#: Fraction of the GPU kept free: allocator and library behaviour we do not model
#: (cuDNN, NCCL, driver differences) and the error of the estimate itself.
DEFAULT_MARGIN = 0.05
#: TrainSetup fields that change which parameters train (their fits simulate the optimizer too)
_TRAINABLE_KEYS = ("lora_r", "freeze_embeddings", "freeze_layers")
#: TrainSetup fields of the opt-in remedies (method changes that rank last)
_OPT_IN_KEYS = ("max_length",) + _TRAINABLE_KEYS + ("offload_optimizer_state",)
_SETUP_TO_ARG = {
    "per_device_train_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "per_device_eval_batch_size": "per_device_eval_batch_size",
    "eval_accumulation_steps": "eval_accumulation_steps",
    "optim": "optim",
    "gradient_checkpointing": "gradient_checkpointing",
}


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

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["schema"] = "memfit.plan/1"
        return out


@dataclass
class _Fit:
    """Per-phase peak allocated bytes, linear in the micro-batch: p1 + slope * (b - 1)."""

    p1: dict[str, int]
    slope: dict[str, int]
    state_bytes: int
    params: int
    trainable: int
    has_state: bool = False  #: peaks include the optimizer state (LoRA / frozen embeddings fits)

    def at(self, b: int) -> dict[str, int]:
        return {k: self.p1[k] + self.slope[k] * (b - 1) for k in self.p1}


def _phase_peaks(setup: TrainSetup, **kwargs: Any) -> tuple[dict[str, int], dict[str, dict[str, int]], Any]:
    sim = simulate(setup.replace(eval_strategy=setup.eval_strategy if not kwargs.get("train", True) else "no"), **kwargs)
    tp = peaks(sim.trace)
    return ({p: pk.bytes for p, pk in tp.by_phase.items()},
            {p: dict(pk.breakdown) for p, pk in tp.by_phase.items()}, sim)


def _config_dims(setup: TrainSetup) -> tuple[int, int]:
    from memfit.models.build import resolve_config

    cfg = resolve_config(setup.model).config
    n_layer = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if getattr(cfg, k, None)), 12)
    d = next((getattr(cfg, k) for k in ("hidden_size", "d_model", "n_embd", "dim") if getattr(cfg, k, None)), 768)
    return int(n_layer), int(d)


def _describe(base: TrainSetup, changes: dict[str, Any], checkpointing_kind: str | None):
    """TrainingArguments diff, env and code for a set of TrainSetup changes."""
    args: dict[str, Any] = {}
    env: dict[str, str] = {}
    code: list[str] = []
    names: list[str] = []
    for key, value in changes.items():
        if key in _SETUP_TO_ARG and getattr(base, key) != value:
            args[_SETUP_TO_ARG[key]] = value
    if changes.get("precision", base.precision) != base.precision:
        names.append("mixed_precision")
        a, _, _ = REGISTRY["mixed_precision"].apply({"precision": changes["precision"]}, base)
        args.update(a)
    if changes.get("gradient_checkpointing") and not base.gradient_checkpointing:
        names.append("gradient_checkpointing")
        a, _, c = REGISTRY["gradient_checkpointing"].apply({}, base, kind=checkpointing_kind)
        args.pop("gradient_checkpointing", None)
        args.update(a)
        code += c
    if changes.get("optim", base.optim) != base.optim:
        names.append("optimizer")
        code += REGISTRY["optimizer"].apply({"optim": changes["optim"]}, base)[2]
    if changes.get("per_device_train_batch_size", base.per_device_train_batch_size) != base.per_device_train_batch_size:
        names.append("micro_batch")
    for key, remedy in (("max_length", "sequence_length"), ("lora_r", "lora"), ("freeze_embeddings", "freeze"),
                        ("freeze_layers", "freeze"), ("offload_optimizer_state", "offload")):
        if key in changes and changes[key] != getattr(base, key) and remedy not in names:
            names.append(remedy)
            a, e, c = REGISTRY[remedy].apply(changes, base)
            args.update(a)
            env.update(e)
            code += c
    if any(k in changes for k in ("per_device_eval_batch_size", "eval_accumulation_steps")):
        names.append("eval_settings")
        code += REGISTRY["eval_settings"].apply(
            {k: changes[k] for k in ("per_device_eval_batch_size", "eval_accumulation_steps") if k in changes}, base
        )[2]
    if changes.get("alloc_conf"):
        names.append("allocator")
        env["PYTORCH_CUDA_ALLOC_CONF"] = changes["alloc_conf"]
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
) -> PlanResult:
    """Search the remedies for the fastest configuration of `setup` that fits `gpu`.

    `exclude`: remedy names (memfit.remedies.REGISTRY) not to search, e.g. `("mixed_precision",)`
    when the run cannot use it (memfit.fit on the CPU).
    """
    started = time.perf_counter()
    if gpu is None:  # a GPU is what the plan is for (a MemfitError, not a TypeError on the missing keyword)
        raise MemfitError("plan() needs `gpu`; `None` is not a GPU: pass gpu=\"V100-16GB\", a size like "
                          "gpu=\"24GiB\", or gpu=\"auto\"")
    if not 0 <= margin < 0.5:
        raise MemfitError(f"margin `{margin}` must be between 0 and 0.5 (a fraction of the GPU kept free)")
    allow = tuple(a.strip() for a in allow if a.strip())
    bad = [x for x in exclude if x not in REGISTRY]
    if bad:
        raise MemfitError(f"cannot exclude `{bad[0]}`; remedies are: {', '.join(REGISTRY)}")
    unknown = [a for a in allow if a not in OPT_IN]
    if unknown:
        raise MemfitError(f"cannot allow `{unknown[0]}`; opt-in remedies are: {', '.join(sorted(OPT_IN))}")
    if isinstance(setup, str):  # a model id
        setup = TrainSetup(model=setup)
    elif not isinstance(setup, TrainSetup):
        raise MemfitError(f"setup `{type(setup).__name__}` is not a TrainSetup; pass TrainSetup(...), "
                          "TrainSetup.from_kwargs(model, training_args={...}) or a model id")
    spec = as_gpu_spec(gpu, required=True)
    setup = setup.replace(compute_capability=tuple(spec.compute_capability))
    budget = int(spec.total_bytes * (1 - margin))
    sims = 0

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
    base_report = estimate(setup, gpu=spec, alloc_conf=alloc_conf, non_pytorch_bytes=outside, capacity_bytes=capacity)
    sims += 1
    # what the run needs over what it allocates (the fitted plans' reserved memory scales by it)
    need = base_report.required_bytes if base_report.required_bytes is not None else base_report.peak_reserved_bytes
    ratio = max(1.0, need / max(1, base_report.peak_allocated_bytes))
    n_layer, d_model = _config_dims(setup)

    def rel_time(s: TrainSetup, params: int, trainable: int) -> float:
        cost = StepCost(params, trainable, n_layer, d_model, s.sequence_length, s.per_device_train_batch_size,
                        s.gradient_accumulation_steps, s.precision, s.gradient_checkpointing, s.optim)
        return step_time_s(cost, spec)

    base_time = rel_time(setup, base_report.params, base_report.trainable_params)
    baseline = _plan_from_report(setup, {}, base_report, 1.0, budget, verified=True)
    verdicts = {name: r.check(setup, spec) for name, r in REGISTRY.items()}
    not_applicable = {name: v.reason for name, v in verdicts.items() if not v.applies}

    # -- axes ------------------------------------------------------------------------------
    def axis(name: str, current: dict[str, Any]) -> list[dict[str, Any]]:
        r = REGISTRY[name]
        if (r.opt_in and r.opt_in not in allow) or not verdicts[name].applies or name in exclude:
            return [current]
        return [current] + r.variants(setup, spec)

    precisions = axis("mixed_precision", {"precision": setup.precision})
    ckpts = axis("gradient_checkpointing", {"gradient_checkpointing": setup.gradient_checkpointing})
    optims = axis("optimizer", {"optim": setup.optim})
    lengths = axis("sequence_length", {})
    loras = axis("lora", {})
    freezes = axis("freeze", {})
    offloads = axis("offload", {})
    e = setup.effective_batch_size
    micro = [b for b in range(1, e + 1) if e % b == 0]

    # -- fit -------------------------------------------------------------------------------
    # Optimizer state and the optimizer-step peak do not depend on precision, checkpointing or
    # the micro-batch: take them from the baseline and, per alternative optimizer, from one
    # simulation of a training step at micro-batch 1.
    base_state = base_report.phase_breakdowns.get("optimizer", {}).get("optimizer_state", 0)
    optim_state: dict[str, tuple[int, int]] = {setup.optim: (base_state, base_report.phases.get("optimizer", 0))}
    for o in optims:
        if o["optim"] in optim_state:
            continue
        by, bd, _ = _phase_peaks(setup.replace(optim=o["optim"]), optimizer_steps=1, optimizer_only=True)
        sims += 1
        optim_state[o["optim"]] = (bd.get("optimizer", {}).get("optimizer_state", 0), by.get("optimizer", 0))
    # Forward/backward peaks without optimizer state (the micro-steps of one optimizer step,
    # accumulation 2 so the second micro-step runs with live gradients). The setup's own
    # precision/checkpointing is simulated at micro-batch 1 and 2, which gives the part that does
    # not grow with the batch (weights, gradients, batch-independent buffers); every other
    # combination is simulated at micro-batch 2 only and shares that part.
    fits: dict[tuple, _Fit] = {}
    const: dict[str, int] | None = None
    combos = list(itertools.product(precisions, ckpts, lengths, loras, freezes))
    for combo in combos:
        changes = {k: v for part in combo for k, v in part.items() if getattr(setup, k) != v}
        method = any(k in changes for k in _TRAINABLE_KEYS)
        steps = 2 if method else 0  # a changed set of trainable parameters: simulate its optimizer too
        s2 = setup.replace(**changes, per_device_train_batch_size=min(2, e), gradient_accumulation_steps=min(2, e))
        p2, bd2, sim = _phase_peaks(s2, optimizer_steps=steps)
        sims += 1
        keys = ("forward", "backward", "optimizer") if method else ("forward", "backward")
        if method or not changes or const is None:
            if e > 1:
                p1, _, _ = _phase_peaks(s2.replace(per_device_train_batch_size=1), optimizer_steps=steps)
                sims += 1
            else:
                p1 = p2
            slope = {k: p2.get(k, 0) - p1.get(k, 0) for k in keys}
            if not method and not changes:
                const = {k: p1.get(k, 0) - slope[k] for k in keys}
        else:
            slope = {k: (p2.get(k, 0) - const[k]) // 2 for k in keys}
            p1 = {k: const[k] + slope[k] for k in keys}
        state = bd2.get("optimizer", {}).get("optimizer_state", 0) if method else 0
        fits[tuple(sorted({k: v for part in combo for k, v in part.items()}.items()))] = _Fit(
            {k: p1.get(k, 0) for k in keys}, slope, state, sim.params, sim.trainable_params, method)
    eval_fit = None
    if setup.does_eval:
        eb0 = setup.per_device_eval_batch_size
        e_a, bd_a, _ = _phase_peaks(setup, train=False)
        sims += 1
        slope = 0
        if eb0 > 1:
            e_b, _, _ = _phase_peaks(setup.replace(per_device_eval_batch_size=1), train=False)
            sims += 1
            slope = (e_a.get("eval", 0) - e_b.get("eval", 0)) / (eb0 - 1)
        eval_fit = (e_a.get("eval", 0), slope, bd_a.get("eval", {}).get("eval_outputs", 0))

    # -- rank ------------------------------------------------------------------------------
    ranked = []
    for combo in itertools.product(precisions, ckpts, lengths, loras, freezes, optims, offloads):
        fit = fits[tuple(sorted({k: v for part in combo[:5] for k, v in part.items()}.items()))]
        merged = {k: v for part in combo for k, v in part.items()}
        optim_change, offload = combo[5], combo[6]
        if fit.has_state and optim_change["optim"] != setup.optim:
            continue  # LoRA / frozen embeddings: the optimizer is not where the memory is
        # method changes (optimizer, opt-ins) rank after plans that keep the method
        tier = int(optim_change["optim"] != setup.optim) + 2 * int(any(k in merged for k in _OPT_IN_KEYS))
        for b in micro:
            changes = dict(merged, per_device_train_batch_size=b, gradient_accumulation_steps=e // b)
            changes = {k: v for k, v in changes.items() if getattr(setup, k) != v}
            by = fit.at(b)
            if fit.has_state:
                state = fit.state_bytes
            else:
                state, opt_peak = optim_state[optim_change["optim"]]
                for ph in ("forward", "backward"):
                    by[ph] += state  # the second optimizer step's micro-steps run with the state alive
                by["optimizer"] = opt_peak
            if offload:
                for ph in TRAIN_PHASES:
                    by[ph] -= state
                state = 0
            eval_changes = {}
            if eval_fit is not None:
                e_peak, slope, outputs = eval_fit
                eval_peak = e_peak + state
                eb = setup.per_device_eval_batch_size
                for candidate_eb in sorted({eb, b, 1}, reverse=True):
                    if candidate_eb > eb:
                        continue
                    pk = eval_peak - slope * (eb - candidate_eb)
                    if pk * ratio + outside <= budget:
                        if candidate_eb != eb:
                            eval_changes["per_device_eval_batch_size"] = candidate_eb
                        eval_peak = pk
                        break
                else:
                    eval_peak = eval_peak - slope * (eb - 1) - outputs
                    eval_changes = {"per_device_eval_batch_size": 1, "eval_accumulation_steps": 1}
                by["eval"] = eval_peak
            changes.update(eval_changes)
            peak = max(by.values())
            used = int(peak * ratio) + outside
            t = rel_time(setup.replace(**changes), fit.params, fit.trainable) / base_time
            ranked.append((used <= budget, tier, t, len(changes), used, peak, changes))
    ranked.sort(key=lambda x: (not x[0], x[1], x[2] if x[0] else x[4], x[3]))

    # -- verify ----------------------------------------------------------------------------
    plans: list[Plan] = []
    chosen = None
    seen = set()
    verified = 0
    for ok, _tier, t, _, used, peak, changes in ranked:
        key = tuple(sorted(changes.items()))
        if key in seen or not changes:
            continue
        seen.add(key)
        if verified < verify_top and chosen is None:
            report = estimate(setup.replace(**changes), gpu=spec, alloc_conf=alloc_conf,
                              non_pytorch_bytes=outside, capacity_bytes=capacity)
            sims += 1
            verified += 1
            candidate = _plan_from_report(setup, changes, report, t, budget, verified=True)
            if not candidate.fits:
                for conf_text in ("expandable_segments:True", "max_split_size_mb:128"):
                    alt = bounded_reserved(report.trace, conf=parse_alloc_conf(conf_text), capacity_bytes=capacity,
                                           search=False)
                    if alt.oom is None:
                        candidate = _plan_from_report(setup, changes, report, t, budget, verified=True,
                                                      alloc_conf=conf_text, reserved=alt.report.peak_reserved_bytes)
                        break
            plans.append(candidate)
            if candidate.fits and chosen is None:
                chosen = len(plans) - 1
        elif len(plans) < max_plans:
            names, args, env, code = _describe(setup, changes, base_report.checkpointing)
            reserved = min(int(peak * ratio), capacity)  # a GPU's allocator stops at the budget
            plans.append(Plan(names, changes, args, env, code, int(peak), reserved, reserved + outside,
                              budget - used, round(t, 3), ok, False,
                              ["fitted model, not verified by a full simulation"]))
        if len(plans) >= max_plans and chosen is not None:
            break
    if baseline.fits and chosen is not None and plans[chosen].relative_step_time >= 1.0:
        chosen = None  # nothing faster than what already fits
    miss = None
    suggestions: list[str] = []
    if chosen is None and not baseline.fits:
        # a fitted plan that "fits" but was not verified says nothing about how far the others miss
        closest = max([p for p in [baseline] + plans if p.verified or not p.fits], key=lambda p: p.headroom_bytes)
        miss = -closest.headroom_bytes
        for name, r in REGISTRY.items():
            if r.opt_in and r.opt_in not in allow and verdicts[name].applies:
                suggestions.append(f"allow `{r.opt_in}` ({r.title}: saves {r.saves}; costs: {r.costs})")
        need = (budget + miss) / (1 - margin)
        bigger = sorted((g for g in CATALOG.values() if g.total_bytes >= need), key=lambda g: g.total_bytes)
        if bigger:
            suggestions.append(f"a GPU with at least {need / 2**30:.1f} GiB, e.g. {bigger[0].name}")
    return PlanResult(
        fits_as_is=baseline.fits, baseline=baseline, plans=plans, chosen=chosen,
        gpu={"name": spec.name, "total_bytes": spec.total_bytes}, margin=margin, budget_bytes=budget,
        miss_bytes=miss, suggestions=suggestions, not_applicable=not_applicable,
        elapsed_s=round(time.perf_counter() - started, 2), simulations=sims,
    )
