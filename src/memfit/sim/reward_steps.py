"""RewardTrainer's step (TRL 1.16): a one-score sequence-classification model over chosen / rejected pairs.

RewardTrainer (trl/trainer/reward_trainer.py) loads the model with `AutoModelForSequenceClassification(...,
num_labels=1)` (memfit.train_setup makes the task `seq-cls`, one label) and sets `config.pad_token_id`, which the
head needs to find each sequence's last token. Its collator (`DataCollatorForPreference.torch_call`) puts the
chosen sequences, then the rejected ones, in one right-padded batch: `[2B, S]` `input_ids` and `attention_mask`, S
the longest of the batch (RewardTrainer filters out pairs longer than `max_length`, it does not truncate them).
`compute_loss` runs one forward over the `2B` sequences (`use_cache=False`, no labels), splits the `[2B, 1]`
scores with `torch.chunk` and takes `-logsigmoid(chosen - rejected).mean()`. Everything else (backward, clipping,
the optimizer, accumulation: the loss is divided by it, the batch has no `labels`) is the Trainer's, which
memfit.sim.engine runs. `activation_offloading=True`: the step runs in TRL's offloading context, as SFT's.

Known limitations: the metrics RewardTrainer logs (the scores gathered, their min / mean / max, the accuracy and
margin: a few device scalars under no_grad), the optional `margin` column and `center_rewards_coefficient` (one
`[B]` term) are not simulated; evaluation is simulated as Trainer's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from memfit.sim.autocast import cuda_autocast

__all__ = ["reward_batch", "micro_loss"]


def reward_batch(setup: Any) -> dict[str, torch.Tensor]:
    """The tensors of DataCollatorForPreference on the device: chosen then rejected, right-padded `[2B, S]`."""
    b2, seq = 2 * setup.per_device_train_batch_size, setup.sequence_length
    tensors = {"input_ids": torch.zeros(b2, seq, dtype=torch.long), "attention_mask": torch.ones(b2, seq, dtype=torch.long)}
    tensors["attention_mask"][-1, -1:].zero_()  # chosen and rejected differ in length: padded
    return tensors


def micro_loss(runner: Any) -> tuple[torch.Tensor, int]:
    """RewardTrainer.compute_loss of one micro-batch (forward phase), and the index of the first record after the
    batch."""
    from memfit.sim.offload import runner_activation_offloading as activation_offloading

    tensors = reward_batch(runner.setup)
    for t in tensors.values():
        runner.tracker.register(t, "inputs")
    start = len(runner.tracker.records)
    with activation_offloading(runner):
        with cuda_autocast(runner.low):
            out = runner.fwd_model(**tensors, use_cache=False)
        if runner.low is not None:
            from accelerate.utils import convert_to_fp32  # accelerate's ConvertOutputsToFp32

            out = convert_to_fp32(out)
        rewards_chosen, rewards_rejected = torch.chunk(out.logits.squeeze(-1), chunks=2)
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
        del out, rewards_chosen, rewards_rejected
    del tensors
    return loss, start
