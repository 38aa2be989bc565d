"""Fuzz (hypothesis) of the CLI's parser and of `--args` files: a rejected input is a non-zero exit with one
line on stderr, never a traceback. An accepted input stops where the simulation would start (a sentinel), so
no example simulates anything."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.cli import main
from memfit.train_setup import LEGACY_ARG_NAMES, TrainSetup

import dataclasses

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Accepted(Exception):
    """Raised where the simulation would start: the input passed every check."""


@pytest.fixture
def stop_at_simulation(monkeypatch):
    import memfit.planner.memory_model as memory_model
    import memfit.sim.engine as engine

    def accepted(*a, **k):
        raise Accepted()

    monkeypatch.setattr(engine, "simulate", accepted)
    monkeypatch.setattr(memory_model, "simulate", accepted)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a random model name must not go to the network


def _check(argv, capsys):
    try:
        code = main(argv)
    except Accepted:
        capsys.readouterr()
        return
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "Traceback" not in out.out
    if code == 0:  # a run that completed without simulating (e.g. --list-models)
        return
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("memfit"), (argv, code, out.err)


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_NUMBERS = st.one_of(st.integers(-3, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str))
_VALUE = st.one_of(_TEXT, _NUMBERS, st.sampled_from(["T4", "V100-16GB", "24", "24GiB", "0", "-1", "@nofile",
                                                      "expandable_segments:True", "backend:cudaMallocAsync",
                                                      "max_split_size_mb:10", "fp16", "seq-cls", "lora,foo"]))
_FLAGS = ["--task", "--num-labels", "--batch-size", "--eval-batch-size", "--grad-accum", "--max-length",
          "--example-lengths", "--target-length", "--precision", "--weights-dtype", "--optim", "--weight-decay",
          "--max-grad-norm", "--eval-strategy", "--eval-accumulation-steps", "--eval-samples", "--lora-r",
          "--lora-target-modules", "--attn", "--freeze-layers", "--gpu", "--alloc-conf", "--margin", "--allow",
          "--nonsense"]


@SETTINGS
@given(verb=st.sampled_from(["estimate", "plan"]),
       pairs=st.lists(st.tuples(st.sampled_from(_FLAGS), _VALUE), min_size=1, max_size=4))
def test_flags_with_arbitrary_values(verb, pairs, tiny_bert_dir, capsys, stop_at_simulation):
    argv = [verb, tiny_bert_dir]
    for flag, value in pairs:
        if verb == "estimate" and flag in ("--margin", "--allow"):
            flag = "--gpu"
        argv += [flag, value]
    _check(argv, capsys)


_NAMES = sorted({f.name for f in dataclasses.fields(TrainSetup)} | set(LEGACY_ARG_NAMES)
                | {"fp16", "bf16", "learning_rate", "output_dir", "use_cpu", "deepspeed", "report_to", "seed"})
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2, 10**9), st.floats(), _TEXT),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)),
                     max_leaves=6)


@SETTINGS
@given(verb=st.sampled_from(["estimate", "plan", "diagnose"]),
       data=st.dictionaries(st.one_of(st.sampled_from(_NAMES), _TEXT), _JSON, min_size=1, max_size=4))
def test_args_files_with_arbitrary_values(verb, data, tiny_bert_dir, tmp_path, capsys, stop_at_simulation):
    path = tmp_path / "args.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    if verb == "diagnose":
        argv = ["diagnose", "--text", "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
                "of 14.75 GiB of which 3.06 MiB is free.", "--model", tiny_bert_dir, "--args", str(path)]
    else:
        argv = [verb, tiny_bert_dir, "--args", str(path), "--gpu", "T4"]
    _check(argv, capsys)


@SETTINGS
@given(content=st.one_of(st.binary(max_size=40), _TEXT.map(str.encode)))
def test_args_files_that_are_not_json_objects(content, tiny_bert_dir, tmp_path, capsys, stop_at_simulation):
    path = tmp_path / "args.json"
    path.write_bytes(content)
    _check(["estimate", tiny_bert_dir, "--args", str(path)], capsys)


@SETTINGS
@given(data=st.dictionaries(st.one_of(st.sampled_from(_NAMES), _TEXT), _JSON, min_size=1, max_size=4))
def test_train_args_files_with_arbitrary_values(data, tmp_path, capsys, monkeypatch):
    import memfit.commands.train as train

    if not train.bundled_model_dir():
        pytest.skip("bundled model not installed")

    def accepted(*a, **k):
        raise Accepted()

    monkeypatch.setattr(train, "load_examples", accepted)  # the data is read after every argument check
    path = tmp_path / "args.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    _check(["train", "--args", str(path)], capsys)


@pytest.mark.parametrize("value", [[], {"a": 1}])
def test_every_args_name_with_a_list_or_an_object(value, tiny_bert_dir, tmp_path, capsys, stop_at_simulation):
    """Every TrainSetup field and legacy name given a JSON list or object (the values no field takes but
    `peft_config` / `lora_target_modules`): accepted, or one line, never a traceback (a dict lookup of an
    unhashable value was one)."""
    path = tmp_path / "args.json"
    for name in sorted({f.name for f in dataclasses.fields(TrainSetup)} | set(LEGACY_ARG_NAMES)):
        path.write_text(json.dumps({name: value}), encoding="utf-8")
        _check(["estimate", tiny_bert_dir, "--args", str(path), "--gpu", "T4"], capsys)
