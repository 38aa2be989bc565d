"""`memfit serve`: a warm process that every `estimate`, `plan`, `diagnose` and `replay` of this environment forks.

A cold `memfit estimate` spends most of its time importing torch, transformers and the model's code
(2.9 s of 4.0 s for the seed case on the 2-core machine, bench/README.md), and a first simulation
in a process pays once for the kernels' first dispatch. `serve()` pays both once: it imports what the
compute verbs use, then waits on a Unix socket. Each request is run by a child forked from that pristine
state, so requests never see each other's state; the child gets the client's argv, working directory,
environment and its stdin/stdout/stderr file descriptors (SCM_RIGHTS), so output, terminal width and
colours are the client's own, and sends back only the exit code. The result cannot depend on the server:
what a command computes is what the same command computes in a fresh process (tests/cli/test_server.py).

Which server a client may use: one started from the same memfit source (memfit.cache.source_hash), package
versions, Python, user and the environment variables that libraries read at import time (`_KEY_ENV`): a
server started in another environment is another socket, never used. The socket lives in a folder only
its user can enter (`socket_dir()`), and the server runs only the requests of its own user (SO_PEERCRED).
The parent never initializes CUDA and runs no thread of its own (forking needs that, as in
memfit.planner.workers). It exits after `idle_s` seconds without a request, on `memfit serve --stop`, or
on Ctrl-C; `MEMFIT_NO_SERVER=1` makes a client run in its own process.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from memfit import process
from memfit.errors import MemfitError

__all__ = ["serve", "run_served", "stop", "socket_path", "socket_dir", "DEFAULT_IDLE_S"]

DEFAULT_IDLE_S = 1800.0  #: a server ends after this many seconds without a request
_PROTOCOL = b"memfit-serve/1"
#: Environment variables read at import time by the code a server has imported (transformers/huggingface_hub
#: constants, torch's and the allocator's settings, Python's own): part of the server key, by prefix.
_KEY_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "TRITON", "PYTHON",
            "TOKENIZERS", "OMP_", "MKL", "BNB", "DS_", "DEEPSPEED", "ACCELERATE", "TRL", "LIGER", "XDG_", "LD_",
            "MEMFIT_", "PATH", "HOME", "LANG", "LC_")
#: read at every call (memfit.cache.cache_dir) and applied by the child, or only the client's / server's own
_UNKEYED = ("MEMFIT_CACHE_DIR", "MEMFIT_NO_SERVER", "MEMFIT_SERVE_WARMUP")
_UNIX_PATH_MAX = 104  #: sockaddr_un's sun_path is 108 bytes on Linux, 104 on macOS


def socket_dir() -> Path:
    """`$MEMFIT_SERVE_DIR`, else `$XDG_RUNTIME_DIR/memfit`, else `~/.cache/memfit/serve` (XDG_CACHE_HOME honoured)."""
    env = os.environ.get("MEMFIT_SERVE_DIR")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "memfit"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memfit" / "serve"


def _environment_key() -> str:
    from memfit.cache import _versions, source_hash

    env = {k: v for k, v in os.environ.items() if k.startswith(_KEY_ENV) and k not in _UNKEYED}
    material = {"source": source_hash(), "versions": _versions(), "python": [sys.executable, sys.version],
                "uid": os.getuid(), "env": sorted(env.items())}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def socket_path() -> Path:
    """The socket of the server for this process's environment (whether one runs or not)."""
    return socket_dir() / f"{_environment_key()}.sock"


