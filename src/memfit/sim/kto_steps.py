"""KTOTrainer's step (TRL 1.16): unpaired preference data, a reference model, and the KL batch.

KTOTrainer (trl/trainer/kto_trainer.py) puts TRL's fused LM head on the policy (`outputs=("log_probs", "entropy",
"mean_logits")`) and on the reference (the default `("log_probs",)`); the reference is a second frozen copy of
the weights unless the model is a peft model (the adapter disabled instead) or `precompute_ref_log_probs`, as for
DPO (memfit.sim.trl_steps.build_reference). Its collator (`DataCollatorForUnpairedPreference.torch_call`) gives
each micro-batch of B examples `[B, S]` `input_ids` / `attention_mask` / `completion_mask` (prompt + completion
truncated to `max_length`, right-padded) and, with the default `loss_type="kto"`, the same three for the KL
batch: each prompt paired with another example's completion (`KL_completion_ids`, the completions rotated by one
within the batch), `[B, S]` too; the `label` of each example (`[B]` bool). `_compute_loss`, in its order:

- `_compute_kl_logps`: the KL batch through the policy under no_grad (the fused head's log-probs, summed);
- the policy's forward with grad: per-token log-probs `[B, S]` and their sum per example; chosen and rejected
  picked with `nonzero` + `index_select` (memfit takes `B - B // 2` desirable examples: the split changes `[B]`
  tensors only);
- the reference (no_grad, gradient checkpointing off): the KL batch and the batch again, unless precomputed (then
  two `[B]` fp32 columns come with the batch);
- the KL estimate (a scalar), `1 - sigmoid(beta x ...)` losses of each side, concatenated, `nanmean`.

`loss_type="apo_zero_unpaired"` estimates no KL term (`calculate_KL = loss_type not in ["apo_zero_unpaired"]`,
KTOTrainer.__init__): the dataset gets no `KL_completion_ids`, so the collator gives no `KL_*` tensors (and no
`ref_KL_logps` when precomputed), neither the policy nor the reference runs the KL batch (`_compute_kl_logps`
returns None), `kl` is `torch.zeros(1)`, and the losses are `1 - sigmoid(beta x chosen_logratios)` and
`sigmoid(beta x rejected_logratios)`; one example per micro-batch is allowed.

Trainer divides the loss by the accumulation (the batch has `label`, not `labels`: no `num_items_in_batch`), as
memfit.sim.engine does; `activation_offloading=True` wraps the step in TRL's offloading context.

Known limitations: the metrics (entropy and mean-logit sums, gathered counts: `[B, S]` temporaries under no_grad
and device scalars) are not simulated; the precompute pass before training (a no-grad forward) is not simulated;
evaluation is simulated as Trainer's (memfit.sim.trl_steps.notes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from memfit.sim.autocast import cuda_autocast

__all__ = ["kto_batch", "micro_loss", "calculates_kl"]

#: KTOConfig defaults (TRL 1.16 kto_config.py): desirable_weight / undesirable_weight 1.0 (values: no memory).
_DESIRABLE_WEIGHT = _UNDESIRABLE_WEIGHT = 1.0


def calculates_kl(setup: Any) -> bool:
    """KTOTrainer.__init__: `calculate_kl = args.loss_type not in ["apo_zero_unpaired"]`."""
    return setup.loss_type != "apo_zero_unpaired"


def kto_batch(setup: Any) -> dict[str, torch.Tensor]:
    """The tensors of DataCollatorForUnpairedPreference on the device (with the KL batch unless `apo_zero_unpaired`)."""
    b, seq = setup.per_device_train_batch_size, setup.sequence_length
    out: dict[str, torch.Tensor] = {}
    for prefix in ("", "KL_") if calculates_kl(setup) else ("",):
        out[f"{prefix}input_ids"] = torch.zeros(b, seq, dtype=torch.long)
        out[f"{prefix}attention_mask"] = torch.ones(b, seq, dtype=torch.long)
        out[f"{prefix}attention_mask"][-1, -1:].zero_()  # examples of different lengths: padded
        out[f"{prefix}completion_mask"] = torch.zeros(b, seq, dtype=torch.long)
    if setup.precompute_ref_log_probs:
        out["ref_logps"] = torch.zeros(b)
        if calculates_kl(setup):
            out["ref_KL_logps"] = torch.zeros(b)
    label = torch.zeros(b, dtype=torch.bool)  # torch.tensor of the examples' bool labels
    label[: b - b // 2] = True
    out["label"] = label
    return out


def _fused(runner: Any, model: torch.nn.Module, input_ids, attention_mask, labels):
    """`model(..., labels=labels, fused_lm_head=True)` as accelerate's prepared forward runs it."""
    with cuda_autocast(runner.low):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, labels=labels,
                    fused_lm_head=True)
    if runner.low is not None:
        from accelerate.utils import convert_to_fp32

        out = convert_to_fp32(out)
    return out


