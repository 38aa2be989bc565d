"""memfit.progress and the terminal's progress line (memfit.commands._progress): what a plan, a multi-GPU estimate and
bench/published.py are simulating and how far they are, on a terminal only."""

import io
import os

import pytest

from memfit import progress as prog
from memfit.commands._progress import describe, progress


def _console():
    from rich.console import Console

    buf = io.StringIO()
    # a terminal as rich draws one (force_terminal), wide enough for a whole line, without colour codes
    return Console(file=buf, force_terminal=True, width=200, color_system=None), buf


def test_reports_reach_only_a_listener_of_this_process():
    heard = []
    prog.report("nobody listens", 0, 3)  # nothing to tell: no error
    assert not prog.is_listening()
    with prog.listening(heard.append):
        assert prog.is_listening()
        prog.report("simulation a", 0, 3)
        prog.report("micro-step 1 of 2", 0, 2, detail=True)  # a step inside a simulation: not asked for
        with prog.listening(heard.append, details=True):
            prog.report("micro-step 2 of 2", 1, 2, detail=True)
    assert [(p.what, p.done, p.total, p.detail) for p in heard] == [("simulation a", 0, 3, False),
                                                                    ("micro-step 2 of 2", 1, 2, True)]
    assert not prog.is_listening()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_stays_silent():
    """memfit.planner.workers forks: the child inherits the listener and must not draw on the parent's terminal."""
    heard = []
    with prog.listening(heard.append):
        pid = os.fork()
        if pid == 0:  # the child: its report goes nowhere (it would append to its own copy of `heard`)
            os._exit(0 if not prog.is_listening() else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_line_says_what_runs_and_how_far():
    assert describe(prog.Progress("micro-steps: fp16, batch 8", 3, 14), "simulation") == \
        "simulation 4 of at most 14: micro-steps: fp16, batch 8"
    assert describe(prog.Progress("LoRA on gpt2", 11, 40), "record") == "record 12 of 40: LoRA on gpt2"
    assert describe(prog.Progress("x", 2, None), "simulation") == "simulation 3: x"


def test_a_terminal_shows_the_progress(monkeypatch):
    console, buf = _console()
    with progress("planning gpt2 on T4", console=console):
        prog.report("micro-steps: fp32, batch 4, adamw_torch", 2, 9)
        console.file.flush()
    out = buf.getvalue()
    assert "planning gpt2 on T4: simulation 3 of at most 9: micro-steps: fp32, batch 4, adamw_torch" in out
    assert not prog.is_listening()  # gone with the block


def test_a_multi_gpu_estimate_shows_the_simulated_steps():
    console, buf = _console()
    with progress("gpt2: simulating rank 0 of 4 (fsdp)", console=console, details=True):
        prog.report("simulating micro-step 2 of 2", 1, 4, detail=True)
    assert "gpt2: simulating rank 0 of 4 (fsdp): simulating micro-step 2 of 2" in buf.getvalue()


def test_no_terminal_or_json_shows_nothing(capsys):
    """stdout not a terminal (pytest captures it), or --json: no listener, nothing written anywhere."""
    with progress("planning gpt2 on T4"):
        assert not prog.is_listening()
        prog.report("simulation", 0, 3)
    console, buf = _console()
    with progress("planning gpt2 on T4", json_output=True, console=console):
        assert not prog.is_listening()
    with progress("x", enabled=False, console=console):
        assert not prog.is_listening()
    assert buf.getvalue() == ""
    assert capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_a_plan_reports_each_simulation_with_its_total(tiny_bert_dir):
    """memfit.plan tells which simulation runs, with the planned total (baseline + partial simulations + the
    candidates verified at most); the count reaches the simulations the result says ran."""
    from memfit import TrainSetup
    from memfit.planner.search import plan

    heard = []
    with prog.listening(heard.append):
        result = plan(TrainSetup(model=tiny_bert_dir, max_length=64, per_device_train_batch_size=8), gpu="T4",
                      workers=1, verify_top=1)
    assert heard and not any(p.detail for p in heard)  # a plan's listener does not hear the steps inside
    totals = {p.total for p in heard}
    assert len(totals) == 1 and totals.pop() >= result.simulations
    assert [p.done for p in heard] == list(range(len(heard)))  # one report before each simulation, counted
    assert len(heard) == result.simulations
    assert heard[0].what.startswith("full estimate: ")  # the baseline first


def test_the_simulator_reports_its_steps(tiny_bert_dir):
    from memfit import TrainSetup
    from memfit.sim.engine import simulate

    heard = []
    with prog.listening(heard.append, details=True):
        simulate(TrainSetup(model=tiny_bert_dir, max_length=16, gradient_accumulation_steps=4))
    assert [p.what for p in heard] == ["simulating micro-step 1 of 2", "simulating micro-step 2 of 2",
                                       "simulating optimizer step 1 of 2", "simulating optimizer step 2 of 2"]
    assert [(p.done, p.total) for p in heard] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_a_terminal_stdout_draws_on_stderr(capsys, monkeypatch):
    """The CLI's own path: stdout a terminal, the line on stderr (rich draws there as on a terminal), stdout clean."""
    import sys
    import time

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: draw on stderr as on a terminal
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    with progress("planning gpt2 on T4"):
        prog.report("full estimate: fp32, batch 8, adamw_torch", 0, 12)
        time.sleep(0.3)
    out, err = capsys.readouterr()
    assert out == "" and "planning gpt2 on T4: simulation 1 of at most 12: full estimate" in err
