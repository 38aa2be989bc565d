"""Tied weights stay tied: in the meta build, in the simulation's materialisation, in a module's twin.

The reference is always a model built on real CPU tensors by transformers itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import (AutoModelForCausalLM, AutoModelForSeq2SeqLM, BartConfig, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, T5Config)

from memfit.models.build import _meta_copy, build_meta_model, shared_parameter_names, to_empty_tied
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup

V, H = 96, 32


def _gpt2(**kw):
    return GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0, **kw)


def _llama(**kw):
    return LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, max_position_embeddings=64, **kw)


def _t5():
    return T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)


def _bart():
    return BartConfig(vocab_size=V, d_model=H, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


CASES = {
    "gpt2": (_gpt2, AutoModelForCausalLM, "causal-lm"),
    "llama-tied": (lambda: _llama(tie_word_embeddings=True), AutoModelForCausalLM, "causal-lm"),
    "llama-untied": (lambda: _llama(tie_word_embeddings=False), AutoModelForCausalLM, "causal-lm"),
    "t5": (_t5, AutoModelForSeq2SeqLM, "seq2seq-lm"),
    "bart": (_bart, AutoModelForSeq2SeqLM, "seq2seq-lm"),
}


def _real(case):
    make, auto, _ = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(make())


def _unique(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_meta_build_has_the_real_models_parameters_and_ties(case):
    make, _, task = CASES[case]
    real = _real(case)
    meta = build_meta_model(TrainSetup(model=make(), task=task, max_length=16))
    assert all(p.is_meta for p in meta.parameters())
    assert _unique(meta) == _unique(real)
    assert shared_parameter_names(meta) == shared_parameter_names(real)


def test_the_real_models_do_tie():
    """The cases above would prove nothing if the real models had no tie."""
    assert shared_parameter_names(_real("gpt2")) == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" in shared_parameter_names(_real("t5"))
    assert shared_parameter_names(_real("llama-untied")) == {}


def test_plain_to_empty_unties_and_to_empty_tied_does_not():
    """The mechanism: nn.Module._apply gives each module's entry a new Parameter on a device change."""
    meta = build_meta_model(TrainSetup(model=_gpt2(), task="causal-lm", max_length=16))
    plain = build_meta_model(TrainSetup(model=_gpt2(), task="causal-lm", max_length=16))
    plain.to_empty(device="cpu")
    assert shared_parameter_names(plain) == {}  # what the simulation used to see
    to_empty_tied(meta, device="cpu")
    assert shared_parameter_names(meta) == {"lm_head.weight": "transformer.wte.weight"}
    assert all(p.device.type == "cpu" for p in meta.parameters())


from helpers import live_by_category as _live_after_last_step  # noqa: E402


def _deep(case):
    """The case's config with 8 blocks per stack: the splice simulates 5 and writes the rest."""
    config = CASES[case][0]()
    if case == "gpt2":
        config.n_layer = 8
    elif case == "t5":
        config.num_layers = config.num_decoder_layers = 8
    else:
        config.encoder_layers = config.decoder_layers = 8
    return config


@pytest.mark.parametrize("case", ["gpt2", "t5", "bart"])
@pytest.mark.parametrize("splice", [False, True])
def test_simulation_counts_a_shared_parameter_once(case, splice):
    """Weights, gradients and AdamW state of a tied model are those of the real model's unique parameters."""
    _, auto, task = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = auto.from_config(_deep(case))
    n = _unique(real)
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    sim = simulate(TrainSetup(model=_deep(case), task=task, per_device_train_batch_size=2, max_length=16,
                              weights_dtype="fp32", optim="adamw_torch", max_grad_norm=0.0), splice=splice)
    assert sim.params == n
    end, max_grads = _live_after_last_step(sim.trace)
    assert end["weights"] == 4 * n + buffers
    assert max_grads == 4 * n
    assert end["optimizer_state"] == 8 * n  # exp_avg + exp_avg_sq, fp32; `step` on the host (not fused)


