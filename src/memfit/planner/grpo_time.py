"""A documented speed model for ranking GRPO plans: modelled seconds of one optimizer step of GRPOTrainer
(TRL 1.16), generation included. Only ratios between plans of one model on one GPU are used.

Step time = training + (generations per optimizer step) x (generation + scoring), where

* training is memfit.planner.throughput's model of the micro-steps (memfit.planner.ranking `StepTimer`): the
  micro-batch's completions of prompt + completion tokens (P + C), with checkpointing, the optimizer, QLoRA's
  dequantization as there;
* generations per optimizer step: `gradient_accumulation_steps / (steps_per_generation x num_iterations)`
  (GRPOTrainer generates once every `steps_per_generation x num_iterations` micro-steps, `_prepare_inputs`);
* scoring: one forward pass (2 N per token plus the attention forward, Kaplan et al. 2020 sec. 2.1) over the
  generation batch's `G x (P + C)` tokens in chunks of the micro-batch, per log-prob TRL computes (old log-probs:
  memfit.sim.grpo_steps `needs_old_log_probs`; reference: `beta > 0`), at throughput's tensor-core rate and
  small-batch efficiency;
* generation, decode-bound: `C` decode steps per wave of sequences decoded at once, each one the larger of its
  compute (2 N per sequence) and its memory traffic (the weights read once per step plus each sequence's KV
  cache, on average `P + C / 2` tokens, read once) at `_BANDWIDTH_FRACTION` of the GPU's memory bandwidth,
  plus the prefill (2 N per prompt token). transformers' `generate` decodes the whole generation batch at
  once (one wave), dequantizing every 4/8-bit weight at every step (as throughput models QLoRA's matmuls);
  a colocated vLLM decodes as many sequences at once as its KV cache pool holds at full length (pool = share -
  weights, memfit.gpus.vllm; at most `max_num_seqs`, which TRL sets to the generation batch; a server at most
  `vllm serve`'s default max_num_seqs, memfit.gpus.vllm.vllm_serve_max_num_seqs), in
  `ceil(G / that)` waves, and TRL copies the trained weights into it once per generation (`sync_weights`:
  read and written at the same bandwidth). In server mode vLLM decodes on its own GPU (taken as one of the
  same kind at `trl vllm-serve`'s default share).

Assumptions, not measurements: `_BANDWIDTH_FRACTION` (memory-bound kernels reach most of the peak bandwidth; it
only scales generation against training); every completion runs to `max_completion_length` (memfit's worst
case, as for memory); vLLM's own activations, CUDA graphs and scheduling, and the time of waking vLLM from sleep
mode (re-mapping its memory: not modelled, so sleep mode ranks as fast as the same share without it, and the
plan prefers the share without sleep when their modelled times are equal) are not timed; Python overhead per
decode step of `generate` is the same for every plan of one setup and not timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.gpus.catalog import GpuSpec
from memfit.planner.throughput import T_HALF_TOKENS, _rate_flops

__all__ = ["GrpoTime", "grpo_step_time", "kv_bytes_per_token", "vllm_concurrency"]

#: Fraction of the peak memory bandwidth the decode steps reach. Assumption (see module docstring).
_BANDWIDTH_FRACTION = 0.8


@dataclass(frozen=True)
class GrpoTime:
    """Modelled seconds of one optimizer step and its parts."""

    total_s: float
    training_s: float
    generation_s: float  #: per optimizer step (generation x generations per step)
    scoring_s: float  #: per optimizer step
    concurrency: int  #: sequences decoded at once
    waves: int  #: rounds of decoding per generation batch


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Keys and values of one token over all layers (memfit.sim.grpo_steps.kv_cache_bytes of one token)."""
    from memfit.sim.grpo_steps import kv_cache_bytes

    return kv_cache_bytes(config, sequences=1, tokens=1, dtype_bytes=dtype_bytes)


