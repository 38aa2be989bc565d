"""memfit.cache: the same estimate twice is read from disk (JSON), keyed by everything that changes it."""

import json
import os
import subprocess
import sys

import pytest

import memfit.cache as cache
from memfit.cli import main
from memfit.estimator import MemoryReport, estimate
from memfit.train_setup import TrainSetup


@pytest.fixture
def no_simulation(monkeypatch):
    """After this fixture, a simulation fails the test: what follows must come from the cache."""
    import memfit.sim.engine as engine

    def arm():
        monkeypatch.setattr(engine, "simulate", lambda *a, **k: pytest.fail("simulated: not read from the cache"))
    return arm


def _entries():
    folder = cache.cache_dir() / "estimate-v1"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_second_estimate_is_read_from_the_cache(tiny_bert_dir, no_simulation):
    setup = TrainSetup(model=tiny_bert_dir, max_length=16)
    first = estimate(setup, gpu="T4", cache=True)
    assert len(_entries()) == 1 and _entries()[0].suffix == ".json"
    no_simulation()
    second = estimate(setup, gpu="T4", cache=True)
    assert second.to_json() | {"notes": None, "elapsed_s": None} == first.to_json() | {"notes": None, "elapsed_s": None}
    assert any("read from memfit's cache" in n for n in second.notes)
    assert isinstance(second, MemoryReport) and second.trace == []


def test_the_api_does_not_cache_by_default(tiny_bert_dir):
    estimate(TrainSetup(model=tiny_bert_dir, max_length=16))
    assert _entries() == []


@pytest.mark.parametrize("change", ["setup", "gpu", "alloc_env", "version", "source", "config"])
def test_what_changes_the_result_changes_the_key(change, tiny_bert_dir, tmp_path, monkeypatch):
    import shutil

    from memfit.allocator.conf import parse_alloc_conf
    from memfit.gpus.catalog import as_gpu_spec

    model = tmp_path / "m"
    shutil.copytree(tiny_bert_dir, model)
    setup, gpu, conf = TrainSetup(model=str(model), task="seq-cls", max_length=16), as_gpu_spec("T4"), parse_alloc_conf("")

    def key():
        return cache.estimate_key(setup, gpu=gpu, conf=conf, non_pytorch_bytes=None, capacity_bytes=None)

    before = key()
    assert before is not None and before == key()
    if change == "setup":
        setup = setup.replace(per_device_train_batch_size=9)
    elif change == "gpu":
        gpu = as_gpu_spec("V100-16GB")
    elif change == "alloc_env":
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    elif change == "version":
        monkeypatch.setattr(cache, "_versions", lambda: {"memfit": "0.0.0", "torch": "9"})
    elif change == "source":
        monkeypatch.setattr(cache, "source_hash", lambda: "another source")
    elif change == "config":
        cfg = json.loads((model / "config.json").read_text())
        cfg["intermediate_size"] = 256
        (model / "config.json").write_text(json.dumps(cfg))
    assert key() != before


def test_a_model_it_cannot_key_is_not_cached(tiny_bert_dir):
    from transformers import BertConfig

    from memfit.allocator.conf import parse_alloc_conf

    setup = TrainSetup(model=BertConfig.from_pretrained(tiny_bert_dir), max_length=16)
    assert cache.estimate_key(setup, gpu=None, conf=parse_alloc_conf(""), non_pytorch_bytes=None,
                              capacity_bytes=None) is None


@pytest.mark.parametrize("content", ["{truncated", "[]", '{"schema": "memfit.cache.estimate/1", "key": "x"}',
                                     '{"schema": "memfit.cache.estimate/1", "key": "KEY", "report": {"bogus": 1}}'])
def test_corrupt_entries_are_ignored(content, tiny_bert_dir):
    setup = TrainSetup(model=tiny_bert_dir, max_length=16)
    first = estimate(setup, gpu="T4", cache=True)
    (path,) = _entries()
    path.write_text(content.replace("KEY", path.stem))
    again = estimate(setup, gpu="T4", cache=True)  # recomputed, not an error
    assert again.peak_allocated_bytes == first.peak_allocated_bytes
    assert not any("read from memfit's cache" in n for n in again.notes)
    assert json.loads(path.read_text())["key"] == path.stem  # replaced by a whole entry


