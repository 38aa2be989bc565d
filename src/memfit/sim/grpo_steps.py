"""GRPOTrainer's step (TRL 1.16): generation, scoring and the training micro-step, on fake (or real CPU) tensors.

memfit.sim.engine runs the Trainer's loop; for `setup.trainer == "grpo"` each micro-step asks `micro_loss` here
for its loss. As `GRPOTrainer._prepare_inputs` does, the first micro-step of every `steps_per_generation x
num_iterations` generates and scores a whole generation batch (`generation_batch_size` completions, one
process), keeps it on the device (`_buffered_inputs`), and each micro-step trains on its slice of
`per_device_train_batch_size` completions. Shapes: G completions generated, P prompt tokens (`max_length` /
`example_lengths`), C = `max_completion_length` (the worst case: no completion stops early), B the micro-batch.

Generation (phase `generation`, transformers' `generate` as `_generate_single_turn` calls it: no_grad, the
model in train mode with gradient checkpointing off, under accelerate's autocast wrapper, a DynamicCache):

- the left-padded prompts `[G, P]` and their mask on the device;
- the prefill: the model's own `prepare_inputs_for_generation` and forward with `logits_to_keep=1`
  (generation/utils.py `_prefill`, `_sample`): the cache holds P tokens per layer;
- the decode steps: each one `torch.cat`s one token onto every layer's keys and values
  (cache_utils.py `DynamicLayer.update`), so the last of the C - 1 steps holds the cache of P + C - 2 tokens and
  allocates the one of P + C - 1 beside it, layer by layer. memfit runs that last step with the model's real
  code, on a cache grown to P + C - 2 tokens without running the C - 2 steps before it (they allocate the same
  tensors, smaller); the cache is `2 x layers x kv_heads x head_dim x (P + C - 1) x G x bytes` at the end;
- after each step the sampling `_sample` does: the last position's logits copied to fp32 `[G, vocab]`, the
  softmax, `multinomial`, the `[G, P + k]` ids concatenated.

Then `generate` returns `[G, P + C]`; TRL moves the completions to the host (`tolist`) and the cache is freed.
With `use_vllm` vLLM generates instead (its memory: memfit.gpus.vllm): no generation tensors here.

Scoring (phase `scoring`, `_generate_and_score_completions`): prompts, completions and their masks padded again
on the device, `prompt_completion_ids` / `attention_mask` `[G, P + C]`; under no_grad with checkpointing off,
TRL's own `_get_per_token_logps_and_entropies` in chunks of B for the old log-probs (when `num_iterations > 1`,
`gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0`, or vLLM's importance sampling)
and for the reference (`beta > 0`: the reference copy, or with peft the adapter disabled); the advantages `[G]`;
TRL's `shuffle_sequence_dict` (a permuted copy of each tensor) and `split_tensor_dict` (views).

Training (phases `forward` / `backward`, `_compute_loss`): the slice's ids concatenated `[B, P + C]`, TRL's
`_get_per_token_logps_and_entropies` with grad under autocast (the fused LM head: log-probs and entropy
`[B, C]`, never the `[B, C, vocab]` logits), and the default loss (`loss_type="dapo"`, token-level importance
ratio, two-sided clipping, the KL term when `beta > 0`, vLLM's importance ratio when `use_vllm`).

Layer splicing (memfit.sim.splice): with the cut model, every no-grad pass (the prefill, the cache grown layer by
layer, the decode step, each scoring chunk of the policy and of the reference) is spliced as it ends, the
generation's passes with one `SpliceCarry` (the cache a generic block fills in the prefill is the one its copies
replace in the decode step); the training forward and backward are spliced by the engine, as SFT's. The
reference copy has a cut model of its own (`ref_cut`). tests/sim/test_grpo.py checks the spliced trace against
the full model's.

Known limitations: TRL's logging metrics (clip ratios, entropy means: `[B, C]` temporaries freed before the
backward) are not simulated; other `loss_type`s are simulated as `dapo` (the same `[B, C]` element-wise ops);
the reward functions run on the host, a reward model (`reward_model`) on the GPU: its weights from the start, its
forward over the whole generation batch in scoring (`reward_scores`; as many tokens as the policy's).

Evaluation (phase `eval`, `evaluation`: GRPOTrainer.prediction_step): the eval batch of `per_device_eval_batch_size`
completions (whole groups of `num_generations_eval`) generated, scored and its loss computed under no_grad, the
model in eval mode, beside the training step's buffered generation batch; the evaluation loop's losses are the
engine's (memfit.sim.engine `_hold_eval_outputs`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch

from memfit.inputs.lengths import has_padding
from memfit.sim import _trl_adapter as trl_adapter
from memfit.sim.autocast import cuda_autocast
from memfit.sim.splice import K, LayerTagger, SpliceCarry, SpliceRefused, close_carry, splice_events
from memfit.trace import FORWARD, GENERATION, SCORING

__all__ = ["micro_loss", "evaluation", "eval_generations", "generation", "needs_old_log_probs", "kv_cache_bytes",
           "reward_scores"]


def kv_cache_bytes(config: Any, *, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Keys and values of a full DynamicCache: `2 x layers x kv_heads x head_dim x tokens x sequences x bytes`
    (cache_utils.py DynamicLayer: one `[sequences, kv_heads, tokens, head_dim]` tensor each per layer)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * tokens * sequences * dtype_bytes


def needs_old_log_probs(setup: Any) -> bool:
    """GRPOTrainer._generate_and_score_completions: old log-probs are computed when generation and optimizer
    steps are misaligned, or with vLLM's importance sampling correction (on by default)."""
    steps, _ = setup.grpo_sizes
    generate_every = steps * setup.num_iterations
    return setup.gradient_accumulation_steps % generate_every != 0 or setup.use_vllm


