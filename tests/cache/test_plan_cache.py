"""memfit.cache for plans: the same `memfit plan` twice is read from disk, keyed by everything that
changes it; a warm plan imports no torch."""

import json
import os
import subprocess
import sys

import pytest

import memfit.cache as cache
from memfit.cli import main
from memfit.planner import memory_model
from memfit.planner.search import PlanResult, plan
from memfit.train_setup import TrainSetup


@pytest.fixture
def no_simulation(monkeypatch):
    """After `arm()`, a simulation fails the test: what follows must come from the cache."""
    import memfit.sim.engine as engine

    def arm():
        fail = lambda *a, **k: pytest.fail("simulated: not read from the cache")  # noqa: E731
        monkeypatch.setattr(engine, "simulate", fail)
        monkeypatch.setattr(memory_model, "simulate", fail)
    return arm


def _entries():
    folder = cache.cache_dir() / "plan-v1"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _setup(model):
    return TrainSetup(model=model, task="seq-cls", max_length=16, per_device_train_batch_size=8)


def _same(a: PlanResult, b: PlanResult) -> bool:
    return a.to_json() | {"elapsed_s": None, "cached": None} == b.to_json() | {"elapsed_s": None, "cached": None}


def test_second_plan_is_read_from_the_cache(tiny_bert_dir, no_simulation):
    first = plan(_setup(tiny_bert_dir), gpu="1GiB", cache=True)
    assert not first.cached and first.simulations > 0 and len(_entries()) == 1
    no_simulation()
    second = plan(_setup(tiny_bert_dir), gpu="1GiB", cache=True)
    assert second.cached and _same(first, second) and second.simulations == first.simulations


def test_the_api_does_not_cache_plans_by_default(tiny_bert_dir):
    plan(_setup(tiny_bert_dir), gpu="1GiB")
    assert _entries() == []


def test_plan_json_reads_back_as_the_same_result(tiny_bert_dir):
    result = plan(_setup(tiny_bert_dir), gpu="1GiB")
    assert PlanResult.from_json(json.loads(json.dumps(result.to_json()))) == result


@pytest.mark.parametrize("change", ["setup", "gpu_spec", "allow", "exclude", "margin", "alloc_conf", "verify_top",
                                    "max_plans", "non_pytorch_bytes", "version"])
def test_what_changes_the_plan_changes_its_key(change, tiny_bert_dir, monkeypatch):
    from memfit.gpus.catalog import as_gpu_spec

    options = dict(allow=[], exclude=[], margin=0.05, alloc_conf=None, verify_top=2, max_plans=8,
                   non_pytorch_bytes=None)
    setup, gpu = _setup(tiny_bert_dir), as_gpu_spec("T4")
    before = cache.plan_key(setup, gpu=gpu, options=options)
    assert before is not None and before == cache.plan_key(setup, gpu=gpu, options=dict(options))
    if change == "setup":
        setup = setup.replace(max_length=32)
    elif change == "gpu_spec":  # not "gpu": conftest skips tests with that keyword
        gpu = as_gpu_spec("A100-80GB")
    elif change == "version":
        monkeypatch.setattr(cache, "_versions", lambda: {"torch": "0.0"})
    else:
        options[change] = {"allow": ["lora"], "exclude": ["mixed_precision"], "margin": 0.1,
                           "alloc_conf": "expandable_segments:True", "verify_top": 1, "max_plans": 3,
                           "non_pytorch_bytes": 1 << 30}[change]
    assert cache.plan_key(setup, gpu=gpu, options=options) != before


def test_a_plan_that_counts_other_processes_on_a_gpu_is_not_cached(tiny_bert_dir, monkeypatch):
    import memfit.gpus.outside_pytorch as outside

    monkeypatch.setattr(outside, "gpu_processes", lambda: [])  # NVML sees a GPU: the budget depends on it now
    plan(_setup(tiny_bert_dir), gpu="1GiB", cache=True)
    assert _entries() == []
    plan(_setup(tiny_bert_dir), gpu="1GiB", cache=True, non_pytorch_bytes=300 << 20)  # given: cached
    assert len(_entries()) == 1


@pytest.mark.parametrize("content", ["{truncated", "[]", '{"schema": "memfit.cache.plan/1", "key": "KEY", '
                                     '"plan": {"bogus": 1}}'])
def test_corrupt_plan_entries_are_ignored(content, tiny_bert_dir):
    first = plan(_setup(tiny_bert_dir), gpu="1GiB", cache=True)
    (path,) = _entries()
    path.write_text(content.replace("KEY", path.stem))
    again = plan(_setup(tiny_bert_dir), gpu="1GiB", cache=True)  # planned again, not an error
    assert not again.cached and _same(first, again)
    assert json.loads(path.read_text())["key"] == path.stem  # replaced by a whole entry


def test_cli_plan_caches_and_no_cache_plans(tiny_bert_dir, capsys, no_simulation):
    argv = ["plan", tiny_bert_dir, "--max-length", "16", "--batch-size", "8", "--gpu", "1GiB"]
    code = main(argv)
    first = capsys.readouterr().out.rstrip("\n").split("\n")
    no_simulation()
    assert main(argv) == code
    again = capsys.readouterr().out.rstrip("\n").split("\n")
    assert again[:-1] == first[:-1]  # the same plan; the last line says where it came from
    assert "simulations in" in first[-1] and "read from memfit's cache" in again[-1]
    with pytest.raises(pytest.fail.Exception):
        main(argv + ["--no-cache"])


def test_warm_plan_does_not_import_torch(tiny_bert_dir, tmp_path):
    env = dict(os.environ, MEMFIT_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = ("import sys; from memfit.cli import main; code = main({argv!r}); "
           "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)")
    argv = ["plan", tiny_bert_dir, "--max-length", "16", "--batch-size", "8", "--gpu", "1GiB"]
    cold = subprocess.run([sys.executable, "-c", run.format(argv=argv)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert cold.stdout.split()[-2] == "TORCH", cold.stderr
    warm = subprocess.run([sys.executable, "-c", run.format(argv=argv)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert warm.stdout.split()[-2:] == ["NO-TORCH", cold.stdout.split()[-1]], warm.stderr
    assert "read from memfit's cache" in warm.stdout
