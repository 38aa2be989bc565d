"""`memfit.plan` for GRPO (`trainer="grpo"`): the fastest configuration of GRPOTrainer (TRL 1.16) that fits one GPU,
keeping the generation batch and the completions per optimizer step exactly. RLOO (`trainer="rloo"`) is planned
the same way: RLOOConfig has GRPOConfig's generation names (memfit.train_setup.GENERATING_TRAINERS).

What is searched (memfit.remedies, each change a GRPOConfig name):

- the micro-batch `b` against `steps_per_generation` and `gradient_accumulation_steps`: every `b` that divides
  both the completions per optimizer step `E` (`per_device_train_batch_size x gradient_accumulation_steps`) and
  the generation batch `G`; accumulation becomes `E / b` and `steps_per_generation` `G / b` (or
  `generation_batch_size` stays `G` when the setup gives it), as GRPOConfig.__post_init__ derives them
  (memfit.train_setup.grpo_generation_sizes): the same completions are generated and learned from;
- gradient checkpointing on and off, Liger kernels (`use_liger_kernel`, where Liger applies: GRPOConfig 1.16 has
  no `use_liger_loss`, TRL's fused LM head never builds the `[B, C, vocab]` logits), smaller or paged optimizers
  (a method change: ranked after those that keep the optimizer);
- with vLLM colocated, the share `vllm_gpu_memory_utilization`, sized in closed form for each candidate: the
  largest share in hundredths of the card that leaves the training step its reserved peak `R` within the budget
  (`share <= budget - memory outside PyTorch - R`, the budget being the card less the margin), or sleep mode
  (`vllm_enable_sleep_mode`, level 2), where the share needs room only beside what training holds when vLLM wakes
  (the tensors alive when the last simulated scoring starts: weights, optimizer state, buffers). A share must hold
  the weights and one sequence of vLLM's `max_model_len` (the config's `max_position_embeddings`: TRL passes
  `vllm_max_model_length`, None by default), or vLLM refuses to start;
- only with `--allow`: `fewer_generations` (`num_generations` halved: the generation batch and the completions per
  step halve, the prompts stay), `shorter_completions` (`max_completion_length` halved), `no_reference`
  (`beta=0`: no reference copy, no KL term), `lora`, `qlora`.

How: candidates are taken best first by a lower bound of their modelled step time (memfit.planner.grpo_time,
vLLM decoding the whole generation batch at once), each estimated in full (simulation + allocator replay at the
budget's capacity), its share sized and its plan replayed again at the capacity the share leaves (verified);
the search stops when the next candidate's lower bound is no faster than the best verified plan that fits, or
after `MAX_SIMULATIONS` estimates. A micro-batch larger than one that does not fit (same other settings, or
with checkpointing off where it is on) is not estimated: memory grows with the micro-batch and without
checkpointing (an assumption of the search; every plan shown is still verified).

Not searched for GRPO: mixed precision (GRPOConfig's bf16 stays), truncation (GRPOTrainer 1.16 does not truncate
prompts), freezing, ZeRO-Offload, FlashAttention-2, evaluation settings. Several GPUs (vLLM colocated on all
against a `trl vllm-serve` server on some): memfit.planner.grpo_parallel_plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from memfit.allocator.bounded import bounded_reserved
from memfit.errors import MemfitError
from memfit.estimator import MemoryReport
from memfit.planner.memory_model import Budget, Simulations
from memfit.remedies import REGISTRY, Applicability
from memfit.train_setup import TRL_CONFIG_CLASS_NAMES, TrainSetup

__all__ = ["plan_grpo", "GRPO_OPT_IN", "MAX_SIMULATIONS", "share_for", "GrpoFacts", "grpo_facts",
           "held_when_vllm_wakes", "grpo_micro_batches", "opt_in_methods", "check_grpo_allow"]

#: The `--allow` names a GRPO plan searches (memfit.remedies ids).
GRPO_OPT_IN = ("fewer_generations", "shorter_completions", "no_reference", "lora", "qlora")
#: Estimates of candidates before the search stops with the best found (a GRPO estimate simulates generation,
#: scoring and the training micro-steps of the whole model: tens of seconds for billions of parameters).
MAX_SIMULATIONS = 10
_MICRO_BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                     "generation_batch_size")


@dataclass(frozen=True)
class GrpoFacts:
    """What the sizing and the step time need of the model on this GPU."""

    kv_per_token: int  #: vLLM's KV cache bytes per token (the weights' dtype)
    hf_kv_per_token: int  #: transformers' generate KV cache bytes per token (the autocast dtype)
    weight_bytes: int  #: the weights in their dtype
    max_model_len: int  #: vLLM's max_model_len: the config's max_position_embeddings
    timer: Any  #: memfit.planner.ranking.StepTimer


def grpo_facts(setup: TrainSetup, spec: Any, params: int) -> GrpoFacts:
    """GrpoFacts of `setup`'s model (`params` parameters) on `spec`."""
    from memfit.models.build import resolve_config
    from memfit.planner.grpo_time import kv_bytes_per_token
    from memfit.planner.ranking import StepTimer

    timer = StepTimer.for_setup(setup, spec)
    config = resolve_config(setup.model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hf_bytes = 2 if setup.precision in ("fp16", "bf16") else timer.weight_bytes
    max_len = int(getattr(text, "max_position_embeddings", 0) or (setup.sequence_length + setup.max_completion_length))
    return GrpoFacts(kv_bytes_per_token(config, timer.weight_bytes), kv_bytes_per_token(config, hf_bytes),
                     params * timer.weight_bytes, max_len, timer)


def share_for(room_bytes: int, total_bytes: int) -> float:
    """The largest share of a card of `total_bytes`, in hundredths, that is at most `room_bytes` (0 when none)."""
    if room_bytes <= 0:
        return 0.0
    return min(1.0, math.floor(room_bytes * 100 / total_bytes) / 100)


def held_when_vllm_wakes(trace: list) -> int:
    """Bytes training holds when a sleeping vLLM wakes to generate: the tensors alive (in allocator blocks,
    memfit.peaks.rounded) when the last scoring phase of the trace starts, after an optimizer step where the trace
    has one (its state is alive then); TRL empties PyTorch's cache before waking vLLM (vllm_generation.py
    `sync_weights`)."""
    from memfit.peaks import rounded

    starts = [i for i, ev in enumerate(trace) if ev.phase == "scoring" and (i == 0 or trace[i - 1].phase != "scoring")]
    end = starts[-1] if starts else len(trace)
    live: dict[int, int] = {}
    for ev in trace[:end]:
        if ev.action == "alloc":
            live[ev.id] = rounded(ev.size_bytes)
        elif ev.action == "free":
            live.pop(ev.id, None)
    return sum(live.values())


@dataclass
class _Candidate:
    changes: dict[str, Any]  #: TrainSetup changes, without the vLLM share (sized per candidate)
    tier: int  #: 0 same method; 1 another optimizer; 2 an opt-in; 3 every allowed opt-in together
    bound_s: float  #: lower bound of its modelled step time (vLLM decoding all at once)


@dataclass
class _Option:
    """A candidate with its share: its verified figures and modelled time."""

    changes: dict[str, Any]
    tier: int
    time_s: float
    fits: bool
    report: MemoryReport
    reserved_bytes: int
    used_bytes: int
    need_bytes: int  #: what it needs of the budget (for those that do not fit: how far over)
    notes: list[str] = field(default_factory=list)


def plan_grpo(setup: TrainSetup, budget: Budget, *, allow: tuple[str, ...], exclude: tuple[str, ...],
              alloc_conf: str | None, max_plans: int, started: float, parts: Any,
              max_simulations: int = MAX_SIMULATIONS) -> Any:
    """The PlanResult of a GRPO setup on one GPU (module docstring); memfit.planner.search.plan calls it with
    `parts` (memfit.planner.search.GrpoParts: its Plan and PlanResult classes, `_describe` and `_miss`)."""
    check_grpo_allow(allow)
    spec = budget.spec
    sims = Simulations()
    base_report = sims.estimate(setup, budget, alloc_conf)
    facts = grpo_facts(setup, spec, base_report.params)
    search = _Search(setup, budget, facts, sims, alloc_conf, parts)
    base_time = search.time(setup, base_report.params, base_report.trainable_params,
                            setup.vllm_gpu_memory_utilization if search.colocate else None)
    baseline = search.as_is(base_report, base_time)
    options: list[_Option] = []
    failed: list[dict[str, Any]] = []
    best: _Option | None = None
    notes: list[str] = []
    verdicts = {name: r.check(setup, spec) for name, r in REGISTRY.items()}
    estimated = 0
    for c in search.candidates(verdicts, allow=allow, exclude=exclude, base_report=base_report):
        if best is not None and (c.tier > best.tier or c.bound_s >= best.time_s * (1 - 1e-9)):
            break  # nothing after it can be faster than the best verified plan
        if _dominated(c.changes, failed, setup):
            continue
        if not c.changes:
            report = base_report
        else:
            if estimated >= max_simulations:
                notes.append(f"the search stopped after {max_simulations} estimates with the best plan found")
                break
            estimated += 1
            try:
                report = sims.estimate(setup.replace(**c.changes), budget, alloc_conf)
            except MemfitError:  # a combination the simulation refuses
                continue
        found = search.options(c, report)
        if not any(o.fits for o in found):
            failed.append(c.changes)
        options += [o for o in found if o.changes]
        for o in found:
            if o.fits and (best is None or (o.tier, o.time_s) < (best.tier, best.time_s)):
                best = o
    options.sort(key=lambda o: (not o.fits, o.tier, o.time_s / base_time if o.fits else o.need_bytes, len(o.changes)))
    plans = [search.plan_of(o, base_time) for o in options[:max_plans]]
    chosen = next((i for i, p in enumerate(plans) if p.fits), None)
    if baseline.fits and chosen is not None and plans[chosen].relative_step_time >= 1.0:
        chosen = None  # nothing faster than what already fits
    searched = {k: v if k in GRPO_OPT_IN or not REGISTRY[k].opt_in else Applicability(False, "not searched for GRPO")
                for k, v in verdicts.items()}
    miss = parts.miss(baseline, plans, chosen, budget, searched, allow)
    used = {"gradient_checkpointing", "optimizer", "micro_batch", "liger", "vllm_share", *GRPO_OPT_IN}
    return parts.result_cls(
        fits_as_is=baseline.fits, baseline=baseline, plans=plans, chosen=chosen,
        gpu={"name": spec.name, "total_bytes": spec.total_bytes}, margin=budget.margin,
        budget_bytes=budget.budget_bytes, miss_bytes=miss.miss_bytes, suggestions=notes + miss.suggestions,
        # checkpointing that is on is searched off too: not "not applicable"
        not_applicable={k: v.reason for k, v in verdicts.items()
                        if k in used and not v.applies and not (k == "gradient_checkpointing"
                                                                and setup.gradient_checkpointing)},
        elapsed_s=round(time.perf_counter() - started, 2), simulations=sims.count,
        config_class=TRL_CONFIG_CLASS_NAMES[setup.trainer],
    )


def check_grpo_allow(allow: tuple[str, ...]) -> None:
    """A one-line MemfitError for an `--allow` name a GRPO / RLOO plan does not search."""
    bad = [a for a in allow if a not in GRPO_OPT_IN]
    if bad:
        raise MemfitError(f"`--allow {bad[0]}` is not searched for GRPO; its opt-ins are: {', '.join(GRPO_OPT_IN)}")


def opt_in_methods(setup: TrainSetup, spec: Any, usable: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The method changes of the `usable` opt-ins (GRPO_OPT_IN names that apply and were allowed): each remedy's
    variants alone (memfit.remedies), QLoRA with LoRA's adapters (a 4-bit base trains only through them), and,
    where there are several, all of them together, the last resort; [] when none is usable. The single-GPU and
    the multi-GPU GRPO plans search the same ones."""
    methods: list[dict[str, Any]] = []
    for name in ("fewer_generations", "shorter_completions", "no_reference", "lora"):
        if name in usable:
            methods += REGISTRY[name].variants(setup, spec)
    if "qlora" in usable:
        methods.append({**REGISTRY["qlora"].variants(setup, spec)[0], **REGISTRY["lora"].variants(setup, spec)[0]})
    if len(methods) > 1:  # every allowed opt-in together, the last resort
        methods.append({k: v for m in methods for k, v in m.items()})
    return methods


def grpo_micro_batches(setup: TrainSetup, num_generations: int | None = None) -> list[dict[str, Any]]:
    """The micro-batch splits of a GRPO setup that keep its generation batch and its completions per optimizer step
    (both scaled by `num_generations / setup.num_generations` when fewer generations are planned: the same prompts,
    fewer completions each): per_device_train_batch_size, gradient_accumulation_steps and steps_per_generation
    (or generation_batch_size, where the setup gives it) as GRPOConfig takes them, smallest micro-batch first."""
    steps, g = setup.grpo_sizes
    e = setup.effective_batch_size
    if num_generations is not None and num_generations != setup.num_generations:
        g, e = g * num_generations // setup.num_generations, e * num_generations // setup.num_generations
    out = []
    for b in range(1, math.gcd(e, g) + 1):
        if e % b or g % b:
            continue
        mb: dict[str, Any] = {"per_device_train_batch_size": b, "gradient_accumulation_steps": e // b}
        if setup.generation_batch_size is not None:
            mb["generation_batch_size"] = g
        elif setup.steps_per_generation is not None or g != e:
            mb["steps_per_generation"] = g // b
        out.append(mb)
    return out


def _dominated(changes: dict[str, Any], failed: list[dict[str, Any]], setup: TrainSetup) -> bool:
    """A candidate that needs at least what one that failed needs: the same other settings with a micro-batch at
    least as large, and checkpointing off where the failed one had it on, or as it was."""
    b = changes.get("per_device_train_batch_size", setup.per_device_train_batch_size)
    others = {k: v for k, v in changes.items() if k not in _MICRO_BATCH_KEYS and k != "gradient_checkpointing"}
    ckpt = changes.get("gradient_checkpointing", setup.gradient_checkpointing)
    for f in failed:
        fb = f.get("per_device_train_batch_size", setup.per_device_train_batch_size)
        f_others = {k: v for k, v in f.items() if k not in _MICRO_BATCH_KEYS and k != "gradient_checkpointing"}
        f_ckpt = f.get("gradient_checkpointing", setup.gradient_checkpointing)
        if f_others == others and fb <= b and (f_ckpt or not ckpt):
            return True
    return False


class _Search:
    """The candidates of one GRPO setup, their shares, times and plans."""

    def __init__(self, setup: TrainSetup, budget: Budget, facts: GrpoFacts, sims: Simulations,
                 alloc_conf: str | None, parts: Any = None) -> None:
        self.setup, self.budget, self.facts, self.sims, self.alloc_conf = setup, budget, facts, sims, alloc_conf
        self.parts = parts  #: memfit.planner.search.GrpoParts (building plans needs it)
        self.total = budget.spec.total_bytes
        self.colocate = setup.use_vllm and setup.vllm_mode == "colocate"

    # -- time ------------------------------------------------------------------------------------------------
    def time(self, s: TrainSetup, params: int, trainable: int, share: float | None, *, bound: bool = False) -> float:
        """Modelled step time of `s` with vLLM's `share` (bound: as if vLLM decoded all at once)."""
        from memfit.planner.grpo_time import grpo_step_time

        pool = None
        if s.use_vllm and s.vllm_mode == "colocate":
            pool = 2**62 if bound else int((share or 0) * self.total) - self.facts.weight_bytes
        kv = self.facts.kv_per_token if s.use_vllm else self.facts.hf_kv_per_token
        return grpo_step_time(s, self.budget.spec, self.facts.timer, params, trainable, kv_per_token=kv,
                              weight_bytes=self.facts.weight_bytes, pool_bytes=pool).total_s

    # -- candidates ------------------------------------------------------------------------------------------
    def candidates(self, verdicts: dict[str, Any], *, allow: tuple[str, ...], exclude: tuple[str, ...],
                   base_report: MemoryReport) -> list[_Candidate]:
        """Every candidate, best lower bound first (tier, then time, then fewer changes)."""
        s = self.setup

        def usable(name: str) -> bool:
            r = REGISTRY[name]
            return verdicts[name].applies and name not in exclude and (not r.opt_in or name in allow)

        ckpts = [{}] + ([{"gradient_checkpointing": not s.gradient_checkpointing}]
                        if "gradient_checkpointing" not in exclude else [])
        optims = [{}] + (REGISTRY["optimizer"].variants(s, self.budget.spec) if usable("optimizer") else [])
        kernels = [{}] + (REGISTRY["liger"].variants(s, self.budget.spec) if usable("liger") else [])
        singles = opt_in_methods(s, self.budget.spec, [n for n in GRPO_OPT_IN if usable(n)])
        # every allowed opt-in together is the last resort: tier 3, after each one alone (each changes what is
        # learned: a combination that happens to be faster is not a reason to change more than one thing)
        combined = singles[-1] if len(singles) > 1 else None
        methods: list[dict[str, Any]] = [{}] + singles
        out: list[_Candidate] = []
        seen = set()
        for method in methods:
            for optim in optims:
                for ckpt in ckpts:
                    for kernel in kernels:
                        for mb in grpo_micro_batches(s, method.get("num_generations")):
                            changes = {**method, **optim, **ckpt, **kernel, **mb}
                            changes = {k: v for k, v in changes.items() if getattr(s, k) != v}
                            key = tuple(sorted(changes.items()))
                            if key in seen:
                                continue
                            seen.add(key)
                            try:
                                cs = s.replace(**changes)
                            except MemfitError:
                                continue
                            # a lower bound: with LoRA, as if nothing trained (the adapters' share is unknown yet)
                            trainable = 0 if method.get("lora_r") else base_report.trainable_params
                            tier = (3 if method is combined else 2) if method else int(bool(optim))
                            bound = self.time(cs, base_report.params, trainable, None, bound=True)
                            out.append(_Candidate(changes, tier, bound))
        out.sort(key=lambda c: (c.tier, c.bound_s, len(c.changes)))
        return out

    # -- memory ----------------------------------------------------------------------------------------------
    def _replay(self, report: MemoryReport, capacity: int):
        return bounded_reserved(report.trace, conf=report.replay_conf, capacity_bytes=max(0, capacity),
                                lower_bytes=report.peak_allocated_bytes)

    def _min_share_bytes(self, s: TrainSetup) -> int:
        """What vLLM needs of its share to start: the weights and one sequence of max_model_len tokens."""
        return self.facts.weight_bytes + self.facts.kv_per_token * self.facts.max_model_len

    def as_is(self, report: MemoryReport, base_time: float) -> Any:
        """The baseline Plan: the setup as it is, with its own share."""
        s = self.setup
        share = s.vllm_gpu_memory_utilization if self.colocate else None
        o = self._assess(s, {}, 0, report, share, s.vllm_enable_sleep_mode if self.colocate else False, base_time)
        return self.plan_of(o, base_time)

    def options(self, c: _Candidate, report: MemoryReport) -> list[_Option]:
        """The candidate with its sized share (with and without sleep mode), or as it is without a colocated vLLM."""
        s = self.setup.replace(**c.changes)
        if not self.colocate:
            return [self._assess(s, c.changes, c.tier, report, None, False, None)]
        alone = self._replay(report, self.budget.capacity_bytes)  # the step with the whole budget
        if alone.oom is not None:  # the step alone does not fit: no share can
            need = (alone.required_bytes or alone.report.peak_reserved_bytes) + self.budget.outside_bytes
            return [_Option(c.changes, c.tier, math.inf, False, report, alone.report.peak_reserved_bytes, need, need,
                            ["the training step alone does not fit the budget: no vLLM share can"])]
        out = []
        # the closed form: the largest share that leaves the step its reserved peak within the budget
        room = self.budget.capacity_bytes - alone.report.peak_reserved_bytes
        share = share_for(room, self.total)
        out.append(self._assess(s, {**c.changes, "vllm_gpu_memory_utilization": share,
                                    "vllm_enable_sleep_mode": False}, c.tier, report, share, False, None))
        held = held_when_vllm_wakes(report.trace)
        share_sleep = share_for(self.budget.budget_bytes - self.budget.outside_bytes - held, self.total)
        if share_sleep > share:  # sleep mode only where it lets vLLM take more
            out.append(self._assess(s, {**c.changes, "vllm_gpu_memory_utilization": share_sleep,
                                        "vllm_enable_sleep_mode": True}, c.tier, report, share_sleep, True, None))
        return out

    def _assess(self, s: TrainSetup, changes: dict[str, Any], tier: int, report: MemoryReport, share: float | None,
                sleep: bool, time_s: float | None) -> _Option:
        """Replay `report`'s trace at the capacity `share` leaves; whether vLLM starts in it and fits beside
        training."""
        changes = {k: v for k, v in changes.items() if getattr(self.setup, k) != v}
        s = self.setup.replace(**changes)
        budget = self.budget
        share_bytes = int((share or 0) * self.total)
        held_share = share_bytes if (share is not None and not sleep) else 0
        replay = self._replay(report, budget.capacity_bytes - held_share)
        notes: list[str] = []
        if replay.oom is None:
            reserved = replay.report.peak_reserved_bytes
            need = reserved
        else:
            reserved = replay.report.peak_reserved_bytes
            need = replay.required_bytes or reserved
        used = need + budget.outside_bytes + held_share
        fits = replay.oom is None
        if share is not None:
            minimum = self._min_share_bytes(s)
            notes.append(f"vLLM share {share:.2f} x the card = {share_bytes} B"
                         + (" (sleep mode: released during the training step)" if sleep else ", held all along")
                         + f"; vLLM needs at least {minimum} B (weights + one sequence of {self.facts.max_model_len} "
                           "tokens)")
            if share_bytes < minimum:
                fits = False
                used = max(used, minimum - share_bytes + budget.budget_bytes)
            if sleep:
                at_generation = held_when_vllm_wakes(report.trace) + budget.outside_bytes + share_bytes
                used = max(used, at_generation)
                fits = fits and at_generation <= budget.budget_bytes
        if time_s is None:
            time_s = self.time(s, report.params, report.trainable_params, share)
        return _Option(changes, tier, time_s, fits and time_s < math.inf, report, reserved, used, used, notes)

    def plan_of(self, o: _Option, base_time: float) -> Any:
        """The Plan of an option (GRPOConfig names in `changes`)."""
        names, args, env, code = self.parts.describe(self.setup, o.changes, o.report.checkpointing)
        # a remedy's `apply` says how to turn it on; the GRPO search also turns some off (checkpointing)
        args.update({k: v for k, v in o.changes.items() if k in args})
        rel = o.time_s / base_time if math.isfinite(o.time_s) and base_time > 0 else math.inf
        return self.parts.plan_cls(names, dict(o.changes), args, env, code, o.report.peak_allocated_bytes, o.reserved_bytes,
                    o.used_bytes, self.budget.budget_bytes - o.used_bytes, round(rel, 3) if math.isfinite(rel) else 1e9,
                    o.fits, True, o.notes + [n for n in o.report.notes if n not in self.setup.notes])