def _private_dir(path: Path, *, create: bool) -> bool:
    """Whether `path` is a folder of this user that nobody else can enter; made so when `create`."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as err:
            raise MemfitError(f"cannot create the socket folder `{path}`: {err.strerror}; set MEMFIT_SERVE_DIR "
                              "to a folder of yours") from None
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


# -- the client ---------------------------------------------------------------------------------------------
def run_served(argv: list[str]) -> int | None:
    """Run `memfit argv` in this environment's server; its exit code, or None when no server can take it
    (none runs, `MEMFIT_NO_SERVER`, another platform): then the caller runs it itself. Nothing has been
    printed when None is returned."""
    if os.environ.get("MEMFIT_NO_SERVER", "").strip() not in ("", "0") or not hasattr(socket, "AF_UNIX"):
        return None
    if "-" in argv and os.isatty(0):  # typed input: a server's child is not in the terminal's foreground group
        return None
    folder = socket_dir()
    try:
        if not any(name.endswith(".sock") for name in os.listdir(folder)):
            return None
    except OSError:
        return None
    if not _private_dir(folder, create=False):
        return None
    path = socket_path()
    if len(os.fsencode(path)) >= _UNIX_PATH_MAX:
        return None
    conn = _connect(path)
    if conn is None:  # no server for this environment (or a stale socket of one that died)
        return None
    with conn:
        try:
            umask = os.umask(0o077)
            os.umask(umask)
            request = json.dumps({"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ),
                                  "umask": umask}).encode()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            socket.send_fds(conn, [_PROTOCOL + struct.pack("!Q", len(request))], [0, 1, 2])
            conn.sendall(request)
        except (OSError, ValueError):
            return None  # the server is gone or refused before anything ran
        child = code = None
        interrupted = False
        while code is None:
            try:
                tag, value = _read_message(conn)
            except KeyboardInterrupt:  # Ctrl-C reaches the client's process group; the child is the server's
                interrupted = True
                tag, value = b"I", 0
            except OSError:
                tag, value = None, 0
            if tag == b"P":
                child = value
            elif tag == b"C":
                code = value
            elif tag is None:
                if child is None:
                    return None  # refused before a child started (another user, a protocol change): run alone
                break
            if interrupted and child is not None and child > 1:
                interrupted = False
                try:
                    os.kill(child, signal.SIGINT)
                except OSError:
                    pass
    if code is None:
        print(f"memfit: the `memfit serve` process {child} ran this command and ended without an exit code "
              "(killed?); run it again, or with MEMFIT_NO_SERVER=1", file=sys.stderr)
        return 1
    return code


def _read_message(conn: socket.socket) -> tuple[bytes | None, int]:
    """One message of a server's child: (b"P", its pid) first, then (b"C", the exit code); (None, 0) at the end."""
    data = b""
    while len(data) < 9:
        chunk = conn.recv(9 - len(data))
        if not chunk:
            return None, 0
        data += chunk
    return data[:1], struct.unpack("!q", data[1:])[0]


def _message(tag: bytes, value: int) -> bytes:
    return tag + struct.pack("!q", value)


def stop() -> bool:
    """Ask this environment's server to exit; whether one was running."""
    path = socket_path()
    conn = _connect(path)
    if conn is None:
        return False
    with conn:
        try:
            socket.send_fds(conn, [b"memfit-stop/1" + struct.pack("!Q", 0)], [])
            conn.recv(9)
        except OSError:
            return False
    return True


# -- the server ---------------------------------------------------------------------------------------------
def _preload() -> None:
    """Import what the compute verbs import (memfit.process builds every verb's parser; the estimator, the engine
    and the planner import torch and transformers' model utilities), their import-time log lines quieted as
    memfit.process.run_here quiets them."""
    process.quiet_import_noise()
    import memfit.estimator  # noqa: F401
    import memfit.planner.search  # noqa: F401
    import memfit.sim.engine  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    process.build_parser()
    if os.environ.get("MEMFIT_SERVE_WARMUP", "1") != "0":
        from memfit.commands.estimate import SEED_CASE
        from memfit.estimator import estimate
        from memfit.train_setup import TrainSetup

        seed = dict(SEED_CASE)
        gpu, training_args, model = seed.pop("gpu"), seed.pop("training_args"), seed.pop("model")
        try:
            estimate(TrainSetup.from_kwargs(model, training_args=training_args, **seed), gpu=gpu, cache=False)
        except MemfitError:  # a warm-up only: the requests run as they would without it
            pass


