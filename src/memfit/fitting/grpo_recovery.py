"""Recovery from out-of-memory errors inside a running TRL `GRPOTrainer` (TRL 1.16), for `memfit.fit`.

A GRPO micro-step is three kinds of work (grpo_trainer.py `_prepare_inputs`): once per generation batch, the
completions are generated (`_generate_single_turn`: transformers' `generate` on `generation_batch_size`
sequences) and scored (`_get_per_token_logps_and_entropies` under no_grad: the old log-probs, the reference
log-probs), and the batch is buffered as `steps_per_generation` micro-batches; every micro-step then runs the
loss forward and backward on one of them. `GrpoTrainingStep` replaces `trainer.training_step` and recovers in
each:

- generation: the generation batch is generated in `p` calls of `generation_batch_size / p` sequences
  (`p` doubling after each OOM, kept for the rest of the run), with the same prompts, the same
  `num_generations` completions per prompt and the same sampling settings. The torch RNG state of the
  failed call is restored before the retry, so the retry draws from the same stream as a run that
  generated in `p` calls from the start; it is not the stream of one call of the whole batch (`generate`
  samples the rows of a batch together at each token), so the completions are other draws of the same
  distribution, not the same tokens.
- scoring: TRL's own chunking of the log-prob passes (`batch_size`, by default `per_device_train_batch_size`)
  is halved after each OOM (kept for the rest of the run). Each row is scored on its own, so the log-probs
  are those of the unchunked pass (up to float rounding of a smaller matmul).
- training: as for every trainer (memfit.fitting.recovery.ChunkedTrainingStep): the micro-batch runs as
  `c` chunks of whole completions, each weighted so that the sum is the micro-batch's loss for TRL's
  `loss_type` (1 for `dapo` / `cispo` / `vespo`, normalised by the generation batch's token count; the
  share of completions for `grpo` / `sapo` / `dr_grpo` / `luspo`; the share of completion tokens for
  `bnpo`), and the accumulation window is recomputed from the prepared micro-batches kept on the host.
  Nothing is generated again; `per_device_train_batch_size`, `gradient_accumulation_steps`,
  `steps_per_generation` and `generation_batch_size` stay what TRL derived, so the optimizer steps, the
  completions per step and the loss are unchanged. TRL's logged metrics (entropy, clip ratios) are
  appended once per chunk: their logged means weight chunks, not completions.

Not split (the OOM is raised with one line saying why): a training micro-batch with the entropy bonus
(`entropy_coef` / adaptive entropy: a token-weighted term next to the loss's own weights), a
`top_entropy_quantile < 1` (its quantile is taken over the micro-batch) or an MoE auxiliary loss (averaged
per forward); generation in vLLM (its memory is its pre-allocated share: lower `vllm_gpu_memory_utilization`
or the batch), with transformers' continuous batching, a `rollout_func` or images. Several processes (DDP,
FSDP, DeepSpeed): GRPO's loss and generation hold collectives (metric gathers, parameter gathers) that a rank
retrying alone would leave unmatched, so memfit.fit does not recover inside GRPO there (a note says so).

RLOOTrainer runs the same `_prepare_inputs`, scoring and `training_step` (rloo_trainer.py): `GrpoTrainingStep` is
the step of both, and memfit.fitting.rloo_recovery's subclass holds what differs (its generate call, its loss's
weights, what it refuses to split).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from memfit.fitting import distributed as dist_sync
from memfit.fitting import engines
from memfit.fitting.recovery import (ChunkedTrainingStep, Meter, Recovery, _batch_size, _rng_state, _set_rng_state,
                                     free_memory, is_oom_error, oom_cause)
from memfit.sim import _trl_adapter as trl_adapter
from memfit.trace import GENERATION, SCORING

logger = logging.getLogger("memfit.fit")

__all__ = ["GrpoTrainingStep", "chunk_weights", "chunk_refusal", "row_shares", "split_bounds", "SUM_LOSSES",
           "ROW_MEAN_LOSSES", "TOKEN_MEAN_LOSSES"]

#: GRPOTrainer `_compute_loss` (TRL 1.16): how each loss_type reduces a micro-batch of B completions.
#: sum over tokens / num_items_in_batch of the whole generation batch: a chunk's loss is its share already
SUM_LOSSES = ("dapo", "cispo", "vespo")
#: a mean over the B rows (of per-row means for grpo / sapo, of per-row sums for luspo, sum / (B x L) for dr_grpo)
ROW_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")
#: sum over tokens / the micro-batch's own token count
TOKEN_MEAN_LOSSES = ("bnpo",)


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous, non-empty slices of `n` items, as even as they can be."""
    parts = max(1, min(parts, n))
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def chunk_refusal(state: dict[str, Any]) -> str | None:
    """Why a GRPO training micro-batch cannot be split without changing its loss (None: it can)."""
    if state["entropy_bonus"]:
        return ("the entropy bonus (entropy_coef / use_adaptive_entropy) is a token mean of the micro-batch next "
                "to a loss weighted otherwise")
    if state["top_entropy_quantile"] < 1.0:
        return f"top_entropy_quantile={state['top_entropy_quantile']} masks tokens by a quantile of the micro-batch"
    if state["aux_loss"]:
        return "the MoE router's auxiliary loss is averaged per forward"
    if state["loss_type"] not in SUM_LOSSES + ROW_MEAN_LOSSES + TOKEN_MEAN_LOSSES:
        return f"loss_type `{state['loss_type']}` is not one memfit knows how to weight"
    return None


