"""`memfit serve` (memfit.server): a served command gives what the same command gives on its own (output,
exit code, files relative to its folder, stdin), a server is used only from its own environment and folder, and
it stops cleanly. Each test starts a real server process and real `python -m memfit` clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import SRC_DIR
from memfit.errors import MemfitError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfit serve: Linux sockets and fork")

SRC = str(SRC_DIR)
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
OOM = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 15.77 GiB of which 4.12 MiB "
       "is free. Of the allocated memory 14.94 GiB is allocated by PyTorch, and 312.10 MiB is reserved by PyTorch but "
       "unallocated.")


def _env(serve_dir: Path, cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_NO_SERVER"}
    env.update({"PYTHONPATH": SRC, "MEMFIT_SERVE_DIR": str(serve_dir), "MEMFIT_CACHE_DIR": str(cache_dir),
                "MEMFIT_SERVE_WARMUP": "0", "COLUMNS": "100"})
    env.update(extra)
    return env


class Server:
    def __init__(self, serve_dir: Path, cache_dir: Path, *args: str) -> None:
        self.env = _env(serve_dir, cache_dir)
        self.proc = subprocess.Popen([sys.executable, "-m", "memfit", "serve", *args], env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self.proc.stdout.readline()
        assert "ready at" in self.ready, self.ready + self.proc.stderr.read()

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, self.ready + out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=30)


@pytest.fixture
def server(tmp_path):
    serve_dir = tmp_path / "serve"
    s = Server(serve_dir, tmp_path / "cache-server", "--idle-minutes", "2")
    yield s
    s.kill()


def memfit(*args: str, env: dict[str, str], cwd: Path | None = None, stdin: str | None = None,
           alone: bool = False) -> subprocess.CompletedProcess:
    env = {**env, **({"MEMFIT_NO_SERVER": "1"} if alone else {})}
    return subprocess.run([sys.executable, "-m", "memfit", *args], env=env, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=300)


def _without_timing(text: str) -> str:
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith(("simulated in", "from memfit's cache in")))


def test_a_served_command_gives_what_it_gives_alone(server, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "oom.log").write_text(f"Traceback (most recent call last):\ntorch.OutOfMemoryError: {OOM}\n")
    env = _env(tmp_path / "serve", tmp_path / "cache-1")
    runs = [
        (("estimate", MODEL, "--gpu", "T4", "--max-length", "64"), None),
        (("estimate", MODEL, "--gpu", "1GiB", "--max-length", "512", "--batch-size", "256", "--check"), None),
        (("estimate", MODEL, "--gpu", "24"), None),  # bad input: one line, exit 2
        (("diagnose", "oom.log"), None),  # a path relative to the client's folder
        (("diagnose", "-", "--json"), f"RuntimeError: {OOM}\n"),  # the client's stdin
    ]
    for args, stdin in runs:
        served = memfit(*args, env=env, cwd=tmp_path / "work", stdin=stdin)
        alone = memfit(*args, env={**env, "MEMFIT_CACHE_DIR": str(tmp_path / "cache-2")}, cwd=tmp_path / "work",
                       stdin=stdin, alone=True)
        assert served.returncode == alone.returncode, (args, served.stderr, alone.stderr)
        assert _without_timing(served.stdout) == _without_timing(alone.stdout), args
        assert served.stderr == alone.stderr, args
    assert [memfit(*a, env=env, cwd=tmp_path / "work", stdin=s).returncode for a, s in runs[:3]] == [0, 1, 2]
    assert list((tmp_path / "cache-1").rglob("*.json")), "the served estimate wrote no cache entry"
    stopped = memfit("serve", "--stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    code, out, err = server.finish()
    assert code == 0 and f"ended after {len(runs) + 3} requests" in out, out + err
    assert not list((tmp_path / "serve").iterdir()), "the server left its socket behind"


def test_a_client_of_another_environment_runs_alone(server, tmp_path):
    """A variable read at import time (here TRANSFORMERS_VERBOSITY) makes another environment: not served."""
    env = _env(tmp_path / "serve", tmp_path / "cache-1", TRANSFORMERS_VERBOSITY="error")
    r = memfit("diagnose", "--text", OOM, env=env)
    assert r.returncode == 0, r.stderr
    assert memfit("serve", "--stop", env=env).returncode == 1  # no server for that environment
    assert memfit("serve", "--stop", env=_env(tmp_path / "serve", tmp_path / "cache-1")).returncode == 0
    code, out, _ = server.finish()
    assert "ended after 0 requests" in out, out


def test_ctrl_c_of_a_client_interrupts_its_served_command(server, tmp_path):
    env = _env(tmp_path / "serve", tmp_path / "cache-1")
    client = subprocess.Popen([sys.executable, "-m", "memfit", "plan", MODEL, "--gpu", "T4", "--max-length", "512",
                               "--no-cache"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    psutil = pytest.importorskip("psutil")
    deadline = time.monotonic() + 120
    while not psutil.Process(server.proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)  # until the server has forked the child that runs the plan
    time.sleep(0.5)
    client.send_signal(signal.SIGINT)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 130 and "interrupted" in err, (client.returncode, out[-300:], err[-500:])
    assert memfit("serve", "--stop", env=env).returncode == 0
    code, out, _ = server.finish()
    assert "ended after 1 request" in out, out  # the plan was the server's (forwarded), not a process of its own


def test_a_second_server_and_bad_options_are_clear_errors(server, tmp_path):
    env = _env(tmp_path / "serve", tmp_path / "cache-1")
    second = memfit("serve", env=env)
    assert second.returncode == 2 and "already runs" in second.stderr and second.stderr.count("\n") == 1
    for bad in ("0", "-3", "soon", "nan"):
        r = memfit("serve", "--idle-minutes", bad, env=env)
        assert r.returncode == 2 and "--idle-minutes" in r.stderr and r.stderr.count("\n") == 1, (bad, r.stderr)


def test_a_socket_folder_others_can_enter_is_refused(tmp_path):
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    env = _env(open_dir, tmp_path / "cache")
    r = memfit("serve", env=env)
    assert r.returncode == 2 and "not private" in r.stderr, r.stderr
    assert list(open_dir.iterdir()) == []


def test_without_a_server_a_client_runs_alone_at_once(tmp_path, monkeypatch):
    from memfit import server

    monkeypatch.setenv("MEMFIT_SERVE_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("MEMFIT_NO_SERVER", raising=False)
    assert server.run_served(["estimate"]) is None
    (tmp_path / "none").mkdir(mode=0o700)
    (tmp_path / "none" / "stale.sock").write_text("")  # not a server of this environment
    assert server.run_served(["estimate"]) is None
    monkeypatch.setenv("MEMFIT_NO_SERVER", "1")
    assert server.run_served(["estimate"]) is None
    with pytest.raises(MemfitError, match="more than 0"):
        server.serve(idle_s=0)


def test_a_served_command_writes_files_with_the_clients_umask(server, tmp_path):
    env = _env(tmp_path / "serve", tmp_path / "cache-1")
    work = tmp_path / "work"
    work.mkdir()
    code = ("import os, subprocess, sys; os.umask(0o077); "
            "sys.exit(subprocess.run([sys.executable, '-m', 'memfit', 'estimate', sys.argv[1], '--gpu', 'T4', "
            "'--max-length', '32', '--snapshot', 'run.pickle']).returncode)")
    r = subprocess.run([sys.executable, "-c", code, MODEL], env=env, cwd=work, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert (work / "run.pickle").stat().st_mode & 0o777 == 0o600
    assert memfit("serve", "--stop", env=env).returncode == 0
    assert "ended after 1 request" in server.finish()[1]


def test_a_served_child_runs_its_own_exit_handlers_not_the_servers(tmp_path):
    """A child forked from the server ends like a fresh process: the exit handlers its request registered run
    (temporary folders, logging), the server's own do not (they could remove what the server still uses)."""
    import atexit
    import socket as socketlib

    from memfit import process, server

    ours, theirs = socketlib.socketpair()
    pid = os.fork()
    if pid == 0:  # the child the server would fork
        try:
            ours.close()
            atexit.register(lambda: (tmp_path / "server-handler-ran").write_text("x"))

            def request(argv):
                atexit.register(lambda: (tmp_path / "request-handler-ran").write_text("x"))
                return 0

            process.run_here = request
            null = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
            server._run_child(theirs, null, {"argv": ["estimate"], "cwd": str(tmp_path), "env": dict(os.environ)},
                              {"ADDED_BY_IMPORT": "1"})
        finally:
            os._exit(99)  # not reached: _run_child ends the process
    theirs.close()
    messages = [server._read_message(ours) for _ in range(3)]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert messages == [(b"P", pid), (b"C", 0), (None, 0)]
    assert (tmp_path / "request-handler-ran").exists()
    assert not (tmp_path / "server-handler-ran").exists()
