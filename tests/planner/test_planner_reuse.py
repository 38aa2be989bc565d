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


def _without_elapsed(report_json):
    return {k: v for k, v in report_json.items() if k != "elapsed_s"}


def test_zero_stages_of_one_setup_share_one_simulation_with_the_same_reports(tiny_bert_dir, monkeypatch):
    """ZeRO-1, ZeRO-2 and ZeRO-3 (with and without offload) of one setup simulate the same program: within
    memfit.parallel.rank.shared_simulations it runs once, and each rank-0 report equals the one simulated alone."""
    from memfit.estimator import estimate
    from memfit.parallel import rank
    from memfit.planner.launch import VARIANTS, parallel_setup_for
    from memfit.sim import engine

    setup = TrainSetup(model=tiny_bert_dir, max_length=16, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       eval_strategy="no", precision="fp16", compute_capability=(7, 5))
    pars = [parallel_setup_for(v, world_size=4, nodes=1, hidden_size=64, precision="fp16")
            for v in VARIANTS if v.key in ("zero1", "zero2", "zero3_offload_all")]
    alone = [_without_elapsed(estimate(setup, gpu="T4", parallel=p).to_json()) for p in pars]
    calls = []
    real = engine.simulate
    monkeypatch.setattr(engine, "simulate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with rank.shared_simulations():
        shared = [_without_elapsed(estimate(setup, gpu="T4", parallel=p).to_json()) for p in pars]
        estimate(setup.replace(per_device_train_batch_size=1, gradient_accumulation_steps=4), gpu="T4",
                 parallel=pars[0])  # another micro-batch: another program
    assert len(pars) == 3 and len(calls) == 2
    assert shared == alone
    with rank.shared_simulations():  # a new scope simulates again
        estimate(setup, gpu="T4", parallel=pars[0])
    assert len(calls) == 3


@pytest.mark.slow
def test_the_parallel_plan_is_the_same_with_and_without_shared_simulations(tmp_path_factory, monkeypatch):
    """A multi-GPU plan whose states do not fit one GPU (82.7M parameters, as tests/planner/test_plan_parallel.py),
    where ZeRO-1 fails and ZeRO-2 fits at the same micro-batch: the same result with one simulation fewer."""
    import contextlib

    from conftest import save_bert_config
    from memfit.parallel import rank
    from memfit.planner.parallel_plan import plan_parallel
    from memfit.sim import engine

    model = save_bert_config(tmp_path_factory, "bert1024", hidden_size=1024, num_hidden_layers=4,
                             num_attention_heads=16, intermediate_size=4096, vocab_size=30000)
    setup = TrainSetup(model=model, max_length=64, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       eval_strategy="no")
    calls = []
    real = engine.simulate
    monkeypatch.setattr(engine, "simulate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kw = dict(gpus="4x1400MiB", strategies=("zero1", "zero2", "zero3"))  # ZeRO-1 does not fit at micro-batch 8
    shared = plan_parallel(setup, **kw).to_json()
    shared_calls = len(calls)
    monkeypatch.setattr(rank, "shared_simulations", contextlib.nullcontext)
    alone = plan_parallel(setup, **kw).to_json()
    assert shared.pop("elapsed_s") >= 0 and alone.pop("elapsed_s") >= 0
    assert shared == alone and shared["chosen"] is not None
    variants = [(c["variant"], c["per_device_train_batch_size"]) for c in shared["candidates"]]
    assert ("zero1", 8) in variants and ("zero2", 8) in variants, variants
    assert shared_calls == len(calls) - shared_calls - 1, (shared_calls, len(calls) - shared_calls)


def test_a_repeated_partial_simulation_of_the_same_program_is_answered_from_the_first(tiny_bert_dir, monkeypatch):
    """Two requests whose setups differ only in `notes` (memfit.sim.program.same_program) simulate once, and the
    second gets the first's result."""
    from memfit.planner import memory_model

    calls = []
    real = memory_model._phase_peaks_of
    monkeypatch.setattr(memory_model, "_phase_peaks_of", lambda s, kw: calls.append(1) or real(s, kw))
    setup = TrainSetup(model=tiny_bert_dir, max_length=16, per_device_train_batch_size=2, eval_strategy="no")
    sims = memory_model.Simulations()
    first = sims.phase_peaks(setup, optimizer_steps=0)
    again = sims.phase_peaks(setup.replace(notes=[*setup.notes, "why a field has its value"]), optimizer_steps=0)
    other = sims.phase_peaks(setup.replace(per_device_train_batch_size=1), optimizer_steps=0)
    assert len(calls) == 2 and again is first and other is not first
