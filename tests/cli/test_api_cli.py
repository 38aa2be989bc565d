"""Estimate, plan and the API: --check, the one --args reader, cudaMallocAsync, API entry errors,
short reprs, --version, the reserved figure at the allocated peak, no FutureWarnings."""

import json
import os
import subprocess
import sys
from pathlib import Path
import warnings

import pytest

from helpers import SRC_DIR
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.estimator import estimate
from memfit.train_setup import TRAINING_ARGS_NAMES, TrainSetup


def _write(tmp_path, data, name="a.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data), encoding="utf-8")
    return str(p)


# -- 1. --check ---------------------------------------------------------------------------------
def test_check_exits_1_with_one_line_when_it_does_not_fit(tiny_bert_dir, capsys):
    argv = ["estimate", tiny_bert_dir, "--batch-size", "64", "--max-length", "512", "--gpu", "300MiB"]
    assert main(argv) == 0  # without --check: a report, exit 0
    capsys.readouterr()
    assert main(argv + ["--check", "--json"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit estimate --check: does not fit") and "short by" in err[0]


def test_check_exits_0_when_it_fits(tiny_bert_dir, capsys):
    assert main(["estimate", tiny_bert_dir, "--max-length", "16", "--gpu", "T4", "--check"]) == 0


def test_check_needs_a_gpu(tiny_bert_dir, capsys, monkeypatch):
    import memfit.sim.engine as engine

    monkeypatch.setattr(engine, "simulate", lambda *a, **k: pytest.fail("simulated before the error"))
    assert main(["estimate", tiny_bert_dir, "--check"]) == 2
    assert "`--check` needs a GPU" in capsys.readouterr().err


# -- 2. one --args reader -------------------------------------------------------------------------
def test_args_without_model_uses_the_file_and_its_model(tiny_bert_dir, tmp_path, capsys):
    path = _write(tmp_path, {"model": tiny_bert_dir, "per_device_train_batch_size": 3, "max_seq_length": 24})
    assert main(["estimate", "--args", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["model"] == tiny_bert_dir and data["setup"]["per_device_train_batch_size"] == 3
    assert data["setup"]["max_length"] == 24  # the legacy TRL name, read as max_length
    assert any("max_seq_length" in n and "max_length" in n for n in data["notes"])


def test_args_without_any_model_says_a_model_is_needed(tmp_path, capsys):
    path = _write(tmp_path, {"per_device_train_batch_size": 2})
    assert main(["estimate", "--args", path]) == 2
    err = capsys.readouterr().err
    assert "names no model" in err and "MODEL" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("verb", ["estimate", "plan"])
def test_unknown_key_is_an_error_with_the_closest_name(verb, tiny_bert_dir, tmp_path, capsys):
    path = _write(tmp_path, {"per_device_train_batchsize": 2})
    argv = [verb, tiny_bert_dir, "--args", path] + (["--gpu", "T4"] if verb == "plan" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown setting `per_device_train_batchsize`" in err and "did you mean `per_device_train_batch_size`" in err


def test_diagnose_reads_args_the_same_way(tmp_path, capsys):
    path = _write(tmp_path, {"evaluation_strategyy": "epoch"})
    assert main(["diagnose", "--text", "CUDA out of memory. Tried to allocate 2.00 GiB", "--args", path]) == 2
    assert "did you mean `eval_strategy`" in capsys.readouterr().err


def test_flag_wins_over_the_file_with_a_note(tiny_bert_dir, tmp_path, capsys):
    path = _write(tmp_path, {"per_device_train_batch_size": 8, "max_length": 16})
    assert main(["estimate", tiny_bert_dir, "--args", path, "--batch-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["per_device_train_batch_size"] == 2
    assert any("per_device_train_batch_size" in n and "overrides 8" in n for n in data["notes"])


def test_training_args_names_match_the_installed_transformers():
    import dataclasses

    from transformers import TrainingArguments

    assert TRAINING_ARGS_NAMES == {f.name for f in dataclasses.fields(TrainingArguments)}


def test_legacy_names_are_not_current_names():
    from memfit.train_setup import LEGACY_ARG_NAMES

    assert not set(LEGACY_ARG_NAMES) & TRAINING_ARGS_NAMES


def _train_args(tmp_path, data, **flags):
    import argparse

    from memfit.commands.train import train_command_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    train_command_parser(sub)
    argv = ["train", "--args", _write(tmp_path, data)]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parser.parse_args(argv)


def test_train_takes_output_dir_and_no_cuda_from_the_file(tmp_path):
    from transformers import TrainingArguments

    from memfit.commands._train_common import training_kwargs

    args = _train_args(tmp_path, {"output_dir": str(tmp_path / "from-file"), "no_cuda": True, "max_steps": 2},
                       output_dir=tmp_path / "from-flag")
    kwargs, notes = training_kwargs(args, is_default=False)
    assert kwargs.pop("output_dir") == str(tmp_path / "from-flag")  # the flag wins ...
    assert any("--output-dir" in n and "the flag wins" in n for n in notes)  # ... with a note
    assert kwargs.pop("use_cpu") is True and any("no_cuda" in n for n in notes)
    # what train_command then builds: each name once (it was "got multiple values for keyword argument")
    TrainingArguments(output_dir=str(tmp_path / "from-flag"), use_cpu=True, **kwargs)


def test_train_rejects_unknown_and_estimate_only_names(tmp_path):
    from memfit.commands._train_common import training_kwargs

    with pytest.raises(MemfitError, match="did you mean `learning_rate`"):
        training_kwargs(_train_args(tmp_path, {"learning_rat": 1e-4}), is_default=False)
    with pytest.raises(MemfitError, match="does not take"):
        training_kwargs(_train_args(tmp_path, {"lora_r": 8}), is_default=False)


# -- 3. cudaMallocAsync ---------------------------------------------------------------------------
def test_cuda_malloc_async_is_said_to_be_not_modelled(tiny_bert_dir, capsys):
    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4", alloc_conf="backend:cudaMallocAsync")
    assert "backend:cudaMallocAsync" in r.alloc_conf
    assert any("NOT modelled" in n for n in r.notes)
    assert main(["estimate", tiny_bert_dir, "--max-length", "16", "--gpu", "T4",
                 "--alloc-conf", "backend:cudaMallocAsync"]) == 0
    assert "NOT modelled" in capsys.readouterr().out


# -- 4. the API -----------------------------------------------------------------------------------
def test_estimate_none_is_an_error():
    with pytest.raises(MemfitError, match="needs a model"):
        estimate(None)
    with pytest.raises(MemfitError, match="needs a model"):
        estimate()


def test_estimate_unknown_keyword_suggests_the_field(tiny_bert_dir):
    with pytest.raises(MemfitError, match="`batch_size`.*per_device_train_batch_size"):
        estimate(tiny_bert_dir, batch_size=4)
    with pytest.raises(MemfitError, match="per_device_train_batch_size"):
        estimate(TrainSetup(model=tiny_bert_dir), batch_size=4)


def test_estimate_accepts_training_arguments_names(tiny_bert_dir):
    r = estimate(tiny_bert_dir, fp16=True, max_length=16)
    assert r.setup["precision"] == "fp16"


def test_plan_without_gpu_is_an_error(tiny_bert_dir):
    from memfit import plan

    with pytest.raises(MemfitError, match="needs `gpu`"):
        plan(tiny_bert_dir)


def test_reports_have_a_short_repr(tiny_bert_dir):
    from transformers import BertConfig

    from memfit.fitting.preflight_check import PreflightReport

    config = BertConfig.from_pretrained(tiny_bert_dir)
    r = estimate(TrainSetup(model=config, max_length=16), gpu="T4")
    text = repr(r)
    assert len(text) < 300 and "fits=True" in text and "T4" in text and "hidden_size" not in text
    p = PreflightReport(setup=TrainSetup(model=config, max_length=16), estimate=r, gpu="T4", budget_bytes=None,
                        fits=True)
    text = repr(p)
    assert len(text) < 300 and "fits=True" in text and "hidden_size" not in text and "peak_reserved" in text


def test_version(capsys):
    import memfit

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"memfit {memfit.__version__}"


def test_default_case_is_described_without_a_file_users_lack():
    import inspect

    import memfit.commands.estimate as est
    import memfit.commands.plan as pl

    assert "seed-summary" not in inspect.getsource(est) and "seed-summary" not in inspect.getsource(pl)
    assert "xlnet-large-cased" in est.SEED_CASE_TEXT and "V100" in est.SEED_CASE_TEXT


# -- 5. output ------------------------------------------------------------------------------------
def test_reserved_figure_is_of_the_allocated_peak(tiny_bert_dir, capsys):
    from memfit.units import format_bytes

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=64, per_device_train_batch_size=4), gpu="T4")
    assert r.reserved_at_peak_allocated_bytes >= r.peak_allocated_bytes
    from memfit.commands.estimate import reserved_lines

    text = " ".join(reserved_lines(r))
    assert "unallocated at that moment" not in text
    assert f"at the allocated peak above: reserved {format_bytes(r.reserved_at_peak_allocated_bytes)}" in text
    cached = format_bytes(r.reserved_at_peak_allocated_bytes - r.peak_allocated_bytes)
    assert f"of which {cached} cached for reuse" in text


def test_plan_prints_no_future_warning(tmp_path):
    """transformers 5 deprecates `gradient_checkpointing_enable` (FutureWarning, modeling_utils.py); a plan
    tries checkpointing many times and printed it each time."""
    from memfit import plan

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan(TrainSetup.from_kwargs("sentence-transformers/all-MiniLM-L6-v2", max_length=128,
                                    per_device_train_batch_size=32), gpu="1GiB")
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]


def test_replay_refuses_a_cuda_malloc_async_what_if(tmp_path, capsys):
    missing = tmp_path / "never-read.pickle"  # the option is refused before the snapshot is read
    assert main(["replay", str(missing), "--what-if", "backend:cudaMallocAsync"]) == 2
    err = capsys.readouterr().err
    assert "backend:cudaMallocAsync is not modelled" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fits_as_is, chosen, code", [(False, 0, 1), (False, None, 1), (True, None, 0)])
def test_plan_check_fails_when_the_setup_as_given_does_not_fit(fits_as_is, chosen, code, tiny_bert_dir, capsys,
                                                               monkeypatch):
    import memfit.planner.search as search

    class Result:  # what plan() returns, as far as the command reads it with --json
        gpu = {"name": "T4"}

        def to_json(self):
            return {"fits_as_is": fits_as_is, "chosen": chosen}

    Result.fits_as_is, Result.chosen = fits_as_is, chosen
    monkeypatch.setattr(search, "plan", lambda *a, **k: Result())
    assert main(["plan", tiny_bert_dir, "--gpu", "T4", "--json", "--check"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    if code:
        assert len(err) == 1 and err[0].startswith("memfit plan --check: the setup as given does not fit T4")
    assert main(["plan", tiny_bert_dir, "--gpu", "T4", "--json"]) == (0 if (fits_as_is or chosen is not None) else 1)


def test_estimate_with_lora_and_checkpointing_prints_no_upstream_warning_or_log(capfd):
    """peft's `PeftModel.__init__` calls transformers 5's deprecated `is_gradient_checkpointing` (a FutureWarning
    printed on every LoRA estimate) and transformers logs `use_cache`/dtype lines about memfit's own model:
    memfit.sim.quiet silences them inside a simulation and restores the user's settings after."""
    from memfit import estimate
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimate(TrainSetup.from_kwargs("sentence-transformers/all-MiniLM-L6-v2", max_length=64, lora_r=4,
                                        per_device_train_batch_size=2, gradient_checkpointing=True), gpu="T4")
    assert not [str(w.message) for w in caught if "memfit" not in str(w.filename)]
    assert hf_logging.get_verbosity() == before
    assert "[transformers]" not in capfd.readouterr().err


def test_python_dash_m_memfit_is_the_memfit_command():
    r = subprocess.run([sys.executable, "-m", "memfit", "--version"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(SRC_DIR)})
    assert r.returncode == 0 and r.stdout.startswith("memfit "), r.stdout + r.stderr


def _memfit_process(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """`python -m memfit ...` as the console script runs it (memfit.cli.entry), output piped as in a script."""
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR),
           "MEMFIT_CACHE_DIR": str(cache_dir), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_the_fast_exit_of_a_compute_verb_keeps_its_output_exit_code_and_cache(tmp_path):
    """`estimate`, `plan`, `diagnose` and `replay` end the process without the interpreter's teardown
    (memfit.cli.entry). Their whole output must still arrive through a pipe, the exit code be the verb's, the cache
    entry be written, and stderr hold none of the import-time noise of torchao or bitsandbytes."""
    model = "sentence-transformers/all-MiniLM-L6-v2"
    fits = _memfit_process("estimate", model, "--gpu", "T4", "--max-length", "64", "--check", cache_dir=tmp_path)
    assert fits.returncode == 0, fits.stderr
    assert fits.stdout.rstrip().splitlines()[-1].startswith("simulated in"), fits.stdout[-300:]
    assert fits.stderr == ""
    assert list(tmp_path.rglob("*.json")), "the cache entry was not written before the exit"
    short = _memfit_process("estimate", model, "--gpu", "1GiB", "--max-length", "512", "--batch-size", "256",
                            "--check", cache_dir=tmp_path)
    assert short.returncode == 1, short.stdout[-500:] + short.stderr
    bad = _memfit_process("estimate", model, "--gpu", "24", cache_dir=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "error" in bad.stderr, bad.stderr


def test_a_compute_verb_exits_normally_while_a_non_daemon_thread_runs(monkeypatch):
    """With a non-daemon thread alive, `entry` takes Python's normal exit (which joins it), not os._exit."""
    import threading

    from memfit import cli

    import atexit

    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(("os._exit", code)))
    # the real handlers would end this pytest process's logging, temporary folders and plugins
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: exits.append(("atexit",)))
    release = threading.Event()
    worker = threading.Thread(target=release.wait, daemon=False)
    worker.start()
    try:
        with pytest.raises(SystemExit) as done:
            cli._exit_now(3)
        assert done.value.code == 3 and not exits
    finally:
        release.set()
        worker.join()
    cli._exit_now(4)
    assert exits == [("atexit",), ("os._exit", 4)]