def _kl_logps(runner: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """KTOTrainer._compute_kl_logps: the KL batch through `model` under no_grad, log-probs summed per example (None
    without a KL term)."""
    if not calculates_kl(runner.setup):
        return None
    kl_labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
    with torch.no_grad():
        per_token = _fused(runner, model, batch["KL_input_ids"], batch["KL_attention_mask"], kl_labels).log_probs
    out = per_token[:, -(kl_labels.size(1) - 1):].sum(-1)
    del per_token, kl_labels
    return out


def _split(labels: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.nonzero(bool_labels).view(-1)` and the same of `~bool_labels`: `[k, 1]` int64 results of a
    data-dependent size, made here with the sizes kto_batch's labels give (a FakeTensor has no values; the
    indices' values, zeros here, do not change the trace)."""
    chosen = torch.zeros(b - b // 2, 1, dtype=torch.long).view(-1)
    inverted = ~labels
    rejected = torch.zeros(b // 2, 1, dtype=torch.long).view(-1)
    del inverted
    return chosen, rejected


def _loss(runner: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """KTOTrainer._compute_loss, `loss_type` `kto` or `apo_zero_unpaired` (beta from the setup; values do not change
    the trace)."""
    s = runner.setup
    model = runner.fwd_model
    labels = batch["label"]
    num_chosen = labels.sum()
    num_rejected = len(labels) - num_chosen
    kl_logps = _kl_logps(runner, model, batch)
    completion_labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    outputs = _fused(runner, model, batch["input_ids"], batch["attention_mask"], completion_labels)
    seq_len = batch["input_ids"].size(1) - 1
    completion_logps = outputs.log_probs[:, -seq_len:].sum(-1)
    bool_labels = torch.as_tensor(labels, dtype=torch.bool)
    chosen_idx, rejected_idx = _split(bool_labels, labels.size(0))
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    if s.precompute_ref_log_probs:
        ref_chosen = batch["ref_logps"].index_select(0, chosen_idx)
        ref_rejected = batch["ref_logps"].index_select(0, rejected_idx)
        ref_kl_logps = batch.get("ref_KL_logps")
    else:
        from memfit.sim.grpo_steps import _checkpointing_off

        with torch.no_grad(), _checkpointing_off(runner):
            if runner.ref_model is None:  # peft: the adapter disabled is the reference
                with runner.model.disable_adapter():
                    ref_kl_logps = _kl_logps(runner, model, batch)
                    ref_outputs = _fused(runner, model, batch["input_ids"], batch["attention_mask"],
                                         completion_labels)
            else:
                ref_kl_logps = _kl_logps(runner, runner.ref_model, batch)
                ref_outputs = _fused(runner, runner.ref_model, batch["input_ids"], batch["attention_mask"],
                                     completion_labels)
        ref_completion_logps = ref_outputs.log_probs[:, -seq_len:].sum(-1)
        del ref_outputs
        ref_chosen = ref_completion_logps.index_select(0, chosen_idx)
        ref_rejected = ref_completion_logps.index_select(0, rejected_idx)
        del ref_completion_logps
    if calculates_kl(s):
        kl = (kl_logps - ref_kl_logps).mean().detach()
        kl = kl.mean().clamp(min=0)  # accelerator.gather_for_metrics of one process: the tensor itself
    else:
        kl = torch.zeros(1)
    chosen_logratios = chosen_logps - ref_chosen
    if s.loss_type == "apo_zero_unpaired":
        chosen_losses = 1 - F.sigmoid(s.beta * chosen_logratios)
    else:
        chosen_losses = 1 - F.sigmoid(s.beta * (chosen_logratios - kl))
    chosen_rewards = s.beta * chosen_logratios.detach()
    rejected_logratios = rejected_logps - ref_rejected
    if s.loss_type == "apo_zero_unpaired":
        rejected_losses = F.sigmoid(s.beta * rejected_logratios)
    else:
        rejected_losses = 1 - F.sigmoid(s.beta * (kl - rejected_logratios))
    rejected_rewards = s.beta * rejected_logratios.detach()
    losses = torch.cat((_DESIRABLE_WEIGHT * chosen_losses, _UNDESIRABLE_WEIGHT * rejected_losses), 0)
    loss = losses.nanmean()
    del (outputs, num_chosen, num_rejected, kl_logps, completion_labels, completion_logps, chosen_idx, rejected_idx,
         chosen_rewards, rejected_rewards, losses)
    return loss


def micro_loss(runner: Any) -> tuple[torch.Tensor, int]:
    """The loss of one KTO micro-step (forward phase), and the index of the first record after the batch."""
    from memfit.sim.offload import runner_activation_offloading as activation_offloading

    batch = kto_batch(runner.setup)
    for t in batch.values():
        runner.tracker.register(t, "inputs")
    start = len(runner.tracker.records)
    with activation_offloading(runner):
        loss = _loss(runner, batch)
    del batch
    return loss, start