def _longs(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long)


class _PreparedForward:
    """The model as accelerate's prepared forward calls it: under autocast, outputs converted to fp32
    (accelerate `prepare_model`: `model.forward = convert_outputs_to_fp32(autocast(model.forward))`), which
    `unwrap_model(keep_fp32_wrapper=True)` keeps for `generate` too."""

    def __init__(self, model: torch.nn.Module, low: Any) -> None:
        self.model, self.low = model, low

    def __call__(self, **kwargs: Any):
        with cuda_autocast(self.low):
            out = self.model(**kwargs)
        if self.low is not None:
            from accelerate.utils import convert_to_fp32

            out = convert_to_fp32(out)
        return out


def _checkpointing_off(runner: Any):
    """TRL turns gradient checkpointing off around generation and scoring (trl/models/utils.py
    `disable_gradient_checkpointing`, called by `unwrap_model_for_generation` and `_generate_and_score_completions`)."""
    if runner.checkpointing != "huggingface":
        return contextlib.nullcontext()
    return trl_adapter.disable_gradient_checkpointing(runner.fwd_model, runner.setup.gradient_checkpointing_kwargs)


# -- layer splicing of the no-grad passes ----------------------------------------------------------------------

def _splice(runner: Any, carry: SpliceCarry | None = None) -> None:
    """Write the full model's events for everything recorded since the last splice (no-op without a cut model)."""
    if runner.cut is None:
        return
    tr = runner.tracker
    splice_events(tr, runner.grpo_spliced_events, runner.sizes, runner.names, carry=carry)
    runner.grpo_spliced_events = len(tr.events)


@contextlib.contextmanager
def _no_grad_pass(runner: Any, tagger: LayerTagger | None = None):
    """A no-grad forward of a cut model, tagged as the evaluation's is (`LayerTagger.gaps`: the previous block's
    output is freed between two blocks, and counts as the block before it)."""
    if runner.cut is None:
        yield
        return
    tagger = tagger or runner.tagger
    tr = runner.tracker
    saved = tr.tag_fn
    tagger.gaps, tagger.trailing, tr.tag_fn = True, None, tagger.current
    try:
        yield
    finally:
        tagger.gaps, tagger.trailing, tr.tag_fn = False, None, saved


@contextlib.contextmanager
def _as_block(runner: Any, index: int):
    """What runs inside counts as block `index` of the (one) repeated stack (the cache grown layer by layer)."""
    if runner.cut is None:
        yield
        return
    runner.tagger.stack.append((0, index))
    try:
        yield
    finally:
        runner.tagger.stack.pop()