def test_gpt2_estimate_weights_are_four_bytes_per_real_parameter(monkeypatch):
    """The bundled GPT-2 in fp32: weights, gradients and AdamW state of its 124,439,808 real parameters."""
    from memfit.estimator import estimate
    from memfit.models.catalog import load_bundled_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = AutoModelForCausalLM.from_config(load_bundled_config("gpt2"))  # real CPU tensors
    n = _unique(real)
    assert n == 124_439_808
    assert not list(real.buffers())
    r = estimate(TrainSetup(model="gpt2", per_device_train_batch_size=1, max_length=16, weights_dtype="fp32"))
    assert r.task == "causal-lm"
    assert r.params == r.trainable_params == n
    at_step = r.phase_breakdowns["optimizer"]
    # every tensor of GPT-2 is a multiple of 512 bytes: no allocator rounding in these sums
    assert at_step["weights"] == 4 * n
    assert at_step["gradients"] == 4 * n
    # exp_avg + exp_avg_sq (fp32); a 512-byte block (the allocator's smallest) for fused AdamW's float32
    # `step` of each unique parameter, and one for clip_grad_norm_'s total norm
    assert at_step["optimizer_state"] == 8 * n + 512 * (len(list(real.parameters())) + 1)


# -- a user's module: its twin has the same sharing and requires_grad -------------------------------------


def _user_gpt2(untie=False, freeze=()):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2LMHeadModel(_gpt2())
    if untie:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    for name, p in model.named_parameters():
        if name.startswith(freeze):
            p.requires_grad_(False)
    return model


def _grad_flags(model):
    return {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("untie", [False, True])
def test_module_twin_keeps_sharing_and_requires_grad(untie):
    # freezing a block *after* the tied embedding: a zip over parameters() of a twin with one extra
    # (untied) parameter shifts every flag after it onto the wrong parameter
    user = _user_gpt2(untie=untie, freeze=("transformer.h.1.",))
    twin = _meta_copy(user)
    assert all(p.is_meta for p in twin.parameters())
    assert shared_parameter_names(twin) == shared_parameter_names(user)
    assert _grad_flags(twin) == _grad_flags(user)
    assert _unique(twin) == _unique(user)
    assert all(p.device.type == "cpu" for p in user.parameters())


def test_module_twin_of_a_changed_model_is_a_meta_deepcopy():
    user = _user_gpt2()
    user.transformer.h[0].mlp.c_fc = nn.Linear(H, 4 * H)  # a layer the config cannot rebuild
    user.transformer.h[0].requires_grad_(False)
    twin = _meta_copy(user)
    assert [(n, p.shape) for n, p in twin.named_parameters(remove_duplicate=False)] == \
        [(n, p.shape) for n, p in user.named_parameters(remove_duplicate=False)]
    assert shared_parameter_names(twin) == shared_parameter_names(user)
    assert _grad_flags(twin) == _grad_flags(user)
    assert all(p.is_meta for p in twin.parameters())


def test_module_estimate_counts_the_users_trainable_parameters():
    from memfit.estimator import estimate

    user = _user_gpt2(freeze=("transformer.h.0.",))
    r = estimate(TrainSetup(model=user, per_device_train_batch_size=1, max_length=16))
    assert r.task == "causal-lm"  # the module's own head
    assert r.params == _unique(user)
    assert r.trainable_params == sum(p.numel() for p in user.parameters() if p.requires_grad)


def test_meta_init_moves_legacy_cpu_weights_and_keeps_them_shared():
    """XLNet makes weights with torch.FloatTensor(...), which ignores the default device."""
    from memfit.models.build import _meta_init

    class Legacy(nn.Module):
        def __init__(self):
            super().__init__()
            shared = nn.Parameter(torch.FloatTensor(4, 4))
            self.x = shared  # a cpu parameter registered twice
            self.y = shared
            self.z = nn.Linear(4, 4)
            self.z.weight = self.x

    with _meta_init():
        m = Legacy()
    assert all(p.is_meta for p in m.parameters())
    assert shared_parameter_names(m) == {"y": "x", "z.weight": "x"}
