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


# -- the workers die with the planner, whatever signal ends it ---------------------------------------------------------

def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc; a zombie is dead for this purpose)."""
    from pathlib import Path

    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            pass
    return [c for c in out if _alive(c)]


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def _kill_and_watch(proc, sig: int, *, workers_timeout_s: float = 120.0) -> tuple[list[int], float]:
    """Wait until `proc` has worker processes, send it `sig`, and return the workers and the seconds until its
    stdout pipe closed (every holder of the write end gone)."""
    import os
    import selectors
    import time

    deadline = time.monotonic() + workers_timeout_s
    kids: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        if len(kids) >= 2:
            break
        time.sleep(0.05)
    assert len(kids) >= 2, f"no worker processes seen (exit {proc.poll()}): {proc.stderr.read()[-2000:]!r}"
    os.kill(proc.pid, sig)
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    closed_s = None
    while time.monotonic() - t0 < 30:
        if sel.select(timeout=0.5) and not os.read(proc.stdout.fileno(), 65536):  # EOF: no writer left
            closed_s = time.monotonic() - t0
            break
    sel.close()
    assert closed_s is not None, f"stdout still open 30 s after signal {sig}; workers alive: " \
                                 f"{[k for k in kids if _alive(k)]}"
    for _ in range(100):  # a dying process closes its files before it turns zombie (kernel exit_files, exit_notify)
        if not any(_alive(k) for k in kids):
            break
        time.sleep(0.05)
    assert not [k for k in kids if _alive(k)], "workers outlived their parent"
    proc.wait(timeout=30)
    return kids, closed_s


_SLEEPERS = """
import sys, time
from memfit.planner.workers import WorkerPool
with WorkerPool(2) as pool:
    handles = [pool.submit(time.sleep, 120) for _ in range(2)]
    print("submitted", flush=True)
    handles[0].get()
"""


def _env():
    import os

    from helpers import SRC_DIR

    env = {**os.environ, "PYTHONPATH": str(SRC_DIR) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MEMFIT_WORKERS", None)
    return env


@linux_only
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_busy_workers_die_with_their_parent_and_release_stdout(signame):
    """Workers in the middle of a task: SIGTERM (the parent's handler kills them, then the default action ends it)
    and SIGKILL (no handler runs: the kernel's PR_SET_PDEATHSIG) both end them and close the pipe at once."""
    import signal
    import subprocess

    sig = getattr(signal, signame)
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPERS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env())
    try:
        _, closed_s = _kill_and_watch(proc, sig)
        assert closed_s < 10
        assert proc.returncode == -sig  # ended by the signal, as `kill` meant (a shell shows 143 / 137)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@linux_only
def test_sigterm_of_a_real_memfit_plan_leaves_no_worker(tmp_path_factory):
    """`memfit plan ... | consumer`, then `kill PLANNER`: no worker survives and the pipe ends (the consumer is not
    left waiting)."""
    import signal
    import subprocess

    model = save_bert_config(tmp_path_factory, "bert8k", hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                             intermediate_size=1024, vocab_size=8000)
    argv = [sys.executable, "-m", "memfit", "plan", model, "--batch-size", "16", "--grad-accum", "2", "--max-length",
            "512", "--eval-strategy", "no", "--gpu", "2GiB", "--no-cache"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**_env(), "MEMFIT_WORKERS": "2"})
    try:
        _, closed_s = _kill_and_watch(proc, signal.SIGTERM)
        assert closed_s < 10
        assert proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
