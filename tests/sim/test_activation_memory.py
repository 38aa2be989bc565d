"""Activation memory techniques: `gradient_checkpointing_kwargs` (use_reentrant, offload of the
checkpointed inputs through transformers' save_on_cpu) and TRL's activation offloading."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from memfit.errors import MemfitError
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup

L, S, H = 4, 512, 256


def _cfg():
    return LlamaConfig(hidden_size=H, intermediate_size=512, num_hidden_layers=L, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, max_position_embeddings=S, dtype="bfloat16")


def _live_after_forward(trace, category="activations") -> int:
    """Bytes of `category` alive when the first backward starts."""
    live: dict[int, int] = {}
    for e in trace:
        if e.phase == "backward":
            break
        if e.action == "alloc" and e.category == category:
            live[e.id] = e.size_bytes
        elif e.action == "free":
            live.pop(e.id, None)
    return sum(live.values())


def _sim(**kw):
    setup = TrainSetup(model=_cfg(), task="causal-lm", per_device_train_batch_size=2, max_length=S,
                       precision="bf16", gradient_checkpointing=True, **kw)
    return simulate(setup, optimizer_steps=1)


def test_offload_moves_the_checkpointed_block_inputs_to_the_host():
    plain = _live_after_forward(_sim().trace)
    off = _live_after_forward(_sim(gradient_checkpointing_kwargs={"offload": True}).trace)
    block_input = 2 * S * H * 2  # (B, S, H) bf16 hidden states, saved once per checkpointed block
    # each checkpointed block's saved input leaves the device (the last block's output stays: the head reads it)
    assert plain - off >= (L - 1) * block_input
    assert off < plain


def test_use_reentrant_reaches_torch_checkpoint():
    from memfit.models.blocks import enable_checkpointing
    from memfit.models.build import build_meta_model

    model = build_meta_model(TrainSetup(model=_cfg(), task="causal-lm"))
    enable_checkpointing(model, {"use_reentrant": True, "every_n_layers": 2})
    layers = model.model.layers
    assert layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": True}
    assert [bool(layer.gradient_checkpointing) for layer in layers] == [True, False, True, False]
    # and the reentrant run simulates (CheckpointFunction saves the inputs with save_for_backward)
    assert _sim(gradient_checkpointing_kwargs={"use_reentrant": True}).trace


def test_every_n_layers_keeps_the_other_layers_activations():
    every = _live_after_forward(_sim().trace)
    half = _live_after_forward(_sim(gradient_checkpointing_kwargs={"every_n_layers": 2}).trace)
    assert half > every


def test_trl_activation_offloading_leaves_only_small_and_head_tensors():
    setup = TrainSetup(model=_cfg(), task="causal-lm", per_device_train_batch_size=2, max_length=S, precision="bf16")
    plain = _live_after_forward(simulate(setup, optimizer_steps=1).trace)
    off = _live_after_forward(simulate(setup.replace(activation_offloading=True), optimizer_steps=1).trace)
    # what stays: tensors under 1024 bytes, the head's input, and storages saved twice (TRL's streams mode keeps
    # the second reference on the device: the fp32 log-softmax of the loss, the SwiGLU products) -> 20.5 of 52.6 MB
    assert off < plain / 2
    assert off >= 2 * S * 1000 * 4  # the (B, S, V) fp32 log-softmax, saved by log_softmax and by nll_loss


def test_bad_checkpoint_kwargs_are_clear_errors():
    with pytest.raises(MemfitError, match="`gradient_checkpointing_kwargs` key `reentrant` is not modelled"):
        TrainSetup(model=_cfg(), task="causal-lm", gradient_checkpointing_kwargs={"reentrant": False})
    with pytest.raises(MemfitError, match="must be true or false"):
        TrainSetup(model=_cfg(), task="causal-lm", gradient_checkpointing_kwargs={"offload": "yes"})
    s = TrainSetup.from_kwargs(_cfg(), task="causal-lm",
                               training_args={"activation_checkpointing": True,
                                              "activation_checkpointing_kwargs": {"offload": True}})
    assert s.gradient_checkpointing and s.gradient_checkpointing_kwargs == {"offload": True}
