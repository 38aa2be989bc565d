"""The planner's predicted-memory model and ranking (memfit.planner.memory_model, memfit.planner.ranking):
the pure rules that turn fitted peaks into a candidate's prediction, checked with hand-made numbers
(no simulation; memfit.planner.search's tests run them on real models)."""

from __future__ import annotations

from memfit.planner.memory_model import EvalFit, LinearFit, MemoryModel, OptimizerCost, eval_choice, train_peaks
from memfit.planner.ranking import Candidate

MiB = 2**20


def _fit(has_state: bool = False) -> LinearFit:
    keys = ("forward", "backward", "optimizer") if has_state else ("forward", "backward")
    return LinearFit({k: 100 * MiB for k in keys}, {k: 10 * MiB for k in keys}, 7 * MiB if has_state else 0,
                     1000, 10 if has_state else 1000, has_state)


def _model() -> MemoryModel:
    return MemoryModel({"adamw_torch": OptimizerCost(40 * MiB, 90 * MiB), "adafactor": OptimizerCost(5 * MiB, 60 * MiB)},
                       {}, None)


def test_linear_fit_grows_by_the_slope_per_extra_sample():
    assert _fit().at(1) == {"forward": 100 * MiB, "backward": 100 * MiB}
    assert _fit().at(4) == {"forward": 130 * MiB, "backward": 130 * MiB}


def test_train_peaks_carry_the_chosen_optimizers_state_and_step_peak():
    by, state = train_peaks(_model(), _fit(), "adafactor", False, 2)
    assert state == 5 * MiB
    assert by == {"forward": 115 * MiB, "backward": 115 * MiB, "optimizer": 60 * MiB}


def test_offload_takes_the_state_off_every_training_phase():
    by, state = train_peaks(_model(), _fit(), "adamw_torch", True, 1)
    assert state == 0
    assert by == {"forward": 100 * MiB, "backward": 100 * MiB, "optimizer": 50 * MiB}


def test_a_fit_with_its_own_state_ignores_the_optimizer_table():
    by, state = train_peaks(_model(), _fit(has_state=True), "adafactor", False, 3)
    assert state == 7 * MiB
    assert by == {"forward": 120 * MiB, "backward": 120 * MiB, "optimizer": 120 * MiB}


def test_eval_keeps_its_batch_size_when_it_fits():
    fit = EvalFit(200 * MiB, 10 * MiB, 30 * MiB)
    choice = eval_choice(fit, 5 * MiB, 8, 2, lambda pk: pk <= 205 * MiB)
    assert choice.changes == {} and choice.peak_bytes == 205 * MiB


def test_eval_falls_back_to_the_micro_batch_then_to_one():
    fit = EvalFit(200 * MiB, 10 * MiB, 30 * MiB)  # at eval batch 8; 10 MiB per sample
    to_micro = eval_choice(fit, 0, 8, 2, lambda pk: pk <= 150 * MiB)
    assert to_micro.changes == {"per_device_eval_batch_size": 2} and to_micro.peak_bytes == 140 * MiB
    to_one = eval_choice(fit, 0, 8, 2, lambda pk: pk <= 135 * MiB)
    assert to_one.changes == {"per_device_eval_batch_size": 1} and to_one.peak_bytes == 130 * MiB


def test_eval_that_never_fits_moves_outputs_to_the_cpu_at_batch_one():
    fit = EvalFit(200 * MiB, 10 * MiB, 30 * MiB)
    choice = eval_choice(fit, 0, 8, 2, lambda pk: False)
    assert choice.changes == {"per_device_eval_batch_size": 1, "eval_accumulation_steps": 1}
    assert choice.peak_bytes == 100 * MiB  # 200 - 7 x 10 - 30


def test_eval_never_raises_the_eval_batch_to_the_micro_batch():
    fit = EvalFit(200 * MiB, 10 * MiB, 30 * MiB)
    seen = []
    eval_choice(fit, 0, 2, 8, lambda pk: seen.append(pk) or False)
    assert seen == [200 * MiB, 190 * MiB]  # eval batch 2, then 1; never 8


def test_candidates_that_fit_rank_by_tier_then_time_the_others_by_need():
    fast_new_method = Candidate(True, 1, 0.5, 1, 900, 800, {"optim": "adafactor"})
    slow_same_method = Candidate(True, 0, 1.4, 2, 800, 700, {"gradient_checkpointing": True})
    short_by_a_little = Candidate(False, 0, 0.9, 1, 1100, 1000, {"per_device_train_batch_size": 2})
    short_by_a_lot = Candidate(False, 0, 0.8, 1, 5000, 4900, {"per_device_train_batch_size": 4})
    ranked = sorted([short_by_a_lot, fast_new_method, short_by_a_little, slow_same_method], key=Candidate.sort_key)
    assert ranked == [slow_same_method, fast_new_method, short_by_a_little, short_by_a_lot]


def test_an_effective_batch_of_one_predicts_each_combination_its_own_simulated_peak(tiny_bert_dir):
    """With an effective batch size of 1 every partial simulation runs at micro-batch 1, the only one searched: a
    combination's fit is its own simulated peaks (not a line through the setup's constant part as at batch 2)."""
    from types import SimpleNamespace

    from memfit.planner.memory_model import Axes, _linear_fits
    from memfit.train_setup import TrainSetup

    peaks = {False: 300 * MiB, True: 120 * MiB}  # by gradient checkpointing, at micro-batch 1

    class Sims:
        def phase_peaks(self, s, **_):
            assert s.per_device_train_batch_size == 1 and s.gradient_accumulation_steps == 1
            p = peaks[s.gradient_checkpointing]
            return {"forward": p, "backward": p}, {}, SimpleNamespace(params=10, trainable_params=10)

    setup = TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=1)
    axes = Axes(precisions=[{}], checkpointing=[{"gradient_checkpointing": False}, {"gradient_checkpointing": True}],
                optimizers=[{}], lengths=[{}], loras=[{}], freezes=[{}], offloads=[{}], micro_batches=[1])
    fits = _linear_fits(setup, axes, Sims())
    assert [f.at(1)["backward"] for f in fits.values()] == [300 * MiB, 120 * MiB]
