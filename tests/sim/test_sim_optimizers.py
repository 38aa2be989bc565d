"""The optimizer built without transformers.Trainer (memfit.sim.optimizers): the same class, keyword arguments
and decayed parameters as the Trainer's, and the same trace from a process that never imports the Trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, T5Config, Trainer

from helpers import SRC_DIR, trace_digest
from memfit.sim import optimizers
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup


@pytest.mark.parametrize("optim", sorted(optimizers.TORCH_ADAMW))
def test_adamw_class_and_kwargs_equal_the_trainers(optim):
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(optimizers._training_args(optim, 0.01), None)
    assert cls is torch.optim.AdamW
    assert kwargs == optimizers.TORCH_ADAMW[optim]


def _meta_model(config):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if isinstance(config, T5Config) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16),
], ids=["llama-rmsnorm", "t5-layer-norm"])
def test_decay_parameter_names_equal_the_trainers(config):
    model = _meta_model(config)
    expected = Trainer.get_decay_parameter_names(None, model)
    assert optimizers.decay_parameter_names(model) == expected
    assert 0 < len(expected) < len(list(model.named_parameters()))  # some parameters decay, some do not


def test_a_simulation_imports_no_trainer_and_traces_the_same(tiny_bert_dir):
    """A fresh process simulates without importing transformers.Trainer (nor peft, nor bitsandbytes) and
    writes the trace this process writes with the Trainer imported (tests/helpers imports it)."""
    kwargs = dict(model=tiny_bert_dir, max_length=32, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  eval_strategy="epoch", optim="adamw_torch_fused")
    code = (
        "import hashlib, json, sys\n"
        "from memfit.sim.engine import simulate\n"
        "from memfit.train_setup import TrainSetup\n"
        f"sim = simulate(TrainSetup(**{kwargs!r}))\n"
        "print(json.dumps({'digest': hashlib.sha256(repr(sim.trace).encode()).hexdigest(),\n"
        "                  'imported': [m for m in ('transformers.trainer', 'transformers.training_args', 'peft',\n"
        "                               'bitsandbytes') if m in sys.modules]}))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC_DIR), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["imported"] == []
    assert "transformers.trainer" in sys.modules  # here the Trainer is imported: the old path's situation
    assert child["digest"] == trace_digest(simulate(TrainSetup(**kwargs)).trace)


def test_other_optimizers_still_come_from_the_trainer(tiny_bert_dir):
    setup = TrainSetup(model=tiny_bert_dir, max_length=16, optim="adafactor")
    sim = simulate(setup, optimizer_steps=1, optimizer_only=True)
    assert any(e.category == "optimizer_state" for e in sim.trace)
