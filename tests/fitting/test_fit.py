"""memfit.fit on a real (tiny) Trainer: recovery keeps steps, batch and gradients; eval OOMs; atomic saves."""

import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import memfit.fitting.run as mf  # noqa: E402

from helpers import CFG, TinyDataset as _DS, collate as _collate, inject_train_oom as _inject_train_oom  # noqa: E402
from helpers import oom_error as _oom, tiny_trainer as _trainer, weights_of as _weights  # noqa: E402


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    t = _trainer(tmp_path_factory.mktemp("base"))
    report = mf.fit(t, plan=False)
    return report, _weights(t)


def _close(w0, w1, tol=1e-6):
    return max((a - b).abs().max().item() for a, b in zip(w0, w1)) < tol


def test_injected_oom_in_second_micro_step_recovers_exactly(tmp_path, baseline):
    base_report, base_w = baseline
    t = _trainer(tmp_path)
    _inject_train_oom(t, at_call=4, min_batch=8)  # micro-step 4 = 2nd of the 2nd window
    report = mf.fit(t, plan=False, report_path=str(tmp_path / "r.json"))
    assert report.steps_completed == report.steps_expected == base_report.steps_completed == 4
    assert report.effective_batch_size == base_report.effective_batch_size == 16
    assert len(report.oom_recoveries) == 1
    rec = report.oom_recoveries[0]
    assert rec["phase"] == "train" and rec["step"] == 1 and "2 chunks" in rec["change"]
    assert report.micro_batch_chunks == 2
    assert t.args.per_device_train_batch_size == 8 and t.args.gradient_accumulation_steps == 2
    assert _close(base_w, _weights(t))
    assert os.path.isfile(tmp_path / "r.json")


def test_memory_budget_oom_recovers_with_same_weights(tmp_path, baseline):
    base_report, base_w = baseline
    probe = _trainer(tmp_path / "probe")
    measured = mf.fit(probe, plan=False, budget_bytes=1 << 30).phases
    peak = max(measured["forward"]["measured_bytes"], measured["backward"]["measured_bytes"])
    state = measured["optimizer"]["measured_bytes"]
    budget = int(peak - 0.3 * (peak - state))
    t = _trainer(tmp_path / "run")
    report = mf.fit(t, plan=False, budget_bytes=budget)
    assert report.oom_recoveries, "the budget should have been exceeded"
    assert report.steps_completed == report.steps_expected == 4
    assert report.effective_batch_size == 16
    assert report.measured_with == "memory_budget"
    assert report.phases["backward"]["measured_bytes"] <= budget
    assert _close(base_w, _weights(t))


def test_eval_oom_lowers_eval_batch_not_train_batch(tmp_path):
    t = _trainer(tmp_path, per_device_eval_batch_size=16)
    original = t.evaluate

    def evaluate(*a, **k):
        if t.args.per_device_eval_batch_size > 4:
            raise _oom()
        return original(*a, **k)

    t.evaluate = evaluate
    report = mf.fit(t, plan=False)
    assert [r["phase"] for r in report.oom_recoveries] == ["eval", "eval"]
    assert t.args.per_device_eval_batch_size == 4 and t.args.eval_accumulation_steps == 1
    assert t.args.per_device_train_batch_size == 8
    assert "eval_loss" in report.final_metrics
    assert report.steps_completed == 4


def test_failed_save_leaves_no_corrupt_checkpoint(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=2)
    original = t._save_rng_state
    calls = {"n": 0}

    def failing(output_dir):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return original(output_dir)

    t._save_rng_state = failing
    with pytest.raises(OSError, match="disk full"):
        mf.fit(t, plan=False)
    names = sorted(os.listdir(tmp_path))
    assert names == ["checkpoint-2"], names  # no checkpoint-4, no staging folder
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-2")
    assert os.path.isfile(tmp_path / "checkpoint-2" / "trainer_state.json")


def test_checkpoints_rotate_and_are_complete(tmp_path):
    t = _trainer(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=2)
    mf.fit(t, plan=False)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4"]


def test_unrecoverable_oom_is_raised(tmp_path):
    t = _trainer(tmp_path)
    _inject_train_oom(t, at_call=1, min_batch=1)
    with pytest.raises(torch.OutOfMemoryError, match="memfit: out of memory"):
        mf.fit(t, plan=False, max_recoveries=2)


