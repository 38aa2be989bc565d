"""memfit.fit on a real (tiny) Trainer: OOMs in checkpoint saves and load-best-model are recovered and measured."""

import os

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import memfit.fitting.run as mf  # noqa: E402
from helpers import oom_error as _oom, tiny_trainer as _trainer  # noqa: E402

CHECKPOINT_FILES = ("trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth")


class _Snapshots(TrainerCallback):
    """The model's state dict after every checkpoint save, by optimizer step."""

    def __init__(self):
        self.by_step = {}

    def on_save(self, args, state, control, model=None, **kwargs):
        self.by_step[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _snapshots(trainer):
    snaps = _Snapshots()
    trainer.add_callback(snaps)
    return snaps.by_step


def _fail_model_saves(trainer, at_step, *, cpu_too):
    """OOM in `save_pretrained` at optimizer step `at_step`: for weights not on the CPU, or always."""
    original = trainer.model.save_pretrained

    def save_pretrained(output_dir, state_dict=None, **kwargs):
        not_cpu = state_dict is None or any(v.device.type != "cpu" for v in state_dict.values())
        if trainer.state.global_step == at_step and (not_cpu or cpu_too):
            raise _oom()
        return original(output_dir, state_dict=state_dict, **kwargs)

    trainer.model.save_pretrained = save_pretrained


def _equal(state, expected):
    return state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)


def _model_state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_save_oom_is_retried_with_weights_on_the_cpu(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    snaps = _snapshots(t)
    _fail_model_saves(t, 4, cpu_too=False)
    report = mf.fit(t, plan=False)
    assert report.steps_completed == report.steps_expected == 4
    assert [(r["phase"], r["step"]) for r in report.oom_recoveries] == [("save", 4)]
    assert "retry" in report.oom_recoveries[0]["change"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    last = get_last_checkpoint(str(tmp_path))
    assert last.endswith("checkpoint-4")
    assert all(os.path.isfile(os.path.join(last, name)) for name in CHECKPOINT_FILES)
    assert _equal(load_file(os.path.join(last, "model.safetensors")), snaps[4])

    resumed = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)  # loads model, optimizer, scheduler and RNG of checkpoint-4
    assert resumed.state.global_step == 4
    assert _equal(_model_state(resumed), snaps[4])


def test_save_oom_twice_skips_the_checkpoint_and_training_continues(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=1)
    snaps = _snapshots(t)
    _fail_model_saves(t, 3, cpu_too=True)
    report = mf.fit(t, plan=False)
    assert report.steps_completed == report.steps_expected == 4
    assert [(r["phase"], r["step"]) for r in report.oom_recoveries] == [("save", 3)]
    assert "skipped" in report.oom_recoveries[0]["change"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]  # no staging folder
    for step in (1, 2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        assert all(os.path.isfile(folder / name) for name in CHECKPOINT_FILES)
        assert _equal(load_file(folder / "model.safetensors"), snaps[step])


def _best_model_trainer(tmp_path):
    return _trainer(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                    load_best_model_at_end=True, metric_for_best_model="eval_loss", learning_rate=0.05)


def _fail_trainer_load(trainer):
    """OOM in the state-dict load of Trainer._load_best_model."""

    def load_state_dict(*args, **kwargs):
        raise _oom()

    trainer.model.load_state_dict = load_state_dict


def test_load_best_oom_copies_the_best_weights_in_place(tmp_path):
    t = _best_model_trainer(tmp_path)
    snaps = _snapshots(t)
    _fail_trainer_load(t)
    report = mf.fit(t, plan=False)
    best = t.state.best_model_checkpoint
    assert not best.endswith("checkpoint-4"), "the test needs a best checkpoint other than the last one"
    assert [r["phase"] for r in report.oom_recoveries] == ["load_best"]
    assert "in place" in report.oom_recoveries[0]["change"]
    assert _equal(_model_state(t), load_file(os.path.join(best, "model.safetensors")))
    assert not _equal(_model_state(t), snaps[4])


def test_load_best_oom_twice_keeps_the_last_weights(tmp_path, monkeypatch):
    import safetensors.torch

    t = _best_model_trainer(tmp_path)
    snaps = _snapshots(t)

    def load_file_oom(*args, **kwargs):
        raise _oom()

    monkeypatch.setattr(safetensors.torch, "load_file", load_file_oom)  # Trainer's load and memfit's retry
    report = mf.fit(t, plan=False)
    assert report.steps_completed == 4
    assert [r["phase"] for r in report.oom_recoveries] == ["load_best"]
    assert "last weights kept" in report.oom_recoveries[0]["change"]
    assert _equal(_model_state(t), snaps[4])


def test_save_and_load_best_are_measured_under_a_budget(tmp_path):
    t = _best_model_trainer(tmp_path)
    report = mf.fit(t, plan=False, budget_bytes=1 << 30)
    assert report.measured_with == "memory_budget"
    for phase in ("save", "load_best"):
        assert report.phases[phase]["measured_bytes"] > 0
        # predicted: weights + optimizer state, what stays on the GPU after the step and zero_grad; on the CPU
        # the budget also counts AdamW's per-parameter step counters (host tensors on CUDA), 512 B each, and
        # load_best's state dict read from the file (host memory on CUDA)
        params = list(t.model.parameters())
        host = 512 * (len(params) + 4) + (sum(p.numel() * p.element_size() for p in params)
                                          if phase == "load_best" else 0)
        extra = report.phases[phase]["measured_bytes"] - report.phases[phase]["predicted_bytes"]
        assert 0 <= extra <= host, (phase, extra, host)
    assert not report.oom_recoveries


def test_guard_is_undone_after_fit(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    mf.fit(t, plan=False)
    assert t._load_best_model.__func__ is Trainer._load_best_model


def test_skipped_best_checkpoint_is_not_kept_as_the_best(tmp_path):
    t = _best_model_trainer(tmp_path)  # step 1 has the best eval_loss
    original = t._save_optimizer_and_scheduler

    def save_optimizer(output_dir):  # after Trainer pointed best_model_checkpoint at the staged folder
        if t.state.global_step == 1:
            raise _oom()
        return original(output_dir)

    t._save_optimizer_and_scheduler = save_optimizer
    report = mf.fit(t, plan=False)
    assert report.steps_completed == 4
    assert [(r["phase"], r["step"]) for r in report.oom_recoveries] == [("save", 1)]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert t.state.best_model_checkpoint is None  # not the removed staging folder


def test_cpu_copies_keep_tied_weights_shared():
    from memfit.fitting import _trainer as adapter

    shared, other = torch.ones(3), torch.zeros(3)
    copies = adapter._cpu_copies({"embed": shared, "lm_head": shared, "other": other, "step": 7})
    assert copies["embed"] is copies["lm_head"] and copies["other"] is not copies["embed"]
    assert copies["step"] == 7
