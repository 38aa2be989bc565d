"""A run that memfit changed (here: AdamW -> Adafactor at step 0) resumes from its checkpoint with those changes."""

import json
import os

import pytest
import torch

import memfit.fitting.run as mf
from memfit.errors import MemfitError
from memfit.fitting.resume import STATE_FILE
from helpers import bigger_trainer as _bigger_trainer

STEPS = dict(max_steps=6, save_strategy="steps", save_steps=2)


class _Crash(RuntimeError):
    pass


def _crash_at(trainer, step):
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise _Crash(f"killed at step {step}")

    trainer.add_callback(Crash())


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    """Between Adafactor's peak and AdamW's first step: the first step switches optimizer."""
    d = tmp_path_factory.mktemp("probe")
    ada = mf.fit(_bigger_trainer(d / "ada", "adafactor", max_steps=2), plan=False, budget_bytes=1 << 30)
    adamw = mf.fit(_bigger_trainer(d / "adamw", "adamw_torch_fused", max_steps=2), plan=False, budget_bytes=1 << 30)
    ada_peak = max(v["measured_bytes"] for v in ada.phases.values() if v["measured_bytes"])
    return (ada_peak + adamw.phases["optimizer"]["measured_bytes"]) // 2


@pytest.mark.slow
def test_resume_reapplies_the_switched_optimizer_and_matches_an_uninterrupted_run(tmp_path, budget):
    whole = _bigger_trainer(tmp_path / "whole", "adamw_torch_fused", **STEPS)
    mf.fit(whole, plan=False, budget_bytes=budget)

    out = tmp_path / "crashed"
    first = _bigger_trainer(out, "adamw_torch_fused", **STEPS)
    _crash_at(first, 4)
    with pytest.raises(_Crash):
        mf.fit(first, plan=False, budget_bytes=budget)
    state = json.loads((out / "checkpoint-4" / STATE_FILE).read_text())
    assert state["optim"] == "adafactor" and state["step"] == 4

    again = _bigger_trainer(out, "adamw_torch_fused", **STEPS)  # the user's original arguments
    report = mf.fit(again, plan=False, budget_bytes=budget, resume_from_checkpoint=True)
    assert any("resume from" in c and "optim" in c for c in report.changes)
    assert not report.oom_recoveries  # the switch is not needed again: it was re-applied before training
    assert report.steps_completed == report.steps_expected == 6
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), again.model.parameters()))


def test_without_memfits_state_the_checkpoint_does_not_resume(tmp_path, budget):
    out = tmp_path / "crashed"
    first = _bigger_trainer(out, "adamw_torch_fused", **STEPS)
    _crash_at(first, 4)
    with pytest.raises(_Crash):
        mf.fit(first, plan=False, budget_bytes=budget)
    os.remove(out / "checkpoint-4" / STATE_FILE)
    again = _bigger_trainer(out, "adamw_torch_fused", **STEPS)
    # Adafactor's optimizer.pt does not load into the AdamW the arguments name (its groups have no betas)
    with pytest.raises(KeyError, match="betas"):
        mf.fit(again, plan=False, budget_bytes=budget, resume_from_checkpoint=True)


def test_bad_resume_inputs_are_clear_errors(tmp_path):
    t = _bigger_trainer(tmp_path / "empty", "adamw_torch_fused", max_steps=1)
    with pytest.raises(MemfitError, match="holds no checkpoint-N folder"):
        mf.fit(t, plan=False, resume_from_checkpoint=True)
    with pytest.raises(MemfitError, match="is not a folder"):
        mf.fit(t, plan=False, resume_from_checkpoint=str(tmp_path / "nope"))
    bad = tmp_path / "checkpoint-1"
    bad.mkdir()
    (bad / STATE_FILE).write_text("{not json")
    with pytest.raises(MemfitError, match="cannot be read"):
        mf.fit(t, plan=False, resume_from_checkpoint=str(bad))


def test_resume_true_continues_the_run_written_last_not_an_earlier_runs_larger_step(tmp_path):
    """An output_dir with an earlier run's checkpoint-4 and a new run's checkpoint-2 (started without resuming,
    crashed at step 3): `resume_from_checkpoint=True` resumes the new run (before: checkpoint-4, the other run)."""
    from memfit.fitting.resume import resolve_checkpoint

    out = tmp_path / "out"
    mf.fit(_bigger_trainer(out, "adamw_torch_fused", max_steps=4, save_strategy="steps", save_steps=2), plan=False,
           budget_bytes=1 << 30)
    second = _bigger_trainer(out, "adamw_torch_fused", **STEPS)
    _crash_at(second, 3)
    with pytest.raises(_Crash):
        mf.fit(second, plan=False, budget_bytes=1 << 30)
    assert (out / "checkpoint-4").is_dir() and (out / "earlier-checkpoint-2").is_dir()  # the first run's, kept
    again = _bigger_trainer(out, "adamw_torch_fused", **STEPS)
    choice = resolve_checkpoint(again, True)
    assert choice.path == str(out / "checkpoint-2")
    assert any("written after checkpoint-4" in n for n in choice.notes)
    # a checkpoint without memfit's write time (e.g. written by a plain Trainer): Trainer's rule, the largest step
    state, hidden = out / "checkpoint-2" / STATE_FILE, tmp_path / "state.json"
    os.replace(state, hidden)
    assert resolve_checkpoint(again, True).path == str(out / "checkpoint-4")
    os.replace(hidden, state)
    report = mf.fit(again, plan=False, budget_bytes=1 << 30, resume_from_checkpoint=True)
    assert report.steps_completed == 6 and any("written after checkpoint-4" in n for n in report.notes)