def serve(*, idle_s: float = DEFAULT_IDLE_S, ready=None) -> int:
    """Run the server for this environment until `idle_s` seconds pass without a request, `stop()`, or Ctrl-C.

    Args:
        idle_s: seconds without a request after which the server exits (> 0).
        ready: called with the socket path once requests are accepted (the CLI prints it).

    Returns the number of requests served.
    """
    if not idle_s > 0:
        raise MemfitError(f"idle time `{idle_s}` must be more than 0 seconds")
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "fork"):
        raise MemfitError("`memfit serve` needs Unix sockets and fork (Linux or macOS)")
    folder = socket_dir()
    if not _private_dir(folder, create=True):
        raise MemfitError(f"the socket folder `{folder}` is not private to this user (it must be owned by you, "
                          "mode 700); set MEMFIT_SERVE_DIR to a folder of yours")
    path = socket_path()
    if len(os.fsencode(path)) >= _UNIX_PATH_MAX:
        raise MemfitError(f"the socket path `{path}` is too long for a Unix socket; set MEMFIT_SERVE_DIR to a "
                          "shorter folder")
    before = dict(os.environ)
    _preload()
    # what the imports set (torch._inductor: TORCHINDUCTOR_CACHE_DIR): a fresh process's imports would set it too
    imported_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # pragma: no cover - nothing above touches CUDA
        raise MemfitError("CUDA was initialized while preloading; a server cannot fork from that state")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.fspath(path))
    except OSError:
        if _alive(path) or not stat.S_ISSOCK(os.lstat(path).st_mode):
            listener.close()
            raise MemfitError(f"a `memfit serve` for this environment already runs (`{path}`); "
                              "`memfit serve --stop` ends it") from None
        os.unlink(path)  # the socket a server that died left (memfit's own file: a socket under its name)
        listener.bind(os.fspath(path))
    bound = os.stat(path).st_ino
    listener.listen(16)
    listener.settimeout(1.0)
    served, children, last = 0, set(), time.monotonic()
    if ready is not None:
        ready(path)
    try:
        while True:
            children -= _reaped(children)
            if not children and time.monotonic() - last > idle_s:
                break
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            last = time.monotonic()
            with conn:
                kind, fds, request = _receive(conn)
                if kind == "stop":
                    conn.sendall(_message(b"C", 0))
                    break
                if kind != "run":
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child ends in os._exit; tests/cli/test_server.py runs it
                    listener.close()
                    _run_child(conn, fds, request, imported_env)
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                served += 1
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == bound:  # its own socket, not one a later server bound there
                os.unlink(path)
        except OSError:
            pass
    return served


def _connect(path: Path) -> socket.socket | None:
    """A connection to the server listening at `path`, or None when none does."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.fspath(path))
    except OSError:
        conn.close()
        return None
    return conn


def _alive(path: Path) -> bool:
    conn = _connect(path)
    if conn is not None:
        conn.close()
    return conn is not None


def _reaped(children: set[int]) -> set[int]:
    done = set()
    for pid in children:
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got = pid
        if got:
            done.add(pid)
    return done


def _receive(conn: socket.socket) -> tuple[str, list[int], dict]:
    """The request on `conn`: ("run", fds, request), ("stop", [], {}) or ("bad", fds, {})."""
    conn.settimeout(10.0)
    try:
        if hasattr(socket, "SO_PEERCRED"):  # Linux: only this user's requests
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                return "bad", [], {}
        head, fds, _flags, _addr = socket.recv_fds(conn, len(_PROTOCOL) + 8, 3)
        if head.startswith(b"memfit-stop/1"):
            return "stop", fds, {}
        if not head.startswith(_PROTOCOL) or len(fds) != 3:
            return "bad", fds, {}
        size = struct.unpack("!Q", head[len(_PROTOCOL):len(_PROTOCOL) + 8])[0]
        data = b""
        while len(data) < size:
            chunk = conn.recv(min(size - len(data), 1 << 20))
            if not chunk:
                return "bad", fds, {}
            data += chunk
        request = json.loads(data)
    except (OSError, ValueError, struct.error):
        return "bad", [], {}
    if not isinstance(request, dict) or not isinstance(request.get("argv"), list):
        return "bad", fds, {}
    return "run", fds, request


def _run_child(conn: socket.socket, fds: list[int], request: dict,
               imported_env: dict[str, str]) -> None:  # pragma: no cover - in the child
    """In the forked child: become the client's process (fds, cwd, environment, argv), run it, send the code.
    `imported_env`: what the server's imports added to its environment, kept where the client has no value."""
    import atexit

    code = 1
    # the server's exit handlers are the server's (they could remove what it still uses); the ones this request
    # registers run at its end, as at a fresh process's exit (CPython's atexit module)
    getattr(atexit, "_clear", lambda: None)()
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd != target:
                os.close(fd)
        try:
            sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as Python sets it up for a process of its own
        except (AttributeError, ValueError):
            pass
        os.chdir(request["cwd"])
        os.umask(int(request.get("umask", 0o022)))
        env = {str(k): str(v) for k, v in request["env"].items()}
        os.environ.clear()
        os.environ.update({**{k: v for k, v in imported_env.items() if k not in env}, **env})
        argv = [str(a) for a in request["argv"]]
        sys.argv = ["memfit", *argv]
        conn.settimeout(None)
        conn.sendall(_message(b"P", os.getpid()))
        code = process.run_here(argv)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - what a fresh process would print: the traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        process.finish_process()  # this request's exit handlers (the server's were cleared), then the output flushed
        try:
            conn.sendall(_message(b"C", code))
        except OSError:
            pass
        os._exit(code if 0 <= code < 256 else 1)
