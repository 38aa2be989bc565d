"""Recovery from out-of-memory errors inside a running TRL `DistillationTrainer` (TRL 1.16), for `memfit.fit`.

A distillation micro-step (distillation_trainer.py) is, once per accumulation window, on-policy generation
(`_prepare_inputs`: the student generates one completion for each of the `per_device_train_batch_size x
gradient_accumulation_steps` prompts of the window in one `_generate_single_turn` call, transformers' `generate`),
the padded batch buffered as `gradient_accumulation_steps` micro-batches (`_buffered_inputs`, picked by the
trainer's own micro-step counter `_step`); then, every micro-step, `_compute_loss` on one of them: the student's
backbone with gradients, the teacher's backbone under no_grad, and the chunked divergence of their LM heads
(`_chunked_divergence_loss`). `DistillTrainingStep` replaces `trainer.training_step` (GRPOTrainer's step,
memfit.fitting.grpo_recovery.GrpoTrainingStep, whose generation split, retry loop and buffered micro-step it
reuses: DistillationTrainer's `_prepare_inputs` buffer and `training_step` bookkeeping are GRPOTrainer's code) and
recovers in:

- generation: the window's prompts are generated in `p` calls of `1/p` of them (`p` doubling after each OOM, kept
  for the rest of the run), the same prompts and sampling settings, one completion each. The torch RNG state of
  the failed call is restored before the retry, so the retry draws as a run generating in `p` calls from the start
  (`generate` samples the rows of a batch together at each token: other draws of the same distribution, not the
  tokens of one call).
- the teacher's forward and training: both run inside the micro-step's `compute_loss`, so an OOM in either splits
  the micro-batch (memfit.fitting.recovery.ChunkedTrainingStep): `c` chunks of whole completions, each running the
  student and the teacher on its rows only, and the window's earlier micro-steps recomputed from their host copies.
  Every chunk's weight is 1: `_chunked_divergence_loss` sums the per-token divergence of the chunk and divides by
  `num_items_in_batch`, the window's completion-token count that `_generate_and_score_completions` put in each
  micro-batch as a 0-dim tensor (every chunk keeps it whole), so the chunks' losses sum to the micro-batch's (the
  per-token divergence of a row depends on that row alone: its own attention, its own head projections).
  Nothing is generated again and `_step` advances once per micro-step, so the buffer is read in TRL's order; the
  batch sizes, the optimizer steps and the loss are unchanged. The `entropy` metric is appended once per chunk (its
  logged mean weights chunks, not tokens).

Not split (the OOM is raised with one line saying why): a training micro-batch that carries images (its
`pixel_values` are split per image, not per row); generation in vLLM (its pre-allocated share) or with images in
the prompts. Several processes (DDP, FSDP, DeepSpeed): as for GRPO, memfit.fit does not recover inside the trainer
there (a note says so).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from memfit.fitting import distributed as dist_sync
from memfit.fitting import engines
from memfit.fitting.grpo_recovery import GrpoTrainingStep
from memfit.fitting.recovery import ChunkedTrainingStep, Meter, Recovery
from memfit.sim import _trl_adapter as trl_adapter

logger = logging.getLogger("memfit.fit")

__all__ = ["DistillTrainingStep", "MULTIMODAL_KEYS", "chunk_refusal"]

#: The image fields `_generate_and_score_completions` adds to a micro-batch (distillation_trainer.py `_compute_loss`
#: `multimodal_keys`, and `num_images` / `num_tiles`, per-example lists that `_split` would not slice).
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                   "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images", "num_tiles")


def chunk_refusal(micro_batch: dict[str, Any] | None) -> str | None:
    """Why a DistillationTrainer micro-batch cannot be split without changing what is learned (None: it can)."""
    held = [k for k in MULTIMODAL_KEYS if micro_batch is not None and k in micro_batch]
    if held:
        return (f"it carries images (`{held[0]}`), split per image by TRL (`split_pixel_values_by_grid`), not per "
                "completion")
    return None


class DistillTrainingStep(GrpoTrainingStep):
    """The replacement for a DistillationTrainer's `training_step`; see the module docstring."""

    name = "distillation"
    #: DistillationConfig has no generation_batch_size: the window's prompts are the batch x accumulation
    generation_advice = "lower max_completion_length or per_device_train_batch_size x gradient_accumulation_steps"

    def kept_in_generation(self) -> str:
        return "same prompts, one completion each, same sampling settings"

    @staticmethod
    def read_state(trainer: Any) -> dict[str, Any]:
        return trl_adapter.distill_state(trainer)

    def __init__(self, trainer: Any, *, max_recoveries: int, meter: Meter, recoveries: list[Recovery],
                 on_change: Callable[[str], None], on_note: Callable[[str], None] | None = None) -> None:
        # GrpoTrainingStep's set-up without its scoring guard: DistillationTrainer scores nothing (no old or
        # reference log-probs; the teacher runs inside the loss)
        ChunkedTrainingStep.__init__(self, trainer, max_recoveries=max_recoveries, meter=meter, recoveries=recoveries,
                                     on_change=on_change)
        self.state = self.read_state(trainer)
        self.original = self._prepared_micro_step  # what ChunkedTrainingStep runs per chunk
        self.generation_parts = 1  #: calls the window's prompts are generated in
        self.scoring_batch_size = None  #: nothing is scored
        self.generation_calls = 0  #: generate calls made
        self.guarded = not (dist_sync.is_distributed() or engines.engine_of(trainer) is not None)
        self._undo: list[Callable[[], None]] = []
        if not self.guarded:
            if on_note is not None:
                on_note("distillation with several processes or under DeepSpeed / FSDP: memfit.fit does not recover "
                        "from an out-of-memory error inside generation or a distillation micro-step there (their "
                        "collectives would be left unmatched by a rank that retries alone)")
            return
        self._undo.append(trl_adapter.wrap_grpo_method(trainer, "_generate_single_turn", self._guard_generation))

    def summary(self) -> dict[str, Any]:
        """What the run generated with (FitReport.rl)."""
        return {"generation_batch_size": self.state["generation_batch_size"],
                "steps_per_generation": self.state["steps_per_generation"],
                "num_generations": self.state["num_generations"],
                "generation_calls_per_batch": self.generation_parts,
                "generate_calls": self.generation_calls}

    # -- training: every chunk weighs 1 (module docstring) ------------------------------------------------------
    def _weights(self, parts, num_items, model):
        return [1.0] * len(parts)

    def chunk_refusal(self) -> str | None:
        return chunk_refusal(self.window[-1][0] if self.window else None)

    def _recover(self, model, failure):
        why = self.chunk_refusal()
        if why:
            raise torch.OutOfMemoryError(
                f"memfit: out of memory in a distillation micro-step at optimizer step "
                f"{self.trainer.state.global_step}; its micro-batch cannot be split without changing what is learned "
                f"({why}): lower per_device_train_batch_size and raise gradient_accumulation_steps by the same "
                f"factor. Last error: {failure[0]}")
        return ChunkedTrainingStep._recover(self, model, failure)

    # -- generation ---------------------------------------------------------------------------------------------
    def _generation_refusal(self, images: Any, multimodal_fields: Any) -> str | None:
        if self.state["use_vllm"]:
            return ("generation runs in vLLM, in its pre-allocated share: lower vllm_gpu_memory_utilization's "
                    "KV cache need (max_completion_length, the batch) or the share the training step leaves")
        if images is not None or multimodal_fields:
            return "the prompts carry images"
        return None

    def _guard_generation(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """DistillationTrainer's `_generate_single_turn(prompt_ids, images, multimodal_fields,
        has_tool_images=False)`, which returns the completion ids only."""
        def generate(prompt_ids, images, multimodal_fields, *args, **kwargs):
            ids, _ = self._generate_guarded(
                lambda p, imgs, fields: (original(p, imgs, fields, *args, **kwargs), None),
                prompt_ids, images, multimodal_fields)
            return ids

        return generate