def row_shares(parts: list[dict[str, Any]]) -> list[float]:
    """Each chunk's share of the micro-batch's completions: the weights of a loss that is a mean over completions."""
    counts = [_batch_size(p) for p in parts]
    total = sum(counts) or 1
    return [c / total for c in counts]


def chunk_weights(parts: list[dict[str, Any]], loss_type: str) -> list[float]:
    """The weight of each chunk's loss so that their sum is the micro-batch's loss (see the module docstring)."""
    if len(parts) == 1 or loss_type in SUM_LOSSES:
        return [1.0] * len(parts)
    if loss_type in ROW_MEAN_LOSSES:
        return row_shares(parts)
    else:  # TOKEN_MEAN_LOSSES: the loss mask of _compute_loss (completion_mask x tool_mask)
        counts = []
        for p in parts:
            mask = p["completion_mask"] if "tool_mask" not in p else p["completion_mask"] * p["tool_mask"]
            counts.append(int(mask.sum()))
    total = sum(counts) or 1
    return [c / total for c in counts]


class GrpoTrainingStep(ChunkedTrainingStep):
    """The replacement for a GRPOTrainer's `training_step`; see the module docstring."""

    #: the trainer's name in messages
    name = "GRPO"
    #: what lowers the scoring pass's memory besides its chunks (GRPOTrainer scores nothing with beta=0 and
    #: num_iterations=1: grpo_trainer.py `_generate_and_score_completions`)
    scoring_advice = "lower max_completion_length, or set beta=0 and num_iterations=1 so that nothing is scored"
    #: what lowers generation's memory when even one sequence per call does not fit
    generation_advice = "lower max_completion_length or generation_batch_size"

    def kept_in_generation(self) -> str:
        """What a split generation keeps (the recovery's change line)."""
        return f"same prompts, {self.state['num_generations']} completions per prompt, same sampling settings"

    @staticmethod
    def read_state(trainer: Any) -> dict[str, Any]:
        return trl_adapter.grpo_state(trainer)

    def chunk_refusal(self) -> str | None:
        """Why this trainer's training micro-batch cannot be split without changing its loss (None: it can)."""
        return chunk_refusal(self.state)

    def __init__(self, trainer: Any, *, max_recoveries: int, meter: Meter, recoveries: list[Recovery],
                 on_change: Callable[[str], None], on_note: Callable[[str], None] | None = None) -> None:
        super().__init__(trainer, max_recoveries=max_recoveries, meter=meter, recoveries=recoveries,
                         on_change=on_change)
        self.state = self.read_state(trainer)
        self.original = self._prepared_micro_step  # what ChunkedTrainingStep runs per chunk
        self.generation_parts = 1  #: calls the generation batch is generated in
        self.scoring_batch_size: int | None = None  #: None: TRL's own (per_device_train_batch_size)
        self.generation_calls = 0  #: generate calls made (after the split: `generation_parts` per batch)
        self.guarded = not (dist_sync.is_distributed() or engines.engine_of(trainer) is not None)
        self._undo: list[Callable[[], None]] = []
        if not self.guarded:
            if on_note is not None:
                on_note(f"{self.name} with several processes or under DeepSpeed / FSDP: memfit.fit does not recover "
                        f"from an out-of-memory error inside generation, scoring or a {self.name} micro-step there "
                        "(their collectives would be left unmatched by a rank that retries alone)")
            return
        self._undo.append(trl_adapter.wrap_grpo_method(trainer, "_generate_single_turn", self._guard_generation))
        self._undo.append(trl_adapter.wrap_grpo_method(trainer, "_get_per_token_logps_and_entropies",
                                                       self._guard_scoring))

    def uninstall(self) -> None:
        super().uninstall()
        for undo in self._undo:
            undo()
        self._undo = []

    def summary(self) -> dict[str, Any]:
        """What the run generated and scored with (FitReport.rl)."""
        return {"generation_batch_size": self.state["generation_batch_size"],
                "steps_per_generation": self.state["steps_per_generation"],
                "num_generations": self.state["num_generations"],
                "generation_calls_per_batch": self.generation_parts,
                "scoring_batch_size": self.scoring_batch_size or int(self.trainer.args.per_device_train_batch_size),
                "generate_calls": self.generation_calls}

    # -- a micro-step ----------------------------------------------------------------------------
    def __call__(self, model, inputs, num_items_in_batch=None):
        started = time.perf_counter()
        prepared = trl_adapter.grpo_prepare_inputs(self.trainer, model, inputs)  # generation and scoring when due
        if self.guarded:
            loss = super().__call__(model, prepared, num_items_in_batch)
        else:
            loss = self._prepared_micro_step(model, prepared, num_items_in_batch)
        trl_adapter.grpo_step_done(self.trainer, time.perf_counter() - started)
        return loss

    def _prepared_micro_step(self, model, prepared, num_items_in_batch):
        return trl_adapter.grpo_micro_step(self.trainer, model, prepared, num_items_in_batch)

    def _weights(self, parts, num_items, model):
        return chunk_weights(parts, self.state["loss_type"])

    def _recover(self, model, failure):
        why = self.chunk_refusal()
        if why:
            raise torch.OutOfMemoryError(
                f"memfit: out of memory in a {self.name} micro-step at optimizer step {self.trainer.state.global_step}; its "
                f"micro-batch cannot be split without changing the loss ({why}): lower per_device_train_batch_size "
                f"and raise steps_per_generation by the same factor. Last error: {failure[0]}")
        return super()._recover(model, failure)

    # -- generation ------------------------------------------------------------------------------
    def _generation_refusal(self, images: Any, multimodal_fields: Any) -> str | None:
        if self.state["use_vllm"]:
            return ("generation runs in vLLM, in its pre-allocated share: lower vllm_gpu_memory_utilization's "
                    "KV cache need (max_completion_length, the batch) or the share the training step leaves")
        if self.state["continuous_batching"]:
            return "transformers' continuous batching schedules its own batches"
        if images is not None or multimodal_fields:
            return "the prompts carry images"
        return None

    def _guard_generation(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """GRPOTrainer's `_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, ...)`, which
        returns (completion ids, log-probs or None)."""
        def generate(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            return self._generate_guarded(
                lambda ids, imgs, fields: original(ids, imgs, fields, num_generations, *args, **kwargs),
                prompt_ids, images, multimodal_fields)

        return generate

    def _generate_guarded(self, call: Callable[..., tuple[list[Any], Any]], prompt_ids: list[Any], images: Any,
                          multimodal_fields: Any) -> tuple[list[Any], Any]:
        """`call(prompt_ids, images, multimodal_fields) -> (completion ids, log-probs or None)` for the generation
        batch, in `generation_parts` calls of its rows when it can be split."""
        why = self._generation_refusal(images, multimodal_fields)
        if why:
            self.generation_calls += 1
            try:
                return call(prompt_ids, images, multimodal_fields)
            except Exception as exc:  # noqa: BLE001
                if not is_oom_error(exc):
                    raise
                cause = oom_cause(exc)[0]
            raise torch.OutOfMemoryError(
                f"memfit: out of memory in {self.name} generation at optimizer step {self.trainer.state.global_step}; "
                f"not split ({why}). Last error: {cause}")
        # the retry draws as a run generating in this many calls from the start
        return self._until_it_fits(
            GENERATION, lambda: self._generate_in_parts(call, prompt_ids),
            lambda cause, tried: self._split_generation(len(prompt_ids), cause, tried))

    def _until_it_fits(self, phase: str, attempt: Callable[[], Any],
                       shrink: Callable[[str, int | None], None]) -> Any:
        """`attempt()` until it runs without an OOM, calling `shrink(cause, requested_bytes)` after each one (it
        raises when nothing is left to shrink); each retry starts from the random state of the first attempt, and
        the meter records `phase`'s peak of the attempt that ran."""
        rng = _rng_state()
        while True:
            self.meter.reset()
            try:
                out = attempt()
                self.meter.record(phase)
                return out
            except Exception as exc:  # noqa: BLE001 - only OOMs are handled
                if not is_oom_error(exc):
                    raise
                cause, tried = oom_cause(exc)
                exc = None  # drop the traceback (it holds the failed attempt's tensors)
            free_memory()
            shrink(cause, tried)
            _set_rng_state(rng)

    def _generate_in_parts(self, call, prompt_ids):
        completion_ids: list[Any] = []
        logprobs: list[Any] | None = []
        for a, b in split_bounds(len(prompt_ids), self.generation_parts):
            self.generation_calls += 1
            ids, lps = call(prompt_ids[a:b], None, {})
            completion_ids.extend(ids)
            logprobs = None if lps is None or logprobs is None else logprobs + list(lps)
        return completion_ids, logprobs

    def _split_generation(self, n: int, cause: str, tried: int | None) -> None:
        step = self.trainer.state.global_step
        used = sum(1 for r in self.recoveries if r.phase == GENERATION)
        if self.generation_parts >= n or used >= self.max_recoveries:
            raise torch.OutOfMemoryError(
                f"memfit: out of memory in {self.name} generation at optimizer step {step} even generating the {n} "
                f"sequences in {self.generation_parts} calls (recoveries: {used} of {self.max_recoveries}); "
                f"{self.generation_advice}. Last error: {cause}")
        old = self.generation_parts
        self.generation_parts = min(n, old * 2)
        per_call = max(b - a for a, b in split_bounds(n, self.generation_parts))
        change = (f"generation batch of {n} sequences now generated in {self.generation_parts} calls of <= "
                  f"{per_call} (was {old}); {self.kept_in_generation()}")
        self.recoveries.append(Recovery(step, GENERATION, change, cause, tried))
        self.on_change(f"out of memory at optimizer step {step} (generation): {cause} -> {change}")

    # -- scoring ---------------------------------------------------------------------------------
    def _guard_scoring(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def score(model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
            if torch.is_grad_enabled():  # the loss's own forward: ChunkedTrainingStep's chunks
                return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kwargs)
            def rows() -> int:
                n = batch_size or input_ids.size(0)
                return n if self.scoring_batch_size is None else min(n, self.scoring_batch_size)

            return self._until_it_fits(
                SCORING, lambda: original(model, input_ids, attention_mask, logits_to_keep, batch_size=rows(),
                                          **kwargs),
                lambda cause, tried: self._halve_scoring(rows(), cause, tried))

        return score

    def _halve_scoring(self, rows: int, cause: str, tried: int | None) -> None:
        step = self.trainer.state.global_step
        used = sum(1 for r in self.recoveries if r.phase == SCORING)
        if rows <= 1 or used >= self.max_recoveries:
            raise torch.OutOfMemoryError(
                f"memfit: out of memory scoring {self.name} completions at optimizer step {step} even {rows} at a "
                f"time (recoveries: {used} of {self.max_recoveries}); {self.scoring_advice}. Last error: {cause}")
        self.scoring_batch_size = max(1, rows // 2)
        change = (f"log-probs of the completions (old / reference) scored {self.scoring_batch_size} sequences at a "
                  f"time (was {rows}), in TRL's own chunks; the log-probs are unchanged")
        self.recoveries.append(Recovery(step, SCORING, change, cause, tried))
        self.on_change(f"out of memory at optimizer step {step} (scoring): {cause} -> {change}")