def test_preflight_flags_and_setup(tmp_path):
    t = _trainer(tmp_path, per_device_eval_batch_size=32)

    class Tok:
        model_max_length = int(1e30)

    t.processing_class = Tok()
    pre = mf.preflight(t)
    kinds = {f.kind for f in pre.flags}
    assert {"no_max_length", "eval_batch_larger"} <= kinds
    assert all(f.fix for f in pre.flags)
    assert pre.longest_example == max(len(x["input_ids"]) for x in _DS().items)
    assert pre.setup.sequence_length == pre.longest_example
    assert pre.setup.task == "seq-cls" and pre.setup.per_device_train_batch_size == 8
    assert pre.fits is None


def test_plan_applied_when_budget_too_small(tmp_path):
    t = _trainer(tmp_path, bs=16, ga=1)
    log = []
    applied = mf.apply_plan(t, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}, log)
    assert applied == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}
    assert t.get_train_dataloader().total_batch_size == 4 if hasattr(t.get_train_dataloader(), "total_batch_size") \
        else next(iter(t.get_train_dataloader()))["input_ids"].shape[0] == 4
    report = mf.fit(t, plan=False)
    assert report.effective_batch_size == 16 and report.steps_completed == 4


def test_public_fit(tmp_path):
    import memfit

    t = _trainer(tmp_path, bs=32, ga=1)
    report = memfit.fit(t, plan=False)
    assert report.steps_completed == 2


def test_report_feeds_prediction_error_back_into_the_margin(tmp_path):
    t = _trainer(tmp_path, bs=32, ga=1)
    report = mf.fit(t, plan=False, budget_bytes=4 * 2**30)
    assert report.prediction_error, "measured and predicted peaks are compared"
    worst = max([e for e in report.prediction_error.values() if e > 0], default=0.0)
    assert report.suggested_margin >= min(0.45, worst)
    assert 0.05 <= report.suggested_margin <= 0.45


class _LongDS(torch.utils.data.Dataset):
    """64 examples of 256 tokens: activations dominate the tiny model's memory."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.items = [{"input_ids": torch.randint(1, 100, (256,), generator=g).tolist(), "labels": i % 2}
                      for i in range(64)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_plan_is_applied_when_the_setup_does_not_fit(tmp_path):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**{**CFG, "hidden_size": 128, "intermediate_size": 512,
                                                        "max_position_embeddings": 256}))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=32, gradient_accumulation_steps=1,
                             num_train_epochs=1, report_to="none", logging_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True, save_strategy="no")
    t = Trainer(model=model, args=args, train_dataset=_LongDS(), data_collator=_collate)
    need = mf.preflight(t, budget_bytes=4 << 30).estimate.device_used_bytes
    report = mf.fit(t, budget_bytes=int(need * 0.75))
    assert report.plan_applied is not None and report.plan_applied["setup_changes"]
    assert report.steps_completed == report.steps_expected
    assert report.effective_batch_size == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_bytes=-5), "not a positive number of bytes"),
    (dict(budget_bytes="abc"), "is not a size"),
    (dict(max_recoveries=-1), "whole number >= 0"),
    (dict(margin=5), "between 0 and 0.5"),
    (dict(resume_from_checkpoint=3), "not a path or a bool"),
    (dict(plan="yes"), "plan `'yes'` is not a bool"),
    (dict(gpu=5), "gpu `5` is not a GPU"),
])
def test_bad_fit_arguments_are_clear_errors_before_anything_runs(tmp_path, kwargs, match):
    from memfit.errors import MemfitError

    t = _trainer(tmp_path)
    with pytest.raises(MemfitError, match=match):
        mf.fit(t, **kwargs)
    assert t.state.global_step == 0


def test_preflight_and_fit_refuse_what_is_not_a_trainer(tmp_path):
    from memfit.errors import MemfitError

    for call in (mf.preflight, mf.fit):
        with pytest.raises(MemfitError, match="is not a transformers.Trainer"):
            call(object())
    with pytest.raises(MemfitError, match="is not a size"):
        mf.preflight(_trainer(tmp_path), budget_bytes="lots")
