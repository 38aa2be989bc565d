"""memfit.planner.workers (the target: `memfit plan` < 10 s on 2 cores): the planner's independent simulations run
in forked worker processes, with the same result as the serial run, and serially wherever forking is unsafe."""

import sys
import threading

import pytest

from conftest import save_bert_config
from memfit.errors import MemfitError
from memfit.planner import workers
from memfit.planner.memory_model import Simulations, fit_memory_model, planned_simulations
from memfit.planner.search import _budget_for, _candidate_axes
from memfit.planner.workers import WorkerPool, worker_count
from memfit.remedies import REGISTRY
from memfit.gpus.catalog import as_gpu_spec
from memfit.train_setup import TrainSetup

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="worker processes are forked on Linux only")


@pytest.fixture(scope="module")
def bert4(tmp_path_factory):
    return save_bert_config(tmp_path_factory, "bert4w", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=512, vocab_size=4000)


def _setup(model):
    return TrainSetup(model=model, max_length=128, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                      eval_strategy="epoch", per_device_eval_batch_size=8, eval_samples=16)


_COMPARE = """
import json, sys
from memfit.planner.search import plan
from memfit.planner.workers import worker_count
from memfit.train_setup import TrainSetup

setup = TrainSetup(model=sys.argv[1], max_length=128, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                   eval_strategy="epoch", per_device_eval_batch_size=8, eval_samples=16)
assert worker_count(2) == 2, "forking refused in a fresh process"
serial = plan(setup, gpu="700MiB", workers=1).to_json()
parallel = plan(setup, gpu="700MiB", workers=2).to_json()
serial.pop("elapsed_s"), parallel.pop("elapsed_s")
print(json.dumps({"serial": serial, "parallel": parallel}, default=str))
"""


@pytest.mark.slow
@linux_only
def test_the_plan_is_the_same_serial_and_in_workers(bert4):
    """In a fresh process: one that ran a Trainer keeps threads (tqdm's monitor, gloo's) and plans serially, so
    in the test process the comparison could silently be serial against serial."""
    import json
    import os
    import subprocess

    from helpers import SRC_DIR

    src = str(SRC_DIR)
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MEMFIT_WORKERS", None)
    r = subprocess.run([sys.executable, "-c", _COMPARE, str(bert4)], capture_output=True, text=True, timeout=900,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # a GPU too small for the setup as it is: fits, ranking and verification all run
    assert out["serial"]["simulations"] > 5 and out["serial"]["plans"]
    assert out["parallel"] == out["serial"]


def _as_in_a_fresh_process(monkeypatch):
    """No CUDA, no process group, and no thread but the ones this test starts (earlier tests in the same
    pytest process leave threads: tqdm's monitor, gloo's), so that worker_count's own rules are what is tested."""
    import torch

    original, base = threading.active_count, threading.active_count()
    monkeypatch.setattr(threading, "active_count", lambda: original() - base + 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


@pytest.mark.slow
def test_the_planned_simulations_are_the_ones_the_fits_ask_for(bert4):
    # what is started ahead is exactly what fit_memory_model asks for: nothing runs twice, nothing in the parent
    setup = _setup(bert4)
    spec = as_gpu_spec("700MiB", required=True)
    setup = setup.replace(compute_capability=tuple(spec.compute_capability))
    verdicts = {name: r.check(setup, spec) for name, r in REGISTRY.items()}
    axes = _candidate_axes(setup, spec, verdicts, allow=(), exclude=())
    planned = planned_simulations(setup, axes)
    budget = _budget_for(spec, 0.05, 0)
    sims = Simulations()
    with WorkerPool(worker_count(2)) as pool:
        sims.prefetch(pool, "estimate", setup, (budget, None))
        for s, kwargs in planned:
            sims.prefetch(pool, "phase_peaks", s, kwargs)
        report = sims.estimate(setup, budget, None)
        sims.baseline = (setup, report)
        model = fit_memory_model(setup, report, axes, sims)
    assert sims.pending == []  # every prefetched simulation was read
    if pool.workers > 1:
        assert sims.ran_here == 0  # and none ran in this process
    serial = Simulations(baseline=(setup, report))
    assert fit_memory_model(setup, report, axes, serial) == model
    assert serial.count == sims.count - 1  # the baseline estimate is counted in `sims` only


@linux_only
def test_a_memfit_error_in_a_worker_is_raised_as_it_is():
    with WorkerPool(2) as pool:
        handle = pool.submit(worker_count, 0)  # raises MemfitError in the worker
        with pytest.raises(MemfitError, match=r"workers `0` must be a whole number"):
            handle.get()
        assert pool.submit(max, 3, 7).get() == 7  # the pool still works


def test_the_serial_pool_runs_lazily_and_raises_the_same():
    calls = []
    with WorkerPool(1) as pool:
        handle = pool.submit(calls.append, 1)
        assert calls == []  # run when read, in the order the planner reads (as before the pool)
        handle.get(), handle.get()
        assert calls == [1]
        failing = pool.submit(worker_count, 0)
        for _ in range(2):
            with pytest.raises(MemfitError, match=r"workers `0`"):
                failing.get()


@linux_only
def test_worker_count(monkeypatch):
    _as_in_a_fresh_process(monkeypatch)
    monkeypatch.delenv("MEMFIT_WORKERS", raising=False)
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, raising=False)
    assert worker_count() == workers.MAX_WORKERS  # capped
    assert worker_count(3) == 3
    monkeypatch.setenv("MEMFIT_WORKERS", "1")
    assert worker_count() == 1
    monkeypatch.setenv("MEMFIT_WORKERS", "2")
    assert worker_count() == 2
    monkeypatch.setenv("MEMFIT_WORKERS", "two")
    with pytest.raises(MemfitError, match=r"MEMFIT_WORKERS `two` is not a whole number"):
        worker_count()
    monkeypatch.delenv("MEMFIT_WORKERS")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(MemfitError, match=r"must be a whole number >= 1"):
            worker_count(bad)


@linux_only
def test_no_fork_where_it_is_unsafe(monkeypatch):
    _as_in_a_fresh_process(monkeypatch)
    monkeypatch.delenv("MEMFIT_WORKERS", raising=False)
    assert worker_count(2) == 2
    monkeypatch.setattr(workers.sys, "platform", "darwin")  # spawn by default: serial
    assert worker_count(2) == 1
    monkeypatch.setattr(workers.sys, "platform", "linux")
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a CUDA context cannot cross a fork
    assert worker_count(2) == 1
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # a process group (memfit.fit)
    assert worker_count(2) == 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a lock another thread holds stays held in a child
    other.start()
    try:
        assert worker_count(2) == 1
    finally:
        stop.set()
        other.join()
    assert worker_count(2) == 2


def test_the_training_process_plans_serially():
    # memfit.fit plans inside the training process (CUDA, process groups, dataloader threads): never forked
    import inspect

    from memfit.fitting import run

    assert "workers=1" in inspect.getsource(run._agreed_plan)


@linux_only
def test_a_worker_that_dies_is_a_clear_error():
    import os

    with WorkerPool(2) as pool:  # a worker killed (e.g. out of host memory) must not leave the planner waiting
        with pytest.raises(MemfitError, match=r"worker process died .* `MEMFIT_WORKERS=1`"):
            pool.submit(os._exit, 1).get()  # the worker ends without a result