def _reference(runner: Any) -> tuple[torch.nn.Module, LayerTagger | None]:
    """The reference model that runs (its cut model when the policy is spliced) and its tagger. The cut reference
    is put on the device the first time (`to_empty`, zeros on a real run) and never counted: the full reference's
    weights are (memfit.sim.trl_steps.materialize_reference)."""
    ref_cut = getattr(runner, "ref_cut", None)
    if runner.cut is None or ref_cut is None:
        return runner.ref_model, None
    tagger = getattr(runner, "_ref_tagger", None)
    if tagger is None:
        from memfit.models.build import to_empty_tied

        tr = runner.tracker
        tr.paused = True
        to_empty_tied(ref_cut, device="cpu")
        if not runner.fake:
            with torch.no_grad():
                for t in list(ref_cut.parameters()) + list(ref_cut.buffers()):
                    t.zero_()
        tr.paused = False
        for t in list(ref_cut.parameters()) + list(ref_cut.buffers()):
            tr.ignore(t)
        tagger = runner._ref_tagger = LayerTagger(ref_cut, tr, runner.names)
    return ref_cut, tagger


class _Decoder:
    """What `GenerationMixin._sample` (transformers 5.24 generation/utils.py) does around each forward, tensor for
    tensor. Before the prefill `_prepare_position_ids_for_generation`: `attention_mask.cumsum(-1) - 1`, padding
    masked to 0. After each forward `_update_model_kwargs_for_generation`: the attention mask and the position ids
    one column longer (`torch.cat`). Then the token selection: the last position's logits copied to fp32
    `[G, vocab]`, no logits processor (TRL's defaults top_k=0, top_p=1, temperature 1 add none), softmax,
    `multinomial`, finished sequences padded (TRL passes its EOS ids), the ids one token longer, the stopping
    criteria (max length, EOS). The loop's variables live on until the next step overwrites them: during each
    forward the previous step's logits copy and probabilities are still alive."""

    def __init__(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, real: bool) -> None:
        self.real = real
        self.ids, self.mask = prompt_ids, prompt_mask
        position_ids = prompt_mask.long().cumsum(-1) - 1
        self.position_ids = position_ids.masked_fill(prompt_mask == 0, 0)
        del position_ids
        self.unfinished = torch.ones(prompt_ids.shape[0], dtype=torch.long)
        self.keep: tuple = ()

    def grow(self, tokens: int) -> None:
        """Ids, mask and positions as `tokens` - 1 ... decode steps leave them: `tokens` columns."""
        self.ids, self.mask, self.position_ids = (_grow(t, tokens) for t in (self.ids, self.mask, self.position_ids))

    def model_inputs(self, model: torch.nn.Module, cache: Any, *, first: bool) -> dict[str, Any]:
        return model.prepare_inputs_for_generation(self.ids, next_sequence_length=None if first else 1, cache=cache,
                                                   attention_mask=self.mask, position_ids=self.position_ids,
                                                   use_cache=True, logits_to_keep=1, is_first_iteration=first)

    def step(self, logits: torch.Tensor) -> None:
        g = self.ids.shape[0]
        self.mask = torch.cat([self.mask, self.mask.new_ones((g, 1))], dim=-1)
        next_pos = torch.arange(1, dtype=self.position_ids.dtype).view(1, -1) + self.position_ids[..., -1:] + 1
        self.position_ids = torch.cat([self.position_ids, next_pos], dim=-1)
        del next_pos
        self.keep = ()
        next_logits = logits[:, -1].to(copy=True, dtype=torch.float32)
        probs = torch.nn.functional.softmax(next_logits, dim=-1)
        if self.real:
            # a real CPU run (memfit's exactness tests) of zero weights: the pad row's fully masked attention can
            # make NaN probabilities, which multinomial refuses; in place, so no allocation (values never change
            # the trace)
            probs.nan_to_num_(nan=1.0)
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        next_tokens = next_tokens * self.unfinished + 0 * (1 - self.unfinished)
        self.ids = torch.cat([self.ids, next_tokens[:, None]], dim=-1)
        # stopping criteria: MaxLengthCriteria (a full [G] bool) | EosTokenCriteria (isin on the last token)
        is_done = torch.full((g,), False, dtype=torch.bool)
        is_done = is_done | torch.isin(self.ids[:, -1], torch.tensor([2]))
        self.unfinished = self.unfinished & ~is_done
        self.keep = (next_logits, probs, next_tokens, is_done)