def test_writes_are_atomic_and_leave_no_temporary_files(tiny_bert_dir, monkeypatch):
    replaced = []
    real = os.replace
    monkeypatch.setattr(cache.os, "replace", lambda a, b: (replaced.append((a, b)), real(a, b)))
    estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4", cache=True)
    (path,) = _entries()
    assert replaced and replaced[-1][1] == path and os.path.dirname(replaced[-1][0]) == str(path.parent)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_an_unwritable_cache_never_stops_an_estimate(tiny_bert_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(blocker))
    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4", cache=True)
    assert r.peak_allocated_bytes > 0 and blocker.read_text() == "not a folder"


def test_cli_caches_and_no_cache_simulates(tiny_bert_dir, capsys, no_simulation):
    argv = ["estimate", tiny_bert_dir, "--max-length", "16", "--gpu", "T4", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(_entries()) == 1
    no_simulation()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["peak_reserved_bytes"] == first["peak_reserved_bytes"]
    with pytest.raises(pytest.fail.Exception):
        main(argv + ["--no-cache"])


def _python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_warm_estimate_and_help_do_not_import_torch(tiny_bert_dir, tmp_path):
    env = dict(os.environ, MEMFIT_CACHE_DIR=str(tmp_path / "c"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = ("import sys; from memfit.cli import main; code = main({argv!r}); "
           "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)")
    argv = ["estimate", tiny_bert_dir, "--max-length", "16", "--gpu", "T4"]  # task from the config: cached too
    cold = _python(run.format(argv=argv), env)
    assert cold.returncode == 0 and cold.stdout.split()[-2:] == ["TORCH", "0"], cold.stderr
    warm = _python(run.format(argv=argv), env)
    assert warm.stdout.split()[-2:] == ["NO-TORCH", "0"], warm.stderr
    for argv in (["--help"], ["estimate", "--help"], ["plan", "--bogus-flag"], ["estimate", "--batch-size", "x"]):
        out = _python(run.format(argv=argv), env)
        assert out.stdout.split()[-2] == "NO-TORCH", (argv, out.stderr)


def test_every_upstream_package_whose_code_memfit_runs_is_in_the_key():
    """TRL, Liger, DeepSpeed and torchao code runs in simulations too; an upgrade of one must not hit an old entry
    (the key had only torch, transformers, peft, accelerate and bitsandbytes)."""
    from importlib import metadata

    versions = cache._versions()
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "liger-kernel", "deepspeed",
                 "torchao"):
        assert name in versions, name
        try:
            assert versions[name] == metadata.version(name)
        except metadata.PackageNotFoundError:
            assert versions[name] is None


@pytest.mark.parametrize("field, trainer", [("reward_model", "grpo"), ("teacher_model", "distill")])
def test_the_other_model_s_config_is_in_the_key(field, trainer, tmp_path):
    """GRPO's reward model and distillation's teacher are held on the GPU too: a change to their config.json is a
    change to the estimate, though the setup names the same directory."""
    import transformers

    from memfit.allocator.conf import parse_alloc_conf
    from memfit.gpus.catalog import as_gpu_spec

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    config.save_pretrained(tmp_path / "policy")
    config.save_pretrained(tmp_path / "other")
    setup = TrainSetup(model=str(tmp_path / "policy"), task="causal-lm", trainer=trainer, max_length=16,
                       **{field: str(tmp_path / "other")})

    def key():
        return cache.estimate_key(setup, gpu=as_gpu_spec("T4"), conf=parse_alloc_conf(""), non_pytorch_bytes=None,
                                  capacity_bytes=None)

    before = key()
    assert before is not None and before == key()
    config.intermediate_size = 128
    config.save_pretrained(tmp_path / "other")
    assert key() != before
    setup = setup.replace(**{field: str(tmp_path / "missing")})  # cannot be keyed: not cached
    assert key() is None
