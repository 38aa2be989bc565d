"""DistillationTrainer's step (TRL 1.16): on-policy generation, then the student matched to a teacher in memory.

DistillationTrainer (trl/trainer/distillation_trainer.py) keeps a teacher model (`teacher_model_name_or_path`,
`accelerator.prepare_model(teacher, evaluation_mode=True)`: its weights on the device, no gradients, no optimizer
state) beside the student, which has no fused LM head. Its `_prepare_inputs` buffers like GRPOTrainer's, with
one completion per prompt and a buffer of `gradient_accumulation_steps` micro-batches: the first micro-step of
each window generates for all `B x gradient_accumulation_steps` prompts (memfit.sim.grpo_steps.generation, the
same `_generate_single_turn` path: transformers' `generate` under `unwrap_model_for_generation`), puts the padded
prompts and completions on the device (`[G, P]`, `[G, C]` and their masks) with the gathered completion-token
count, shuffles and splits them. Each micro-step then runs `_compute_loss`:

- the student's backbone (`model.base_model`, no LM head) with grad on `[B, P + C]`, its last hidden state
  sliced to the completion positions `[B, C, H]`; the teacher's backbone the same under no_grad;
- `_chunked_divergence_loss`: both hidden states flattened to `[N, H]` (N = B x C), the valid positions picked,
  and TRL's `ChunkedDivergenceFunction` (the student's and the teacher's LM heads projected on `[4096, 32768]`
  fp32 tiles, never the `[N, vocab]` logits; per-token divergence and entropy `[N]`; its backward a
  `[N, H]` fp32 gradient of the hidden states and a `[vocab, H]` fp32 one of the student's LM head), the
  divergence summed and divided by the window's token count (the loss is scaled for accumulation:
  `loss_is_scaled_for_ga = True`, Trainer does not divide it again).

No autocast around the loss: `compute_loss` calls `_compute_loss` through `_ForwardRedirection`, which swaps the
prepared model's `forward` (accelerate's autocast wrapper) for the method itself (trl/models/utils.py), so the
backbones run in the weights' dtype; the divergence kernels compute in it (`_compute_dtype`).

On CUDA (Triton) `_chunked_divergence_loss` projects only the valid positions (`h[valid]`, a `[n_valid, H]` copy
of each hidden state; on other devices every position is projected). memfit runs that CUDA path with every
position valid (the worst case: every completion `max_completion_length` long): the boolean-mask index as an
`index_select` of `N` rows, which allocates the same copy and saves the same `[N]` indices. The divergence kernels
allocate as on CUDA (memfit.sim._trl_adapter.divergence_kernels).

Evaluation (phase `eval`, `evaluation`: prediction_step): `_prepare_inputs` in eval generates for the eval batch
(`per_device_eval_batch_size` prompts, one completion each), pads it on the device and runs `compute_loss` under
no_grad.

Known limitations: the entropy metric's gather, tool calls, vision inputs and vLLM generation are not simulated;
the teacher is loaded in the student's `weights_dtype` setting (`teacher_model_init_kwargs`' dtype is not read).
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.sim import _trl_adapter as trl_adapter
from memfit.sim import grpo_steps
from memfit.trace import FORWARD, GENERATION

__all__ = ["micro_loss", "evaluation", "divergence_loss", "last_hidden_state"]


def last_hidden_state(model: torch.nn.Module, input_ids, attention_mask, logits_to_keep: int) -> torch.Tensor:
    """DistillationTrainer._get_last_hidden_state for text: the backbone's output, the completion positions."""
    if hasattr(model, "get_base_model"):  # peft: `base_model.model` is the transformers model
        model = model.get_base_model()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep + 1,
              "use_cache": False}  # the student's forward takes logits_to_keep (model_kwarg_keys)
    hidden = model.base_model(**inputs).last_hidden_state
    hidden = hidden[:, :-1, :]  # (B, L-1, H): the last position predicts the next token
    return hidden[:, -logits_to_keep:, :]  # (B, C, H)


def _head(model: torch.nn.Module) -> torch.nn.Module:
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model.get_output_embeddings()


