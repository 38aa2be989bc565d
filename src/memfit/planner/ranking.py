"""The planner's ranking: every candidate of `memfit.plan` ordered by whether its predicted memory
fits the budget, then by how much it changes the method, then by modelled step time
(memfit.planner.throughput); step 3 of memfit.planner.search.

A candidate is a combination of the search axes (memfit.planner.memory_model.Axes) with a
micro-batch that divides the effective batch size, so the micro-batch split keeps the effective
batch size exactly. Method changes (another optimizer, the opt-in remedies) rank after the plans
that keep the method; among those that do not fit, the one that needs least memory ranks first.

Internal to memfit.planner; the public face is `memfit.planner.search.plan`.

Known limitations: what a candidate needs is its predicted peak allocated memory scaled by the
baseline's ratio of needed (memfit.allocator.bounded.smallest_capacity) to allocated memory.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass
from typing import Any

from memfit.gpus.catalog import GpuSpec
from memfit.planner.memory_model import TRAINABLE_KEYS, WEIGHT_KEYS, Axes, Budget, MemoryModel, eval_choice, train_peaks
from memfit.planner.throughput import StepCost, paged_traffic_bytes, step_time_s
from memfit.train_setup import TrainSetup

__all__ = ["OPT_IN_KEYS", "StepTimer", "Candidate", "rank"]

#: TrainSetup fields of the opt-in remedies (method changes that rank last)
OPT_IN_KEYS = ("max_length",) + TRAINABLE_KEYS + WEIGHT_KEYS + ("offload_optimizer_state", "generation_num_beams",
                                                                 "generation_max_length")


@dataclass(frozen=True)
class StepTimer:
    """Modelled step time (memfit.planner.throughput) of setups of one model on one GPU."""

    spec: GpuSpec
    n_layer: int
    d_model: int
    weight_bytes: int = 4  #: bytes per element of the weights as loaded (the residual stream's dtype)

    @classmethod
    def for_setup(cls, setup: TrainSetup, spec: GpuSpec) -> "StepTimer":
        """Read the model's depth and width from its config (defaults: 12 layers, width 768)."""
        from memfit.models.build import resolve_config

        cfg = resolve_config(setup.model).config
        n_layer = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                        if getattr(cfg, k, None)), 12)
        d = next((getattr(cfg, k) for k in ("hidden_size", "d_model", "n_embd", "dim") if getattr(cfg, k, None)), 768)
        # memfit.models.build.build_meta_model: weights_dtype, or for `auto` the config's dtype (float32 without)
        dtype = {"fp32": 4, "fp16": 2, "bf16": 2}.get(setup.weights_dtype)
        if dtype is None:
            name = str(getattr(cfg, "dtype", None) or "float32").removeprefix("torch.")
            dtype = 2 if name in ("float16", "bfloat16") else 4
        return cls(spec, int(n_layer), int(d), dtype)

    def offload_bytes(self, s: TrainSetup) -> int:
        """Bytes of checkpointed inputs `gradient_checkpointing_kwargs={"offload": True}` moves to the host per
        micro-step (0 without it): transformers 5.24 `GradientCheckpointingLayer` checkpoints
        `partial(forward, **kwargs)` with the positional args only, and for decoder layers that is the hidden
        states (B x S x d); `torch.utils.checkpoint` saves only those (`_NoopSaveInputs`), which `save_on_cpu`
        offloads. `every_n_layers` checkpoints the layers with `index % n == 0` (`_set_gradient_checkpointing`).
        The hidden states have the weights' dtype, float32 after `prepare_model_for_kbit_training` (it casts the
        embeddings). tests/remedies/test_remedies_llm.py checks this against the simulated host copies."""
        kw = s.gradient_checkpointing_kwargs or {}
        if not (s.gradient_checkpointing and kw.get("offload")):
            return 0
        n = int(kw.get("every_n_layers", 1))
        layers = -(-self.n_layer // n)
        elem = 4 if (s.load_in_4bit or s.load_in_8bit) and s.kbit_prep else self.weight_bytes
        return layers * s.per_device_train_batch_size * s.sequence_length * self.d_model * elem

    def seconds(self, s: TrainSetup, params: int, trainable_params: int, *, paged_traffic: int = 0) -> float:
        """Modelled seconds of one optimizer step of `s` (`paged_traffic`: a paged optimizer's bytes over the host
        link per step, memfit.planner.throughput.paged_traffic_bytes)."""
        cost = StepCost(params, trainable_params, self.n_layer, self.d_model, s.sequence_length,
                        s.per_device_train_batch_size, s.gradient_accumulation_steps, s.precision,
                        s.gradient_checkpointing, s.optim,
                        quantized_params=(params - trainable_params) if (s.load_in_4bit or s.load_in_8bit) else 0,
                        quantized_bits=4 if s.load_in_4bit else 8,
                        host_offload_bytes=self.offload_bytes(s), paged_traffic_bytes=paged_traffic)
        return step_time_s(cost, self.spec)


@dataclass(frozen=True)
class Candidate:
    """One configuration as the fitted model predicts it."""

    fits: bool  #: used_bytes <= the budget
    tier: int  #: 0: same method; +1: another optimizer; +2: an opt-in remedy
    relative_step_time: float  #: modelled step time over the setup's
    n_changes: int
    used_bytes: int  #: predicted need (peak allocated x the baseline's need ratio) + memory outside PyTorch
    peak_allocated_bytes: float  #: predicted peak allocated over the phases
    changes: dict[str, Any]  #: TrainSetup changes (only those that differ from the setup)

    def sort_key(self) -> tuple:
        """Those that fit first, by tier then step time; those that do not, by what they need."""
        return (not self.fits, self.tier, self.relative_step_time if self.fits else self.used_bytes, self.n_changes)


def rank(setup: TrainSetup, axes: Axes, model: MemoryModel, *, budget: Budget, need_ratio: float,
         timer: StepTimer, base_time_s: float) -> list[Candidate]:
    """Every candidate, predicted by the fitted model, best first.

    Args:
        setup: the setup as it is.
        axes: the search space.
        model: the fitted memory model of its combinations.
        budget: the GPU's budget.
        need_ratio: the baseline's needed over allocated memory (>= 1).
        timer: the step-time model.
        base_time_s: the setup's own modelled step time.
    """
    e = setup.effective_batch_size
    ranked = []
    for combo in axes.combos():
        fit = model.fit_for(combo)
        if fit is None:
            continue  # its simulation refused the combination
        merged = {k: v for part in combo for k, v in part.items()}
        optim, offload = combo[6]["optim"], bool(combo[7])
        if fit.has_state and optim != setup.optim:
            continue  # LoRA / frozen embeddings: the optimizer is not where the memory is
        # method changes (optimizer, opt-ins) rank after plans that keep the method
        # the evaluation's generate variants (memfit.remedies fewer_beams, shorter_generation) change the eval only
        for generation, b in itertools.product(axes.generations if model.eval_fit is not None else [{}],
                                               axes.micro_batches):
            with_gen = {**merged, **generation}
            tier = int(optim != setup.optim) + 2 * int(any(k in with_gen for k in OPT_IN_KEYS))
            changes = dict(with_gen, per_device_train_batch_size=b, gradient_accumulation_steps=e // b)
            changes = {k: v for k, v in changes.items() if getattr(setup, k) != v}
            by, state = train_peaks(model, fit, optim, offload, b)
            if model.eval_fit is not None:
                evaluation = eval_choice(model.eval_fit_for(generation), state, setup.per_device_eval_batch_size, b,
                                         lambda pk: pk * need_ratio + budget.outside_bytes <= budget.budget_bytes)
                by["eval"] = evaluation.peak_bytes
                changes.update(evaluation.changes)
            peak = max(by.values())
            used = int(peak * need_ratio) + budget.outside_bytes
            # a paged optimizer's state (not in the peaks): page traffic when the run leaves it no room
            paged = 0 if fit.has_state else model.optimizers[optim].paged_bytes
            traffic = paged_traffic_bytes(paged, budget.budget_bytes - used)
            t = timer.seconds(setup.replace(**changes), fit.params, fit.trainable_params,
                              paged_traffic=traffic) / base_time_s
            ranked.append(Candidate(used <= budget.budget_bytes, tier, t, len(changes), used, peak, changes))
    ranked.sort(key=Candidate.sort_key)
    return ranked
