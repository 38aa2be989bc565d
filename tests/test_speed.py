"""Issue 15, "first use is slow": each speed-up of the cold path changes no result.

Every test here compares what the faster path produces with what the slower one did (the same
optimizer, the same trace, the same report), or checks the condition that makes the speed-up exact.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, T5Config, Trainer

from memfit.sim import optimizers
from memfit.sim.engine import _Runner, simulate
from memfit.train_setup import TrainSetup

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _trace_digest(trace) -> str:
    return hashlib.sha256(repr(trace).encode()).hexdigest()


# -- the optimizer without transformers.Trainer (memfit.sim.optimizers) ------------------------------------


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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["imported"] == []
    assert "transformers.trainer" in sys.modules  # here the Trainer is imported: the old path's situation
    assert child["digest"] == _trace_digest(simulate(TrainSetup(**kwargs)).trace)


def test_other_optimizers_still_come_from_the_trainer(tiny_bert_dir):
    setup = TrainSetup(model=tiny_bert_dir, max_length=16, optim="adafactor")
    sim = simulate(setup, optimizer_steps=1, optimizer_only=True)
    assert any(e.category == "optimizer_state" for e in sim.trace)


# -- the cyclic collector paused (memfit.collector) ---------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, eval_strategy="epoch", precision="fp16"),
    dict(per_device_train_batch_size=1, gradient_checkpointing=True, optim="adamw_torch"),
    dict(per_device_train_batch_size=2, lora_r=4, lora_target_modules=("query", "value")),
], ids=["fp16-eval", "checkpointing", "lora"])
def test_no_simulated_storage_is_left_to_the_cyclic_collector(tiny_bert_dir, kwargs):
    """With the collector paused for the whole run, collecting afterwards frees no tracked storage: every
    free of the trace came from reference counting, so pausing the collector cannot move or drop one."""
    from memfit.collector import paused

    setup = TrainSetup(model=tiny_bert_dir, max_length=32, **kwargs)
    gc.collect()
    with paused():
        runner = _Runner(setup, fake=True, splice=True)
        sim = runner.run()
        before = len(runner.tracker.events)
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.collect()
    assert len(runner.tracker.events) == before
    assert _trace_digest(sim.trace) == _trace_digest(simulate(setup).trace)  # with the collector running


def test_paused_restores_the_previous_state():
    from memfit.collector import paused

    gc.disable()
    try:
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # was off: stays off
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError):
        with paused():
            1 / 0
    assert gc.isenabled()


def test_the_cli_pauses_the_collector_for_estimate_only_while_it_runs(tiny_bert_dir, monkeypatch, capsys):
    import memfit.commands.estimate as est_cmd
    from memfit.cli import main

    seen = []
    monkeypatch.setattr(est_cmd, "render", lambda report, **_: seen.append(gc.isenabled()))
    assert main(["estimate", tiny_bert_dir, "--max-length", "16", "--no-cache"]) == 0
    assert seen == [False] and gc.isenabled()


# -- to_empty without converting meta tensors (memfit.models.build.to_empty_tied) ---------------------------


def _layout(module):
    out, first = [], {}
    for kind, items in (("p", module.named_parameters(remove_duplicate=False)),
                        ("b", module.named_buffers(remove_duplicate=False))):
        for name, t in items:
            out.append((kind, name, tuple(t.shape), t.stride(), t.dtype, str(t.device), t.requires_grad,
                        isinstance(t, torch.nn.Parameter), t.untyped_storage().nbytes(), t.storage_offset(),
                        first.setdefault(id(t), name)))  # the first name of a tensor: its tying
    return out


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("model", ["gpt2", "t5-small", "xlnet-base-cased"])
def test_to_empty_tied_equals_module_to_empty(model, fake):
    """Every parameter and buffer as `Module.to_empty` made them (shape, strides, dtype, grad flag, storage size,
    tying), with a non-contiguous buffer among them."""
    from memfit.models.build import build_meta_model, shared_parameter_names, to_empty_tied, _retie
    from memfit.sim import _torch_adapter as adapter

    setup = TrainSetup(model=model, task="causal-lm" if model == "gpt2" else "seq-cls")
    models = [build_meta_model(setup) for _ in range(2)]
    for m in models:
        m.register_buffer("memfit_test_transposed", torch.empty(3, 5, device="meta").t())
    with adapter.new_fake_mode() if fake else torch.no_grad():
        to_empty_tied(models[0], device="cpu")
        aliases = shared_parameter_names(models[1])
        models[1].to_empty(device="cpu")  # the old path
        _retie(models[1], aliases)
    assert _layout(models[0]) == _layout(models[1])
    assert any(not t.is_contiguous() for t in models[0].buffers())


# -- the planner reuses the baseline's first micro-steps (memfit.planner.memory_model.Simulations) ----------


@pytest.fixture(scope="module")
def bert8_dir(tmp_path_factory):
    """8 small BERT layers: long enough for memfit.sim.splice to cut (more than K + 1 = 6)."""
    from conftest import save_bert_config

    return save_bert_config(tmp_path_factory, "bert8", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                            intermediate_size=128, vocab_size=200)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_fit_read_from_the_baseline_equals_its_simulation(bert8_dir, precision):
    from memfit.estimator import estimate
    from memfit.planner.memory_model import Simulations

    base = TrainSetup(model=bert8_dir, max_length=32, per_device_train_batch_size=1, gradient_accumulation_steps=16,
                      eval_strategy="epoch", precision=precision, compute_capability=(7, 5))
    report = estimate(base, gpu="T4")
    fit = base.replace(gradient_accumulation_steps=2)
    sims = Simulations(baseline=(base, report))
    reused = sims.phase_peaks(fit, optimizer_steps=0)
    assert sims.count == 0  # read, not simulated
    fresh = Simulations().phase_peaks(fit, optimizer_steps=0)
    assert reused.peak_bytes == fresh.peak_bytes and reused.breakdown_bytes == fresh.breakdown_bytes
    assert (reused.sim.params, reused.sim.trainable_params) == (fresh.sim.params, fresh.sim.trainable_params)
    # anything else is simulated: another batch size, optimizer steps, another accumulation at the baseline
    for other, kwargs in ((fit.replace(per_device_train_batch_size=2), {"optimizer_steps": 0}),
                          (fit, {"optimizer_steps": 1}), (fit, {})):
        sims.phase_peaks(other, **kwargs)
    assert sims.count == 3
    single = Simulations(baseline=(base.replace(gradient_accumulation_steps=1), report))
    single.phase_peaks(fit, optimizer_steps=0)
    assert single.count == 1


@pytest.mark.slow
def test_the_plan_is_the_same_with_and_without_the_reuse(bert8_dir, monkeypatch):
    from memfit.planner import memory_model
    from memfit.planner.search import plan

    setup = TrainSetup(model=bert8_dir, max_length=64, per_device_train_batch_size=1, gradient_accumulation_steps=8,
                       eval_strategy="epoch")
    reused = plan(setup, gpu="1GiB").to_json()
    monkeypatch.setattr(memory_model.Simulations, "_reused", lambda self, setup, kwargs: None)
    simulated = plan(setup, gpu="1GiB").to_json()
    assert reused["simulations"] == simulated["simulations"] - 1
    for out in (reused, simulated):
        out.pop("elapsed_s"), out.pop("simulations")
    assert reused == simulated
