"""Recovery from out-of-memory errors inside a running TRL `RLOOTrainer` (TRL 1.16), for `memfit.fit`.

RLOOTrainer's micro-step is GRPOTrainer's (rloo_trainer.py `_prepare_inputs`, `training_step` and
`_get_per_token_logps_and_entropies` are the same code): once per generation batch the completions are generated
and scored (the old log-probs always, the reference's when `beta` is not 0) and the batch is buffered as
`steps_per_generation` shuffled micro-batches. memfit.fitting.grpo_recovery's `GrpoTrainingStep` recovers in the
three kinds of work; `RlooTrainingStep` holds what differs:

- generation: `_generate_single_turn(prompt_ids, images, multimodal_fields)` takes no `num_generations` and returns
  the completion ids alone. The generation batch is generated in `p` calls of its rows as for GRPO. The rewards,
  the KL penalty, the leave-one-out baseline over each prompt's `num_generations` completions and
  `normalize_advantages` are all computed after `_generate` returns, over the whole generation batch
  (`_generate_and_score_completions`), so a call needs no whole groups: the groups are whole when they are scored.
- training: `_compute_loss` is `per_sequence_loss.mean()` over the micro-batch's completions, each completion's
  loss depending on its own row alone (its log-probs, `old_logps`, `advantages`, all precomputed for the whole
  generation batch; the micro-batches are shuffled rows, so a group is spread over them already). A chunk's loss
  weighted by its share of the completions sums to the micro-batch's loss (memfit.fitting.grpo_recovery
  `row_shares`). Not split: an MoE auxiliary loss (`aux_loss_enabled`: averaged per forward, rloo_trainer.py
  `_compute_loss`).
- scoring: as GRPO's (TRL's `batch_size` chunks halved); RLOO always scores the old log-probs (they make `old_logps`
  and the KL penalty), so only `beta=0` (no reference pass) lowers it besides the chunks.
"""

from __future__ import annotations

from typing import Any, Callable

from memfit.fitting.grpo_recovery import GrpoTrainingStep, row_shares
from memfit.sim import _trl_adapter as trl_adapter

__all__ = ["RlooTrainingStep", "rloo_chunk_refusal"]


def rloo_chunk_refusal(state: dict[str, Any]) -> str | None:
    """Why an RLOO training micro-batch cannot be split without changing its loss (None: it can)."""
    if state["aux_loss"]:
        return "the MoE router's auxiliary loss is averaged per forward"
    return None


class RlooTrainingStep(GrpoTrainingStep):
    """The replacement for an RLOOTrainer's `training_step`; see the module docstring."""

    name = "RLOO"
    scoring_advice = "lower max_completion_length, or set beta=0 so that the reference model scores nothing"

    @staticmethod
    def read_state(trainer: Any) -> dict[str, Any]:
        return trl_adapter.rloo_state(trainer)

    def chunk_refusal(self) -> str | None:
        return rloo_chunk_refusal(self.state)

    def _weights(self, parts, num_items, model):
        return row_shares(parts)

    def _guard_generation(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """RLOOTrainer's `_generate_single_turn(prompt_ids, images, multimodal_fields) -> completion ids`."""
        def generate(prompt_ids, images, multimodal_fields):
            ids, _ = self._generate_guarded(lambda p, i, f: (original(p, i, f), None), prompt_ids, images,
                                            multimodal_fields)
            return ids

        return generate