def _grow(t: torch.Tensor, tokens: int) -> torch.Tensor:
    """A tensor like `t` with `tokens` along dim -2 (the sequence dim of a cache layer) or -1 (ids, masks)."""
    shape = list(t.shape)
    shape[-2 if t.dim() == 4 else -1] = tokens
    return t.new_zeros(shape)


def generation(runner: Any, g: int, p: int, c: int) -> None:
    """transformers' generate for `g` prompts of `p` tokens and `c` new tokens (module docstring)."""
    from transformers import DynamicCache

    tr = runner.tracker
    model = runner.fwd_model
    forward = _PreparedForward(model, runner.low)
    carry = SpliceCarry()
    # TRL's `generate_inputs`: the caller holds them for the whole call
    prompt_ids, prompt_mask = _longs(g, p), torch.ones(g, p, dtype=torch.long)
    # prompts of different lengths, left-padded: generate keeps the mask (it drops an all-ones one) and
    # transformers builds the 4-D attention mask, as for a padded training batch (engine._make_batch)
    prompt_mask[-1, :1].zero_()
    for t in (prompt_ids, prompt_mask):
        tr.register(t, "inputs")
    with torch.no_grad(), _checkpointing_off(runner):
        cache = DynamicCache(config=model.config)
        decode = _Decoder(prompt_ids, prompt_mask, real=not getattr(runner, "fake", True))
        inputs = decode.model_inputs(model, cache, first=True)
        with _no_grad_pass(runner):
            out = forward(**inputs, return_dict=True)
        _splice(runner, carry)
        del inputs
        decode.step(out.logits)
        del out
        if c > 1:
            # the C - 2 decode steps before the last one, by their result: the cache grown to P + C - 2 tokens,
            # the ids, mask and positions to P + C - 1
            filled = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
            if runner.cut is not None and len(filled) != K:
                raise SpliceRefused(f"the cut model filled {len(filled)} cache layers, not {K}")
            for i, layer in enumerate(filled):
                with _as_block(runner, i):
                    layer.keys, layer.values = _grow(layer.keys, p + c - 2), _grow(layer.values, p + c - 2)
            del filled, layer  # the cache alone holds its layers: `del cache` frees them
            _splice(runner, carry)
            decode.grow(p + c - 1)
            inputs = decode.model_inputs(model, cache, first=False)
            with _no_grad_pass(runner):
                out = forward(**inputs, return_dict=True)
            _splice(runner, carry)
            del inputs
            decode.step(out.logits)
            del out
        del cache, decode  # TRL keeps only the completions' token lists (on the host)
    del prompt_ids, prompt_mask
    _splice(runner, carry)
    if runner.cut is not None:
        close_carry(tr, carry)


class _TrainerView:
    """The attributes of GRPOTrainer that `_get_per_token_logps_and_entropies` reads (text-only inputs)."""

    def __init__(self, low: Any) -> None:
        self.accelerator = types.SimpleNamespace(autocast=lambda: cuda_autocast(low))


def _log_probs(runner: Any, model: torch.nn.Module, input_ids, attention_mask, c: int, *,
               tagger: LayerTagger | None = None, spliced: bool = False, **kwargs: Any):
    """TRL's `GRPOTrainer._get_per_token_logps_and_entropies`, the real code, on `model`'s prepared forward.
    `spliced`: a no-grad pass of a cut model, spliced as each chunk's forward returns (`tagger`: the reference's)."""
    low = runner.low

    def call(**kw: Any):
        with _no_grad_pass(runner, tagger) if spliced else contextlib.nullcontext():
            out = model(**kw)
        if spliced:
            _splice(runner)
        if low is not None:
            from accelerate.utils import convert_to_fp32

            out = convert_to_fp32(out)
        return out

    return trl_adapter.grpo_log_probs(_TrainerView(low), call, input_ids, attention_mask, c, **kwargs)


