"""memfit.fit never deletes what it did not write, reports failed runs, resumes only from intact checkpoints,
and saves a checkpoint on SIGTERM / Ctrl-C (a real tiny Trainer, as in test_fit)."""

import json
import os
import signal

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback  # noqa: E402

import memfit.fitting.run as mf  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.fitting import _trainer as adapter  # noqa: E402
from memfit.fitting.checkpoint_files import checkpoint_problems  # noqa: E402
from memfit.fitting.interrupt import FitInterrupted, stop_on_signals  # noqa: E402
from memfit.fitting.preflight_check import check_budget  # noqa: E402
from memfit.testing import counted_bytes  # noqa: E402
from memfit.units import format_bytes  # noqa: E402
from helpers import tiny_trainer as _trainer  # noqa: E402


def _earlier(out, name, content="not memfit's"):
    """A folder an earlier run left in the output dir, with a file that must survive."""
    folder = out / name
    folder.mkdir(parents=True)
    (folder / "mine.txt").write_text(content)
    return folder


def _checkpoints(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", "earlier-")))


class _At(TrainerCallback):
    """Run `action()` at the beginning of optimizer step `step` (global_step == step)."""

    def __init__(self, step, action):
        self.step, self.action, self.done = step, action, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.done:
            self.done = True
            self.action()


# --------------------------------------------------------------------------- never delete


def test_save_total_limit_counts_only_this_runs_checkpoints(tmp_path):
    _earlier(tmp_path, "checkpoint-8")
    t = _trainer(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=1)
    report = mf.fit(t, plan=False)
    assert _checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    assert (tmp_path / "checkpoint-8" / "mine.txt").read_text() == "not memfit's"
    assert report.checkpoints == [str(tmp_path / "checkpoint-4")]
    assert any("save_total_limit=1" in n and "checkpoint-8" in n and "never deleted" in n for n in report.notes)
    assert t.args.save_total_limit == 1  # restored after training


def test_the_end_of_training_cleanup_of_save_total_limit_1_spares_earlier_runs(tmp_path):
    # Trainer removes every checkpoint but the best at the end of train() when save_total_limit == 1
    _earlier(tmp_path, "checkpoint-9")
    t = _trainer(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss", save_total_limit=1)
    mf.fit(t, plan=False)
    assert (tmp_path / "checkpoint-9" / "mine.txt").exists()
    ours = [c for c in _checkpoints(tmp_path) if c != "checkpoint-9"]
    assert ours == [os.path.basename(t.state.best_model_checkpoint)]


def test_a_checkpoint_of_the_same_step_from_an_earlier_run_is_set_aside(tmp_path):
    _earlier(tmp_path, "checkpoint-2")
    t = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    report = mf.fit(t, plan=False)
    assert _checkpoints(tmp_path) == ["checkpoint-2", "checkpoint-4", "earlier-checkpoint-2"]
    assert (tmp_path / "earlier-checkpoint-2" / "mine.txt").exists()
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert any("earlier-checkpoint-2" in n for n in report.notes)


def test_only_staging_folders_memfit_marked_are_cleaned(tmp_path):
    staging = tmp_path / adapter.STAGING_DIR
    _earlier(staging, "someone-elses")
    crashed = staging / "1234abcd"
    crashed.mkdir()
    (crashed / adapter.STAGING_MARKER).write_text("")
    (crashed / "half-written.bin").write_text("x")
    report = mf.fit(_trainer(tmp_path), plan=False)
    assert not crashed.exists()
    assert (staging / "someone-elses" / "mine.txt").exists()
    assert any("half-written checkpoint" in n for n in report.notes)


# --------------------------------------------------------------------------- failed runs


def test_a_failed_run_writes_its_report_and_raises(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=3)

    def boom():
        raise RuntimeError("boom\nsecond line")

    t.add_callback(_At(2, boom))
    path = tmp_path / "report.json"
    with pytest.raises(RuntimeError, match="boom") as info:
        mf.fit(t, plan=False, report_path=str(path))
    report = json.loads(path.read_text())
    assert report["status"] == "failed"
    assert report["error"] == {"type": "RuntimeError", "message": "boom", "phase": "train", "steps_completed": 2,
                               "last_checkpoint": str(tmp_path / "checkpoint-2")}
    assert report["steps_completed"] == 2 and report["steps_expected"] == 4
    assert info.value.memfit_report.status == "failed"
    assert any("report of this run" in n for n in info.value.__notes__)
    assert t.args.save_total_limit == 3  # what memfit took over while training is given back
    assert t._load_best_model.__func__ is Trainer._load_best_model  # the guards are undone


def test_the_phase_of_a_failed_save_is_save(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    original = t._save_rng_state

    def failing(output_dir):
        if t.state.global_step == 4:
            raise OSError("disk full")
        return original(output_dir)

    t._save_rng_state = failing
    with pytest.raises(OSError):
        mf.fit(t, plan=False, report_path=str(tmp_path / "r.json"))
    error = json.loads((tmp_path / "r.json").read_text())["error"]
    assert (error["phase"], error["type"], error["steps_completed"]) == ("save", "OSError", 4)


# --------------------------------------------------------------------------- budgets


def test_a_budget_below_weights_and_gradients_is_refused_before_training(tmp_path):
    t = _trainer(tmp_path)
    weights = counted_bytes(t.model)
    with pytest.raises(MemfitError, match=rf"weights alone \({format_bytes(weights)}\)"):
        mf.fit(t, plan=False, budget_bytes=weights // 2)
    with pytest.raises(MemfitError, match="but not their gradients") as info:
        mf.fit(t, plan=False, budget_bytes=weights + 1024)
    grads = counted_bytes(list(t.model.parameters()))  # every parameter is trainable; buffers have no gradient
    assert f"gradients ({format_bytes(grads)})" in str(info.value)
    assert f"less than {format_bytes(weights + grads)}" in str(info.value)
    assert t.state.global_step == 0


def test_a_budget_without_a_unit_is_refused():
    with pytest.raises(MemfitError, match="`300` has no unit.*`300MiB`"):
        check_budget("300")
    assert check_budget(300) == 300 and check_budget("300MiB") == 300 * 2**20


# --------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    t = _trainer(tmp_path_factory.mktemp("whole"), save_strategy="steps", save_steps=1)
    mf.fit(t, plan=False)
    return [p.detach().clone() for p in t.model.parameters()]


def _run_with_checkpoints(out):
    mf.fit(_trainer(out, save_strategy="steps", save_steps=1, max_steps=4), plan=False)


@pytest.mark.slow
def test_resume_skips_damaged_checkpoints_and_says_why(tmp_path, uninterrupted):
    _run_with_checkpoints(tmp_path)
    safetensors = tmp_path / "checkpoint-4" / "model.safetensors"
    os.truncate(safetensors, os.path.getsize(safetensors) // 2)
    os.remove(tmp_path / "checkpoint-3" / "optimizer.pt")
    again = _trainer(tmp_path, save_strategy="steps", save_steps=1)
    report = mf.fit(again, plan=False, resume_from_checkpoint=True)
    skipped = [n for n in report.notes if "skipped" in n]
    assert "checkpoint-4 skipped (model.safetensors is damaged" in skipped[0]
    assert "checkpoint-3 skipped (no optimizer.pt" in skipped[1] and "checkpoint-2" in skipped[1]
    assert report.steps_completed == 4
    # resumed from checkpoint-2 with its optimizer state: the same weights as the uninterrupted run
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, again.model.parameters()))
    # the damaged checkpoints are kept (renamed), not deleted
    assert {"earlier-checkpoint-3", "earlier-checkpoint-4"} <= set(os.listdir(tmp_path))


@pytest.mark.parametrize("damage, match", [
    (lambda f: os.remove(f / "optimizer.pt"), "no optimizer.pt"),
    (lambda f: os.remove(f / "trainer_state.json"), "no trainer_state.json"),
])
def test_a_damaged_checkpoint_is_never_resumed_silently(tmp_path, damage, match):
    out = tmp_path / "run"
    mf.fit(_trainer(out, save_strategy="steps", save_steps=4), plan=False)
    damage(out / "checkpoint-4")
    t = _trainer(out, save_strategy="steps", save_steps=4)
    with pytest.raises(MemfitError, match=f"cannot be resumed without losing state: {match}"):
        mf.fit(t, plan=False, resume_from_checkpoint=str(out / "checkpoint-4"))
    with pytest.raises(MemfitError, match=f"no intact checkpoint to resume from .*checkpoint-4: {match}"):
        mf.fit(t, plan=False, resume_from_checkpoint=True)
    assert t.state.global_step == 0


def test_an_empty_checkpoint_folder_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(MemfitError, match=r"\(checkpoint-3: empty folder\)"):
        mf.fit(_trainer(tmp_path), plan=False, resume_from_checkpoint=True)


# --------------------------------------------------------------------------- signals


def _send(signum, expected_handler_is_default):
    def action():
        # memfit's handler must be installed, else the signal would end the test process
        assert signal.getsignal(signum) is not expected_handler_is_default, "memfit's handler is not installed"
        os.kill(os.getpid(), signum)

    return action


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_writes_the_report_and_exits_with_its_code(tmp_path, signum, code):
    default = signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler
    assert signal.getsignal(signum) is default
    t = _trainer(tmp_path, save_strategy="no", eval_strategy="steps", eval_steps=1)  # no checkpoint unless asked
    t.add_callback(_At(2, _send(signum, default)))
    evaluations = []
    t.add_callback(type("E", (TrainerCallback,), {"on_evaluate": lambda self, *a, **k: evaluations.append(1)})())
    with pytest.raises(FitInterrupted) as info:
        mf.fit(t, plan=False, report_path=str(tmp_path / "r.json"))
    stop = info.value
    assert stop.code == code and isinstance(stop, SystemExit)
    assert stop.checkpoint == str(tmp_path / "checkpoint-3")  # the step during which the signal came, finished
    assert checkpoint_problems(stop.checkpoint) == ([], [])  # intact: a resume can start there
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["status"], report["interrupted"], report["steps_completed"]) == (
        "interrupted", signal.Signals(signum).name, 3)
    assert len(evaluations) == 2  # steps 1 and 2; not the stopping step's, nor the final one
    assert signal.getsignal(signum) is default  # the previous handler is back


def test_signal_handlers_are_restored_and_foreign_ones_left_alone():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with stop_on_signals() as stop:
            assert signal.getsignal(signal.SIGTERM) is mine  # the caller's own handler is not replaced
            assert signal.getsignal(signal.SIGINT) == stop._handle
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_second_ctrl_c_stops_at_once():
    with pytest.raises(KeyboardInterrupt):
        with stop_on_signals() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.signal_name == "SIGINT"
            signal.raise_signal(signal.SIGINT)  # the previous handler: Python's KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_checkpoint_a_signal_saved_survives_save_total_limit_1_with_a_best_model(tmp_path):
    # Trainer's rule for save_total_limit=1 keeps only the best checkpoint at the end of train()
    t = _trainer(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss", learning_rate=0.05,
                 save_total_limit=1)
    t.add_callback(_At(2, _send(signal.SIGTERM, signal.SIG_DFL)))
    with pytest.raises(FitInterrupted) as info:
        mf.fit(t, plan=False)
    assert t.state.best_model_checkpoint != info.value.checkpoint, "the test needs a best checkpoint before the last"
    assert os.path.isdir(info.value.checkpoint) and info.value.checkpoint.endswith("checkpoint-3")
