"""Closed-form checks of the trace categories after the second optimizer step.

Weights, gradients and optimizer state have sizes known from the parameter shapes alone;
the simulated trace must reproduce them to the byte (sizes are raw `nbytes`).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BertConfig, GPT2Config

from memfit.models.build import build_meta_model
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup

GRAD_NORM = 4
H, L, V = 64, 2, 100  # 64 x 64 matrices have 4096 elements: the bitsandbytes 8-bit threshold


def _bert():
    return BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=4,
                      intermediate_size=2 * H, max_position_embeddings=64)


def _gpt2():
    return GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)


def _setup(**kw):
    model = kw.pop("model", None) or _bert()
    return TrainSetup(model=model, task=kw.pop("task", "seq-cls"), per_device_train_batch_size=2,
                      max_length=16, **kw)


from helpers import live_by_category as _live_by_category  # noqa: E402


def _meta(setup):
    model = build_meta_model(setup.replace(model=_bert() if isinstance(setup.model, BertConfig) else _gpt2()))
    return model


def _trainable(setup):
    """The trainable parameters of the setup's model, as the engine builds it (LoRA included)."""
    from memfit.sim.engine import _Runner

    return [p for p in _Runner(setup, fake=True, splice=False).model.parameters() if p.requires_grad]


@pytest.mark.parametrize("weights_dtype, size", [("fp32", 4), ("bf16", 2)])
def test_weights_bytes(weights_dtype, size):
    setup = _setup(weights_dtype=weights_dtype, optim="sgd")
    sim = simulate(setup)
    end, _ = _live_by_category(sim.trace)
    model = _meta(setup)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert all(p.element_size() == size for p in model.parameters())
    assert end["weights"] == params + buffers
    assert sim.params == sum(p.numel() for p in model.parameters())


def _optimizer_case(optim, **kw):
    setup = _setup(optim=optim, weights_dtype="fp32", **kw)
    sim = simulate(setup)
    end, max_grads = _live_by_category(sim.trace)
    trainable = _trainable(setup)
    n = sum(p.numel() for p in trainable)
    assert sim.trainable_params == n
    assert max_grads == 4 * n  # fp32 .grad of every trainable parameter
    assert end.get("gradients", 0) == 0  # zero_grad(set_to_none=True)
    state = end.get("optimizer_state", 0)
    if setup.max_grad_norm > 0:
        # clip_grad_norm_'s total norm: a float32 scalar the step keeps (engine `self.grad_norm`,
        # Trainer's `_grad_norm`), alive after the step and counted with the optimizer state
        state -= GRAD_NORM
    return state, trainable, n


@pytest.mark.parametrize("kw", [dict(), dict(gradient_accumulation_steps=3), dict(precision="bf16"),
                                dict(max_grad_norm=0.0)])
def test_adamw_torch(kw):
    state, _, n = _optimizer_case("adamw_torch", **kw)
    assert state == 8 * n  # exp_avg + exp_avg_sq; `step` is a host tensor (not fused)


def test_adamw_torch_fused():
    state, trainable, n = _optimizer_case("adamw_torch_fused")
    assert state == 8 * n + 4 * len(trainable)  # fused keeps a float32 `step` per parameter on the device


def test_sgd_no_momentum():
    state, _, _ = _optimizer_case("sgd")
    assert state == 0


def test_adafactor():
    # Trainer: Adafactor(scale_parameter=False, relative_step=False), beta1=None: no exp_avg.
    state, trainable, _ = _optimizer_case("adafactor")
    expected = 0
    for p in trainable:
        shape = p.shape
        if len(shape) >= 2:  # factored second moment: a row and a column vector
            expected += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]))
        else:
            expected += 4 * p.numel()
        expected += 4  # state["RMS"] = self._rms(p): a float32 device scalar per parameter
    assert state == expected


def test_adamw_bnb_8bit():
    state, trainable, _ = _optimizer_case("adamw_bnb_8bit")
    expected = 0
    for p in trainable:
        if p.numel() >= 4096:
            expected += 2 * p.numel() + 2 * 4 * math.ceil(p.numel() / 256)
        else:
            expected += 8 * p.numel()
    # the two 256-entry float32 quantization maps, moved to the device once (bitsandbytes/optim/optimizer.py
    # Optimizer2State.init_state: name2qmap["dynamic"], ["udynamic"]); before, memfit's AdamW8bit left them out
    expected += 2 * 256 * 4
    assert any(p.numel() >= 4096 for p in trainable) and any(p.numel() < 4096 for p in trainable)
    assert state == expected


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_lora_seq_cls(optim):
    r = 4
    state, trainable, n = _optimizer_case(optim, lora_r=r)
    # peft's BERT default targets: query and value (r x H and H x r each), in every layer;
    # SEQ_CLS adds the classifier head (H x 2 + 2) as a trainable modules_to_save copy.
    expected_n = L * 2 * (r * H + H * r) + (2 * H + 2)
    assert n == expected_n
    extra = 4 * len(trainable) if optim == "adamw_torch_fused" else 0
    assert state == 8 * n + extra


def test_lora_causal_lm():
    r = 2
    state, trainable, n = _optimizer_case("adamw_torch", lora_r=r, model=_gpt2(), task="causal-lm")
    # GPT-2 default target: c_attn (Conv1D H -> 3H): A is r x H, B is 3H x r; no head is trained.
    assert n == L * (r * H + 3 * H * r)
    assert state == 8 * n
