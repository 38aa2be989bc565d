"""The planner reads a candidate's first micro-steps from the baseline's simulation where they are the same run
(memfit.planner.memory_model.Simulations), with the same result as simulating it."""

from __future__ import annotations

import pytest

from memfit.train_setup import TrainSetup


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
