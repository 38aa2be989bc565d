"""Sanity properties of `memfit.estimate` over bundled models (hypothesis, few examples).

What the report's figures mean (memfit/estimator.py, memfit/peaks.py): `peak_allocated_bytes`
and `phases` count live tensors as `torch.cuda.memory_allocated()` does (each request rounded
up to 512 B); `breakdown` is the bytes per category at the overall allocated peak and
`phase_breakdowns[p]` at the allocated peak of phase `p`; `peak_reserved_bytes` and
`reserved_by_phase` come from the caching-allocator replay. Categories: `weights` (parameters
and buffers), `gradients` (`.grad` of trainable parameters, alive from the backward until
`zero_grad(set_to_none=True)` after the step), `optimizer_state` (AdamW `exp_avg` and
`exp_avg_sq` in the parameter's dtype; the fused implementation's per-parameter `step` on the
device, the non-fused one's on the host; clip_grad_norm_'s total norm, a float32 scalar
Trainer keeps), `activations`, `temporaries`, `eval_outputs`, `workspaces`.

Properties:

* reserved >= allocated, overall and per phase;
* the peak (overall, forward, backward) does not decrease when the batch or the sequence grows
  (peak reserved is not asserted: the caching allocator's segments make it non-monotone, e.g.
  Llama-3.2-3B full fine-tuning, bf16, batch 4: 41,012 MiB at 640 tokens, 39,138 MiB at 768);
* at the optimizer-step peak, weights, gradients and optimizer state equal their closed forms
  from the parameter shapes of the real model (built by transformers `from_config` on the meta
  device, where tied weights stay tied);
* with a GPU, no reserved figure exceeds what PyTorch's cache can have on it.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from memfit import estimate
from memfit.models.build import resolve_config
from memfit.train_setup import TASKS

MIN_BLOCK = 512  # kMinBlockSize (c10/cuda/CUDACachingAllocator.cpp): what memory_allocated counts per tensor
PHASES = ("forward", "backward", "optimizer", "eval")

#: Small bundled models (about a second per estimate at these sizes); none has tied weights in these tasks.
FAST = [
    ("sentence-transformers/all-MiniLM-L6-v2", "seq-cls"),
    ("distilbert-base-uncased", "seq-cls"),
    ("gpt2", "seq-cls"),
]
#: Models whose real parameters are shared (lm_head tied to the input embeddings).
TIED = [("gpt2", "causal-lm"), ("t5-small", "seq2seq-lm")]

FEW = settings(max_examples=5, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: No shrinking for the expensive properties: a failure is reported as found, not rerun many times.
NO_SHRINK = [Phase.explicit, Phase.generate]


@functools.lru_cache(maxsize=None)
def _estimate(model: str, task: str, gpu: str | None = None, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate(model, task=task, gpu=gpu, eval_samples=16, **fields)


def _cached(model: str, task: str, gpu: str | None = None, **fields):
    return _estimate(model, task, gpu, **dict(sorted(fields.items())))


# -- reserved >= allocated ------------------------------------------------------------------------
@pytest.mark.slow
@FEW
@given(model=st.sampled_from(FAST + TIED), batch=st.integers(1, 4), length=st.integers(8, 48),
       precision=st.sampled_from(["fp32", "bf16"]), eval_strategy=st.sampled_from(["no", "epoch"]))
def test_reserved_at_least_allocated(model, batch, length, precision, eval_strategy):
    r = _cached(*model, per_device_train_batch_size=batch, per_device_eval_batch_size=batch, max_length=length,
                precision=precision, eval_strategy=eval_strategy)
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes
    for phase in PHASES:
        assert r.reserved_by_phase.get(phase, 0) >= r.phases.get(phase, 0), phase
    assert r.device_used_bytes >= r.peak_reserved_bytes


# -- monotone in batch size and sequence length ----------------------------------------------------
def _assert_not_lower(small, large):
    assert large.peak_allocated_bytes >= small.peak_allocated_bytes
    for phase in ("forward", "backward"):
        assert large.phases[phase] >= small.phases[phase], phase


@pytest.mark.slow
@FEW
@given(model=st.sampled_from(FAST + TIED), length=st.integers(8, 40), batch=st.integers(1, 3),
       more=st.integers(1, 3))
def test_peak_not_lower_with_a_larger_batch(model, length, batch, more):
    small = _cached(*model, per_device_train_batch_size=batch, max_length=length)
    large = _cached(*model, per_device_train_batch_size=batch + more, max_length=length)
    _assert_not_lower(small, large)


@pytest.mark.slow
@FEW
@given(model=st.sampled_from(FAST + TIED), batch=st.integers(1, 3), length=st.integers(8, 40),
       more=st.integers(1, 24))
def test_peak_not_lower_with_longer_sequences(model, batch, length, more):
    short = _cached(*model, per_device_train_batch_size=batch, max_length=length)
    long = _cached(*model, per_device_train_batch_size=batch, max_length=length + more)
    _assert_not_lower(short, long)


# -- closed forms at the optimizer-step peak --------------------------------------------------------
def _rounded(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


@functools.lru_cache(maxsize=None)
def _real_model(model: str, task: str, weights_dtype: str):
    """The task model as `from_config` builds it (meta device, no weights; ties kept), with the
    head settings memfit gives a classification model (2 labels, a pad token)."""
    import transformers

    config = resolve_config(model).config
    if task == "seq-cls":
        config.num_labels = 2
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weights_dtype]
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return getattr(transformers, TASKS[task]).from_config(config, dtype=dtype)


def _closed_forms(model: str, task: str, weights_dtype: str, optim: str, max_grad_norm: float) -> dict[str, int]:
    real = _real_model(model, task, weights_dtype)
    params = list(real.parameters())  # each shared parameter once
    trainable = [p for p in params if p.requires_grad]
    weights = sum(_rounded(p.numel() * p.element_size()) for p in params)
    weights += sum(_rounded(b.numel() * b.element_size()) for b in real.buffers())
    grads = sum(_rounded(p.numel() * p.element_size()) for p in trainable)
    # AdamW: exp_avg and exp_avg_sq, zeros_like(param) (torch/optim/adamw.py `_init_group`)
    state = 2 * grads
    if optim == "adamw_torch_fused":
        state += MIN_BLOCK * len(trainable)  # a float32 `step` per parameter on the device (fused)
    if max_grad_norm > 0:
        state += MIN_BLOCK  # clip_grad_norm_'s total norm, kept by Trainer as `_grad_norm`
    return {"weights": weights, "gradients": grads, "optimizer_state": state,
            "params": sum(p.numel() for p in params)}


@pytest.mark.parametrize("model", FAST + TIED,
                         ids=lambda m: f"{m[0]}:{m[1]}")
@settings(max_examples=4, deadline=None, derandomize=True, database=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow])
@given(optim=st.sampled_from(["adamw_torch", "adamw_torch_fused"]), weights_dtype=st.sampled_from(["fp32", "bf16"]),
       max_grad_norm=st.sampled_from([0.0, 1.0]))
def test_weights_gradients_optimizer_state_closed_forms(model, optim, weights_dtype, max_grad_norm):
    r = _cached(*model, per_device_train_batch_size=2, max_length=16, optim=optim, weights_dtype=weights_dtype,
                max_grad_norm=max_grad_norm)
    expected = _closed_forms(*model, weights_dtype, optim, max_grad_norm)
    assert r.params == expected["params"]
    at_step = r.phase_breakdowns["optimizer"]
    for category in ("weights", "gradients", "optimizer_state"):
        assert at_step[category] == expected[category], category
    assert r.breakdown["weights"] == expected["weights"]  # weights are the same at every peak


# -- bounded by the GPU ------------------------------------------------------------------------------
@settings(max_examples=3, deadline=None, derandomize=True, database=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(32, 48))
def test_reserved_within_gpu_capacity(batch):
    r = _cached("sentence-transformers/all-MiniLM-L6-v2", "seq-cls", gpu="2GiB", per_device_train_batch_size=batch,
                max_length=256)
    capacity = r.gpu["total_bytes"] - r.non_pytorch_bytes  # what PyTorch's cache can reserve on the card
    assert r.peak_reserved_bytes <= capacity
    for phase in PHASES:
        assert (r.reserved_by_phase.get(phase) or 0) <= capacity, phase  # None: not reached (OOM)