def _score(runner: Any, g: int, p: int, c: int, *, evaluation: bool = False) -> dict[str, torch.Tensor]:
    """GRPOTrainer._generate_and_score_completions on the device: the generation batch it returns. `evaluation`: the
    eval batch (`mode == "eval"`: scored in chunks of `per_device_eval_batch_size`, groups of
    `num_generations_eval`)."""
    s = runner.setup
    tr = runner.tracker
    batch = {"prompt_ids": _longs(g, p), "prompt_mask": _longs(g, p), "completion_ids": _longs(g, c),
             "completion_mask": _longs(g, c)}
    for t in batch.values():
        tr.register(t, "inputs")
    # loss_mask.sum() gathered: one int64 scalar (gather of one process is the tensor itself)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    prompt_completion_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    b = s.per_device_eval_batch_size if evaluation else s.per_device_train_batch_size
    with torch.no_grad(), _checkpointing_off(runner):
        if needs_old_log_probs(s):  # GRPOTrainer tests the same condition in eval
            batch["old_per_token_logps"], _, _ = _log_probs(runner, runner.fwd_model, prompt_completion_ids,
                                                            attention_mask, c, batch_size=b, spliced=True)
        if s.use_vllm:  # vLLM's log-probs of the sampled tokens, and the importance sampling ratio from them
            batch["sampling_per_token_logps"] = torch.zeros(g, c)
            tr.register(batch["sampling_per_token_logps"], "inputs")
            diff = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * batch["completion_mask"]
            batch["importance_sampling_ratio"] = torch.exp((diff.sum(-1) / batch["completion_mask"].sum(-1).clamp(
                min=1.0)).unsqueeze(-1))  # vllm_importance_sampling_mode="sequence_mask": one ratio per completion
            del diff
        if s.beta != 0.0:
            if runner.ref_model is not None:
                ref, tagger = _reference(runner)
                batch["ref_per_token_logps"], _, _ = _log_probs(runner, ref, prompt_completion_ids, attention_mask,
                                                                c, batch_size=b, tagger=tagger, spliced=True)
            else:  # peft: the adapter disabled is the reference
                with runner.fwd_model.disable_adapter():
                    batch["ref_per_token_logps"], _, _ = _log_probs(runner, runner.fwd_model, prompt_completion_ids,
                                                                    attention_mask, c, batch_size=b, spliced=True)
    del prompt_completion_ids, attention_mask
    # rewards [G, functions] on the device, grouped by prompt: the advantages [G]
    n = eval_generations(s) if evaluation else s.num_generations
    rewards = reward_scores(runner, g, p + c).sum(dim=1)
    mean = rewards.view(-1, n).mean(dim=1).repeat_interleave(n, dim=0)
    std = rewards.view(-1, n).std(dim=1).repeat_interleave(n, dim=0)
    batch["advantages"] = (rewards - mean) / (std + 1e-4)
    del rewards, mean, std
    return batch


def reward_scores(runner: Any, g: int, tokens: int) -> torch.Tensor:
    """GRPOTrainer / RLOOTrainer `_calculate_rewards`: `rewards_per_func` `[G, functions]` on the device, and with a
    reward model (`setup.reward_model`) its forward: the decoded prompts + completions tokenized again by the reward
    model's tokenizer (right-padded `input_ids` / `attention_mask` `[G, tokens]`: as many tokens as the policy's,
    which a reward model of another tokenizer changes), the whole generation batch in one call under
    `torch.inference_mode()` and accelerate's prepared forward (autocast, fp32 outputs), `.logits[:, 0]` kept."""
    tr = runner.tracker
    rewards_per_func = torch.zeros(g, 1)
    reward = getattr(runner, "reward_model", None)
    if reward is None:
        return rewards_per_func
    _splice(runner)  # the policy's passes before it are spliced; the reward model's events are its own, whole
    ids, mask = _longs(g, tokens), torch.ones(g, tokens, dtype=torch.long)
    if has_padding(runner.setup, tokens - runner.setup.max_completion_length):  # prompts of different lengths
        mask[-1, -1:].zero_()  # right-padded: transformers builds the 4-D attention mask
    for t in (ids, mask):
        tr.register(t, "inputs")
    # torch.inference_mode() as no_grad: the same allocations (no autograd graph, no saved tensors)
    with torch.no_grad():
        rewards_per_func[:, 0] = _PreparedForward(reward, runner.low)(input_ids=ids, attention_mask=mask).logits[:, 0]
    del ids, mask
    _splice(runner)
    return rewards_per_func


