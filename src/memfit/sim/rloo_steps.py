"""RLOOTrainer's step (TRL 1.16): generation, scoring and the training micro-step, on fake (or real CPU) tensors.

RLOOTrainer (trl/trainer/rloo_trainer.py) runs GRPOTrainer's code path up to the rewards: the same
`_prepare_inputs` buffer (`generation_batch_size` completions generated every `steps_per_generation x
num_iterations` micro-steps, split into micro-batches), the same `_generate_single_turn` (transformers' `generate`
or vLLM), the same `_get_per_token_logps_and_entropies` (its source is GRPOTrainer's, line for line;
tests/sim/test_rloo.py checks it) and the same reference model rule (`beta > 0`: a second copy of the weights; with
peft the adapter disabled instead). So the generation phase, every scoring pass and the layer splicing are
memfit.sim.grpo_steps' own functions. What differs (`_generate_and_score_completions`, `_compute_loss`):

- scoring: the old log-probs are always computed (`[G, C]`, then their masked sum `old_logps` `[G]`, which the
  buffer keeps instead of the per-token values); with `beta > 0` the reference's `[G, C]` log-probs turn into a
  sequence-level KL penalty on the rewards (`(old - ref) * mask` summed over tokens), not a per-token loss term;
  the leave-one-out baseline of each prompt group gives the advantages `[G]`;
- the loss: the policy's per-token log-probs and entropy `[B, C]` (TRL's fused LM head), summed per sequence,
  a sequence-level importance ratio `[B]`, two-sided clipping, the mean over the micro-batch (returned unscaled:
  Trainer divides it by the accumulation, as memfit.sim.engine does).

RLOOConfig's defaults differ from GRPOConfig's where memory depends on them: `beta=0.05` (a reference model by
default) and `num_generations=2` (memfit.train_setup resolves both when they are not given).

Known limitations: as for GRPO, TRL's logging metrics (the KL and entropy means, clip ratios: device scalars and
`[B, C]` temporaries freed at once) are not simulated; rewards come from reward functions on the
host (a reward *model* on the GPU is not modelled); `normalize_advantages` and `reward_clip_range` change `[G]`
tensors only. Unscorable rewards are marked with an in-place `masked_fill_` where TRL writes `rewards[mask] = nan`
(an index_put with a boolean mask, whose `[k]` index tensor is data-dependent).
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.sim import _trl_adapter as trl_adapter
from memfit.sim import grpo_steps

__all__ = ["micro_loss", "evaluation", "score", "loss"]

#: RLOOConfig's clipping defaults (TRL 1.16 rloo_config.py: epsilon 0.2, epsilon_high None -> epsilon).
_EPSILON_LOW = _EPSILON_HIGH = 0.2


def score(runner: Any, g: int, p: int, c: int, *, evaluation: bool = False) -> dict[str, torch.Tensor]:
    """RLOOTrainer._generate_and_score_completions on the device: the generation batch it returns (`evaluation`:
    the eval batch, scored in chunks of `per_device_eval_batch_size`, groups of `num_generations_eval`)."""
    s = runner.setup
    tr = runner.tracker
    batch = {"prompt_ids": grpo_steps._longs(g, p), "prompt_mask": grpo_steps._longs(g, p),
             "completion_ids": grpo_steps._longs(g, c), "completion_mask": grpo_steps._longs(g, c)}
    for t in batch.values():
        tr.register(t, "inputs")
    prompt_completion_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (G, P+C)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    b = s.per_device_eval_batch_size if evaluation else s.per_device_train_batch_size
    mask = batch["completion_mask"]
    ref_per_token_logps = None
    with torch.no_grad(), grpo_steps._checkpointing_off(runner):
        old_per_token_logps, _, _ = grpo_steps._log_probs(runner, runner.fwd_model, prompt_completion_ids,
                                                          attention_mask, c, batch_size=b, spliced=True)
        batch["old_logps"] = (old_per_token_logps * mask).sum(1)
        if s.beta != 0.0:
            if runner.ref_model is not None:
                ref, tagger = grpo_steps._reference(runner)
                ref_per_token_logps, _, _ = grpo_steps._log_probs(runner, ref, prompt_completion_ids, attention_mask,
                                                                  c, batch_size=b, tagger=tagger, spliced=True)
            else:  # peft: the adapter disabled is the reference
                with runner.fwd_model.disable_adapter():
                    ref_per_token_logps, _, _ = grpo_steps._log_probs(runner, runner.fwd_model,
                                                                      prompt_completion_ids, attention_mask, c,
                                                                      batch_size=b, spliced=True)
    # rewards [G, functions] on the device (one function), weighted and summed; unscorable rows NaN
    rewards_per_func = grpo_steps.reward_scores(runner, g, p + c)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * torch.ones(1).unsqueeze(0)).nansum(dim=1)
    rewards.masked_fill_(unscorable_mask, float("nan"))
    if s.beta != 0.0:  # the sequence-level KL penalty on the rewards
        per_token_kl = old_per_token_logps - ref_per_token_logps
        kl = (per_token_kl * mask).sum(-1)
        rewards = rewards - s.beta * kl
        del per_token_kl, kl
    grouped = rewards.view(-1, grpo_steps.eval_generations(s) if evaluation else s.num_generations)
    mean_grouped = torch.nanmean(grouped, dim=1)
    std_rewards = trl_adapter.nanstd(grouped, dim=1)
    # the leave-one-out baseline over each group's scorable siblings
    scorable_counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped, dim=1, keepdim=True)
    baselines = ((grouped_sum - grouped) / (scorable_counts - 1)).view(-1)
    advantages = torch.nan_to_num(rewards - baselines, nan=0.0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # for logging
    all_process_advantages = advantages.clone()  # the aggregated advantages, for logging
    batch["advantages"] = advantages[slice(0, g)]  # this process's slice (one process: all of it)
    del (prompt_completion_ids, attention_mask, old_per_token_logps, ref_per_token_logps, rewards_per_func,
         unscorable_mask, rewards, grouped, mean_grouped, std_rewards, scorable_counts, grouped_sum, baselines,
         advantages, is_std_zero, all_process_advantages)
    return batch


def loss(runner: Any, inputs: dict[str, torch.Tensor], *, evaluation: bool = False) -> torch.Tensor:
    """RLOOTrainer._compute_loss: sequence-level ratio, clipped, the micro-batch mean (values do not change the
    trace); `evaluation`: under prediction_step's no_grad, the forward spliced as it returns."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)
    c = completion_ids.size(1)
    per_token_logps, entropies, _ = grpo_steps._log_probs(runner, runner.fwd_model, input_ids, attention_mask, c,
                                                          compute_entropy=True, spliced=evaluation)
    del input_ids, attention_mask
    logps = (per_token_logps * mask).sum(1)
    log_ratio = logps - inputs["old_logps"]
    advantages = inputs["advantages"]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - _EPSILON_LOW, 1 + _EPSILON_HIGH)
    per_sequence_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    out = per_sequence_loss.mean()
    del entropies
    return out


def micro_loss(runner: Any) -> tuple[torch.Tensor, int]:
    """The loss of one RLOO micro-step: GRPOTrainer's buffer (`RLOOTrainer._prepare_inputs`) filled by RLOO's
    scoring, and RLOO's loss."""
    return grpo_steps.micro_loss(runner, score=score, loss=loss)


def evaluation(runner: Any) -> torch.Tensor:
    """RLOOTrainer.prediction_step (GRPOTrainer's, line for line): one eval batch generated, scored by RLOO's
    scoring and its loss under no_grad (memfit.sim.grpo_steps.evaluation)."""
    return grpo_steps.evaluation(runner, score=score, loss=loss)
