"""`memfit train`: nothing of earlier runs deleted, one-line errors instead of tracebacks, a report for failed
runs, SIGTERM saves and exits 143 (a real 2-layer BERT with MiniLM's tokenizer, as test_train_cli)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
from transformers import TrainerCallback  # noqa: E402

from helpers import SRC_DIR  # noqa: E402
import memfit.commands._train_common as train_common  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.commands.train import bundled_model_dir  # noqa: E402

if not bundled_model_dir():
    pytest.skip("bundled model not installed", allow_module_level=True)

ROWS = "text,label\n" + "".join(f"{w} film,{i % 2}\n" for i, w in enumerate(
    ["good", "bad", "fine", "awful", "nice", "dull", "great", "poor", "super", "weak"]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    d = tmp_path_factory.mktemp("tiny")
    BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64)).save_pretrained(d)
    AutoTokenizer.from_pretrained(bundled_model_dir()).save_pretrained(d)
    return d


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "ok.csv"
    p.write_text(ROWS, encoding="utf-8")
    return p


def _json(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj), encoding="utf-8")
    return str(p)


def _run(argv, capsys):
    code = main(["train"] + [str(a) for a in argv])
    return code, capsys.readouterr()


def _one_line(err):
    return err.count("\n") == 1 and "Traceback" not in err


def _with_callback(monkeypatch, callback):
    """Add `callback` to the Trainer `memfit train` builds (it is passed to fit with the progress bar)."""
    original = train_common.progress_callback
    monkeypatch.setattr(train_common, "progress_callback", lambda console: _Both(original(console), callback))


class _Both(TrainerCallback):
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __getattribute__(self, name):
        if name.startswith("on_"):
            a, b = object.__getattribute__(self, "a"), object.__getattribute__(self, "b")

            def both(*args, **kwargs):
                getattr(a, name)(*args, **kwargs)
                getattr(b, name)(*args, **kwargs)

            return both
        return object.__getattribute__(self, name)


class _At(TrainerCallback):
    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action()


@pytest.mark.slow
def test_earlier_checkpoints_and_results_are_kept_and_the_limit_is_said(tmp_path, tiny, data, capsys):
    out = tmp_path / "y"
    (out / "checkpoint-8").mkdir(parents=True)
    (out / "checkpoint-8" / "mine.txt").write_text("x")
    args = _json(tmp_path, "s.json", {"save_steps": 2, "max_steps": 2})  # the issue's own case
    code, res = _run([tiny, "--data", data, "--args", args, "--output-dir", out], capsys)
    assert code == 0, res.err
    assert (out / "checkpoint-8" / "mine.txt").read_text() == "x"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-8"]
    flat = " ".join(res.out.split())
    assert "save_total_limit=1, its default" in flat and "checkpoint-8) are never deleted" in flat
    first = json.loads((out / "memfit-report.json").read_text())
    # the same command again: the first run's model, report and checkpoint-2 are moved aside, not overwritten
    code, res = _run([tiny, "--data", data, "--args", args, "--output-dir", out], capsys)
    assert code == 0, res.err
    assert json.loads((out / "earlier-run-1" / "memfit-report.json").read_text()) == first
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out / "earlier-run-1"))
    assert (out / "earlier-checkpoint-2" / "trainer_state.json").exists() and (out / "checkpoint-2").exists()
    assert "moved to" in " ".join(res.out.split())


def test_num_labels_other_than_the_trained_head_gets_a_new_head(tmp_path, tiny, data, capsys):
    # transformers raises "You set `ignore_mismatched_sizes` to `False`" for a head of another shape
    code, res = _run([tiny, "--data", data, "--num-labels", "3", "--max-steps", "1", "--output-dir",
                      tmp_path / "out"], capsys)
    assert code == 0, res.err
    assert "head has 2 labels; --num-labels 3 replaces it" in " ".join(res.out.split())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["id2label"].keys() == {"0", "1", "2"}


def _damaged_model(tmp_path, tiny, how):
    d = tmp_path / f"model-{how}"
    d.mkdir()
    for name in os.listdir(tiny):
        (d / name).write_bytes((tiny / name).read_bytes())
    if how == "config-only":
        for name in os.listdir(d):
            if name != "config.json":
                os.remove(d / name)
    else:
        os.truncate(d / "model.safetensors", os.path.getsize(d / "model.safetensors") // 3)
    return d


@pytest.mark.parametrize("case, match", [
    ("--budget 1MiB", "is less than the model's weights alone (3.88 MiB); no setup trains in less than 7.74 MiB"),
    ("--budget 300", "memory budget `300` has no unit; write it with one, e.g. `300MiB`"),
    ("config-only", "no model weights (model.safetensors"),
    ("truncated", "model.safetensors is damaged"),
    ("--learning-rate -1", "`--learning-rate` must be > 0.0; got `-1.0`"),
    ("--epochs 0", "`--num-train-epochs` must be > 0.0"),
    ("--seed -1", "`--seed` must be >= 0 and <= 4294967295"),
    ("--max-length 100000", "longer than the model's 512 positions"),
    ("output-file", "is an existing file, not a folder"),
    ("output-under-file", "cannot be created"),
    ("output-is-model", "is the model directory itself"),
    ("output-holds-a-model", "holds a model memfit did not write (config.json, model.safetensors)"),
    ("args-weight-decay", "`weight_decay` in --args must be >= 0.0; got `-0.1`"),
    ("args-lr-text", "`learning_rate` in --args must be a number; got `'fast'`"),
    ("resume-empty", "no intact checkpoint to resume from"),
])
def test_bad_input_is_one_line_before_training(tmp_path, tiny, data, capsys, case, match):
    model, extra = tiny, []
    if case.startswith("--"):
        extra = case.split()
    elif case in ("config-only", "truncated"):
        model = _damaged_model(tmp_path, tiny, case)
    elif case == "output-file":
        extra = ["--output-dir", data]
    elif case == "output-under-file":
        extra = ["--output-dir", data / "sub"]
    elif case == "output-is-model":
        extra = ["--output-dir", tiny]
    elif case == "output-holds-a-model":
        extra = ["--output-dir", _damaged_model(tmp_path, tiny, "truncated")]
    elif case == "args-weight-decay":
        extra = ["--args", _json(tmp_path, "a.json", {"weight_decay": -0.1})]
    elif case == "args-lr-text":
        extra = ["--args", _json(tmp_path, "a.json", {"learning_rate": "fast"})]
    elif case == "resume-empty":  # mkdir -p c6/checkpoint-3; memfit train --output-dir c6 --resume
        (tmp_path / "c6" / "checkpoint-3").mkdir(parents=True)
        extra = ["--output-dir", tmp_path / "c6", "--resume"]
    extra = extra if "--output-dir" in map(str, extra) else extra + ["--output-dir", tmp_path / "out"]
    code, res = _run([model, "--data", data] + extra, capsys)
    assert code == 2 and _one_line(res.err), res.err
    assert match in res.err
    assert not (tmp_path / "out" / "memfit-report.json").exists()


def test_a_run_that_fails_part_way_writes_its_report_and_exits_1(tmp_path, tiny, data, capsys, monkeypatch):
    def boom():
        raise RuntimeError("the data loader died")

    _with_callback(monkeypatch, _At(2, boom))
    out = tmp_path / "out"
    args = _json(tmp_path, "a.json", {"max_steps": 3, "save_strategy": "steps", "save_steps": 1})
    code, res = _run([tiny, "--data", data, "--args", args, "--output-dir", out], capsys)
    assert code == 1 and _one_line(res.err), res.err
    assert "training failed after optimizer step 2/3 (train phase): RuntimeError: the data loader died" in res.err
    assert f"{out / 'checkpoint-2'} (continue with --resume)" in res.err
    report = json.loads((out / "memfit-report.json").read_text())
    assert report["status"] == "failed" and report["error"]["phase"] == "train"
    assert not (out / "model.safetensors").exists()  # no final model from a failed run


def test_a_failed_final_save_leaves_no_torn_model(tmp_path, tiny, data, capsys, monkeypatch):
    from transformers import Trainer

    original = Trainer.save_model

    def save_model(self, output_dir=None, _internal_call=False):
        if not _internal_call:  # the final save, not a checkpoint's
            original(self, output_dir, _internal_call)
            with open(os.path.join(output_dir, "model.safetensors"), "r+b") as fh:
                fh.truncate(100)
            raise OSError(28, "No space left on device")
        return original(self, output_dir, _internal_call)

    monkeypatch.setattr(Trainer, "save_model", save_model)
    out = tmp_path / "out"
    code, res = _run([tiny, "--data", data, "--max-steps", "1", "--output-dir", out], capsys)
    assert code == 1 and _one_line(res.err), res.err
    assert "(final_save phase): OSError" in res.err
    assert not (out / "model.safetensors").exists() and not (out / ".memfit-staging").exists()
    assert json.loads((out / "memfit-report.json").read_text())["error"]["phase"] == "final_save"


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path, tiny, data, capsys, monkeypatch):
    def term():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "memfit's handler is not installed"
        os.kill(os.getpid(), signal.SIGTERM)

    _with_callback(monkeypatch, _At(1, term))
    out = tmp_path / "out"
    args = _json(tmp_path, "a.json", {"max_steps": 50, "save_strategy": "no"})
    code, res = _run([tiny, "--data", data, "--args", args, "--output-dir", out], capsys)
    assert code == 143 and _one_line(res.err), res.err
    assert "SIGTERM received: training stopped after optimizer step 2/50" in res.err
    assert f"checkpoint {out / 'checkpoint-2'}" in res.err and "continue with --resume" in res.err
    report = json.loads((out / "memfit-report.json").read_text())
    assert (report["status"], report["interrupted"], report["steps_completed"]) == ("interrupted", "SIGTERM", 2)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.slow
def test_a_real_sigterm_from_outside(tmp_path, tiny, data):
    """The scheduler's case: another process sends SIGTERM to a running `memfit train`."""
    out = tmp_path / "out"
    args = _json(tmp_path, "a.json", {"max_steps": 100000, "save_strategy": "steps", "save_steps": 1,
                                      "save_total_limit": None})
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", "train", str(tiny), "--data", str(data), "--args",
                             args, "--output-dir", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint-1").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    report = json.loads((out / "memfit-report.json").read_text())
    assert report["status"] == "interrupted" and report["interrupted"] == "SIGTERM"
    last = report["checkpoints"][-1]
    assert last == str(out / f"checkpoint-{report['steps_completed']}")
    from memfit.fitting.checkpoint_files import checkpoint_problems

    assert checkpoint_problems(last)[0] == []