def _loss(runner: Any, inputs: dict[str, torch.Tensor], *, evaluation: bool = False) -> torch.Tensor:
    """GRPOTrainer._compute_loss, default `loss_type="dapo"` (values do not change the trace). `evaluation`: under
    prediction_step's no_grad, the forward spliced as it returns, the normalizer not rescaled for accumulation."""
    s = runner.setup
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)
    c = completion_ids.size(1)
    per_token_logps, entropies, _ = _log_probs(runner, runner.fwd_model, input_ids, attention_mask, c,
                                               compute_entropy=True, spliced=evaluation)
    del input_ids, attention_mask
    advantages = inputs["advantages"].unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old
    log_ratio = per_token_logps - old
    coef_1 = torch.exp(log_ratio)
    if s.beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_kl = per_token_kl * coef_1  # use_bias_correction_kl (default True)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if s.use_vllm:
        per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
    if s.beta != 0.0:
        per_token_loss = per_token_loss + s.beta * per_token_kl
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / 1  # / accelerator.num_processes
    if not evaluation:  # "in eval, the batch is neither split across steps nor accumulated"
        steps, _ = s.grpo_sizes
        normalizer = normalizer * s.gradient_accumulation_steps / steps
    loss = (per_token_loss * mask).sum() / normalizer
    del entropies
    return loss


def micro_loss(runner: Any, score: Callable[..., dict] | None = None,
               loss: Callable[[Any, dict], torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """The loss of one GRPO micro-step (generating and scoring first when the buffer is due), and the index of
    the first record after the generation batch (what the forward allocates from there on). `score` and `loss`
    replace GRPO's own for a trainer with GRPOTrainer's buffer and other rewards or loss (RLOO)."""
    score = score or _score
    loss = loss or _loss
    s = runner.setup
    tr = runner.tracker
    steps, gen = s.grpo_sizes
    step = getattr(runner, "_grpo_step", 0)
    if step % (steps * s.num_iterations) == 0 or getattr(runner, "_grpo_buffer", None) is None:
        p, c = s.sequence_length, s.max_completion_length
        runner.grpo_spliced_events = len(tr.events)  # what the passes below splice starts here
        if not s.use_vllm:
            tr.phase = GENERATION
            generation(runner, gen, p, c)
        tr.phase = SCORING
        batch = score(runner, gen, p, c)
        batch = trl_adapter.shuffle_sequence_dict(batch)
        runner._grpo_buffer = trl_adapter.split_tensor_dict(batch, steps)
        del batch
        _splice(runner)  # the engine splices the training forward and backward from here on
        tr.phase = FORWARD
    runner._grpo_step = step + 1
    inputs = runner._grpo_buffer[step % steps]
    start = len(tr.records)
    return loss(runner, inputs), start


def eval_generations(setup: Any) -> int:
    """Completions per prompt in evaluation: GRPOTrainer / RLOOTrainer `num_generations_eval or num_generations`."""
    return setup.num_generations_eval or setup.num_generations


def evaluation(runner: Any, score: Callable[..., dict] | None = None,
               loss: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """GRPOTrainer.prediction_step on one eval batch (TRL 1.16), the model in eval mode: `_prepare_inputs` in eval
    neither buffers nor reuses, so `_generate_and_score_completions` generates one completion per row of the batch
    (`per_device_eval_batch_size` rows, each prompt repeated `num_generations_eval` times by the eval sampler:
    `generation` for that many sequences, or vLLM's) and scores it in chunks of `per_device_eval_batch_size`; then
    `compute_loss` under no_grad on the whole batch, and `loss.mean().detach()`. Every pass of a cut model is spliced
    as it ends (the training buffer stays alive: `_buffered_inputs`). Returns the eval loss (a device scalar).
    `score` and `loss` replace GRPO's own (RLOO)."""
    score = score or _score
    loss = loss or _loss
    s = runner.setup
    tr = runner.tracker
    g, p, c = s.per_device_eval_batch_size, s.sequence_length, s.max_completion_length
    runner.grpo_spliced_events = len(tr.events)
    if not s.use_vllm:
        generation(runner, g, p, c)
    inputs = score(runner, g, p, c, evaluation=True)
    with torch.no_grad():
        out = loss(runner, inputs, evaluation=True)
        out = out.mean().detach()
    del inputs
    _splice(runner)
    return out