def vllm_concurrency(pool_bytes: int, kv_per_token: int, tokens_per_sequence: int, generation_batch: int) -> int:
    """Sequences a vLLM KV cache pool of `pool_bytes` decodes at once, each at full length (at least 0, at most
    the generation batch: TRL's `max_num_seqs`)."""
    per_sequence = max(1, kv_per_token * tokens_per_sequence)
    return max(0, min(generation_batch, pool_bytes // per_sequence))


def _forward_s(params: int, n_layer: int, d_model: int, seq: int, tokens: int, chunk_tokens: int, spec: GpuSpec,
               precision: str) -> float:
    """Seconds of a no-grad forward over `tokens` tokens in chunks of `chunk_tokens` (throughput's rate and
    small-batch efficiency; attention 4 n_layer d L per token forward, a third of training's 12)."""
    per_token = 2 * params + 4 * n_layer * d_model * seq
    efficiency = chunk_tokens / (chunk_tokens + T_HALF_TOKENS)
    return per_token * tokens / (_rate_flops(spec, precision) * efficiency)


def grpo_step_time(setup: Any, spec: GpuSpec, timer: Any, params: int, trainable_params: int, *,
                   kv_per_token: int, weight_bytes: int, pool_bytes: int | None = None,
                   paged_traffic: int = 0) -> GrpoTime:
    """Modelled seconds of one optimizer step of the GRPO `setup` (module docstring).

    Args:
        setup: the TrainSetup (trainer="grpo").
        spec: the GPU.
        timer: memfit.planner.ranking.StepTimer of the model on this GPU.
        params: parameters of the model; trainable_params: those that train.
        kv_per_token: KV cache bytes per token (`kv_bytes_per_token`).
        weight_bytes: the model's weights in bytes as vLLM / generate reads them per decode step (quantized
            weights counted packed).
        pool_bytes: a colocated vLLM's KV cache pool (share - weights); None: the generator is transformers'
            generate, or vLLM in server mode.
        paged_traffic: a paged optimizer's bytes over the host link per step (memfit.planner.throughput).
    """
    from memfit.gpus.vllm import VLLM_SERVE_DEFAULT_UTILIZATION, vllm_serve_max_num_seqs
    from memfit.sim.grpo_steps import needs_old_log_probs

    steps, g = setup.grpo_sizes
    p, c = setup.sequence_length, setup.max_completion_length
    total_tokens = p + c
    train = setup.replace(max_length=total_tokens, example_lengths=None)
    training_s = timer.seconds(train, params, trainable_params, paged_traffic=paged_traffic)
    per_step = setup.gradient_accumulation_steps / (steps * setup.num_iterations)
    # RLOOTrainer always scores the old log-probs (memfit.sim.rloo_steps)
    passes = int(setup.trainer == "rloo" or needs_old_log_probs(setup)) + int(setup.beta != 0.0)
    b = setup.per_device_train_batch_size
    scoring_s = passes * _forward_s(params, timer.n_layer, timer.d_model, total_tokens, g * total_tokens,
                                    b * total_tokens, spec, setup.precision)
    bandwidth = spec.memory_bandwidth_gbps * 1e9 * _BANDWIDTH_FRACTION
    rate = _rate_flops(spec, setup.precision)
    read_weights = weight_bytes
    sync_s = 0.0
    if not setup.use_vllm:  # transformers' generate: one wave; 4/8-bit weights dequantized at every step
        concurrency = g
        if setup.load_in_4bit or setup.load_in_8bit:
            quantized = params - trainable_params
            read_weights += quantized * 4  # the 16-bit copy written and read by the matmul (throughput: QLoRA)
    else:
        cap = g  # colocate: TRL's max_num_seqs, the generation batch
        if pool_bytes is None:  # server mode: vLLM at `trl vllm-serve`'s share of a GPU of this kind
            pool_bytes = int(VLLM_SERVE_DEFAULT_UTILIZATION * spec.total_bytes) - weight_bytes
            cap = vllm_serve_max_num_seqs(spec.name, spec.total_bytes)  # vllm serve's default (memfit.gpus.vllm)
        else:  # colocate: TRL pushes the trained weights into vLLM before each generation
            sync_s = 2 * weight_bytes / bandwidth
        concurrency = min(cap, vllm_concurrency(pool_bytes, kv_per_token, total_tokens, g))
    if concurrency <= 0:
        return GrpoTime(math.inf, training_s, math.inf, scoring_s * per_step, 0, 0)
    waves = -(-g // concurrency)
    decode_s = 0.0
    left = g
    for _ in range(waves):
        n = min(concurrency, left)
        left -= n
        memory = (read_weights + n * (p + c / 2) * kv_per_token) / bandwidth
        compute = 2 * params * n / rate
        decode_s += c * max(memory, compute)
    prefill_s = _forward_s(params, timer.n_layer, timer.d_model, p, g * p, min(g, concurrency) * p, spec,
                           setup.precision)
    generation_s = (decode_s + prefill_s + sync_s) * per_step
    return GrpoTime(training_s + scoring_s * per_step + generation_s, training_s, generation_s,
                    scoring_s * per_step, concurrency, waves)
