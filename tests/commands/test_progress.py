"""commands._progress: a spinner on the terminal only; nothing in a pipe or with --json."""

import sys
import time

from memfit.commands._progress import progress


def test_nothing_is_shown_in_a_pipe_or_with_json(capsys, monkeypatch):
    with progress("planning x"):  # pytest's stdout is no terminal
        pass
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    with progress("planning x", json_output=True):
        pass
    with progress("planning x", enabled=False):
        pass
    assert capsys.readouterr() == ("", "")


def test_a_terminal_sees_what_is_simulated(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: draw on stderr as on a terminal
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    with progress("planning gpt2 on T4"):
        time.sleep(0.3)
    out, err = capsys.readouterr()
    assert out == "" and "planning gpt2 on T4" in err