def divergence_loss(student_hidden, teacher_hidden, student_head, teacher_head, completion_mask, beta: float,
                    num_items_in_batch, temperature: float = 1.0):
    """`_chunked_divergence_loss` (distillation_trainer.py) on its CUDA path, every completion position valid (module
    docstring); logit scales 1, no softcapping (Llama / Qwen)."""
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    h_s = student_hidden.reshape(-1, student_hidden.size(-1))
    h_t = teacher_hidden.reshape(-1, teacher_hidden.size(-1))
    # `h_s[valid]`, `h_t[valid]`: nonzero's [N, 1] int64 indices, then one gather each (every position valid)
    index = torch.zeros(valid.numel(), 1, dtype=torch.long).view(-1)
    h_s, h_t = h_s.index_select(0, index), h_t.index_select(0, index)
    del index, valid
    per_token_divergence, per_token_entropy = trl_adapter.chunked_divergence(
        h_s, student_head.weight, student_head.bias, h_t, teacher_head.weight, teacher_head.bias, beta, temperature,
        1.0, None, 1.0, None)
    del h_s, h_t
    loss = per_token_divergence.sum()
    entropy_sum = per_token_entropy.sum()
    # None (evaluation: compute_loss passes it only in training): the mean over the local valid tokens
    loss = loss / (n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    return loss, entropy_sum, n_valid


def _window(runner: Any, g: int, p: int, c: int) -> dict[str, torch.Tensor]:
    """`_generate_and_score_completions` on the device after generation: the padded batch and its token count."""
    tr = runner.tracker
    batch = {"prompt_ids": grpo_steps._longs(g, p), "prompt_mask": grpo_steps._longs(g, p),
             "completion_ids": grpo_steps._longs(g, c), "completion_mask": grpo_steps._longs(g, c)}
    for t in batch.values():
        tr.register(t, "inputs")
    batch["num_items_in_batch"] = batch["completion_mask"].sum()  # loss_mask.sum(), gathered (one process)
    return batch


def _loss(runner: Any, inputs: dict[str, torch.Tensor], *, evaluation: bool = False) -> torch.Tensor:
    """DistillationTrainer.compute_loss / _compute_loss (module docstring); `evaluation`: the model in eval mode,
    no `num_items_in_batch` (compute_loss reads it only `if self.model.training`)."""
    s = runner.setup
    num_items_in_batch = None
    if not evaluation:
        num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0) / 1  # / accelerator.num_processes
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    mask = inputs["completion_mask"]
    c = inputs["completion_ids"].size(1)
    student_hidden = last_hidden_state(runner.fwd_model, input_ids, attention_mask, c)
    teacher = runner.ref_model
    teacher.eval()
    with torch.no_grad():
        teacher_hidden = last_hidden_state(teacher, input_ids, attention_mask, c)
    del input_ids, attention_mask
    loss, entropy_sum, n_valid = divergence_loss(student_hidden, teacher_hidden, _head(runner.fwd_model),
                                                 _head(teacher), mask, s.beta, num_items_in_batch)
    entropy_sum = entropy_sum.detach()
    del student_hidden, teacher_hidden, entropy_sum, n_valid, num_items_in_batch
    return loss


def micro_loss(runner: Any) -> tuple[torch.Tensor, int]:
    """The loss of one distillation micro-step (generating first when the buffer is due), and the index of the first
    record after the buffered batch."""
    s = runner.setup
    tr = runner.tracker
    steps = s.gradient_accumulation_steps
    step = getattr(runner, "_distill_step", 0)
    if step % steps == 0 or getattr(runner, "_distill_buffer", None) is None:
        g, p, c = s.per_device_train_batch_size * steps, s.sequence_length, s.max_completion_length
        tr.phase = GENERATION
        grpo_steps.generation(runner, g, p, c)
        batch = trl_adapter.shuffle_sequence_dict(_window(runner, g, p, c))
        runner._distill_buffer = trl_adapter.split_tensor_dict(batch, steps)
        del batch
        tr.phase = FORWARD
    runner._distill_step = step + 1
    inputs = runner._distill_buffer[step % steps]
    start = len(tr.records)
    with trl_adapter.divergence_kernels():
        loss = _loss(runner, inputs)
    return loss, start


def evaluation(runner: Any) -> torch.Tensor:
    """DistillationTrainer.prediction_step on one eval batch (module docstring): the eval loss, a device scalar."""
    s = runner.setup
    g, p, c = s.per_device_eval_batch_size, s.sequence_length, s.max_completion_length
    grpo_steps.generation(runner, g, p, c)
    inputs = _window(runner, g, p, c)
    with torch.no_grad(), trl_adapter.divergence_kernels():
        out = _loss(runner, inputs, evaluation=True).mean().detach()
    del inputs
    return out
