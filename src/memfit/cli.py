"""`memfit` command line: one module per verb in memfit.commands.

Each verb module has `<verb>_command_parser(subparsers)` and `<verb>_command(args) -> int`,
as accelerate's commands do. User errors (`MemfitError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import threading

from memfit.errors import MemfitError

__all__ = ["main", "entry", "run_here", "finish_process"]

VERBS = ("estimate", "plan", "diagnose", "train", "replay", "serve")
#: Verbs that run with Python's cyclic collector paused (memfit.collector: imports and simulations, seconds
#: saved, no result changed); not `train`, a long real training run that needs it.
_COLLECTOR_PAUSED = ("estimate", "plan", "diagnose", "replay")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `memfit estimate: error: ... (see memfit estimate --help)`, exit 2."""

    def error(self, message: str):  # argparse.ArgumentParser.error prints the usage block first
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def one_line(message: str) -> str:
    """A message on one line: the line breaks a value brought in (any str.splitlines boundary) shown as `\\n`."""
    return "\\n".join(str(message).splitlines())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memfit",
        description="Make Hugging Face fine-tuning fit in GPU memory.",
    )
    from memfit import __version__

    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb in VERBS:
        try:
            module = importlib.import_module(f"memfit.commands.{verb}")
        except ModuleNotFoundError as err:  # a verb still being built
            if err.name == f"memfit.commands.{verb}":
                continue
            raise
        getattr(module, f"{verb}_command_parser")(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad flag (its one line already printed)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.verb in _COLLECTOR_PAUSED:
            from memfit.collector import paused

            with paused():
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except MemfitError as err:
        print(f"memfit {args.verb}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


#: Loggers whose import-time lines are noise in memfit's own process (the verbs in _COLLECTOR_PAUSED):
#: transformers imports torchao where it is installed (transformers/quantizers/quantizer_torchao.py, at
#: import), and torchao 0.18 `__init__.py` logs "Failed to load ..._C_*.so" for each CUDA extension a CPU
#: machine cannot load; torch's `utils/_pytree.py` logs a deprecation for the Enums torchao registers;
#: bitsandbytes 0.50 `backends/cpu/ops.py` warns at import that the optional `kernels` package is missing
#: (`plan` imports it through peft, which liger-kernel imports). memfit.models.float8 and
#: memfit.models.quantization silence the same around their own imports.
_IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


def entry() -> None:
    """The `memfit` console script and `python -m memfit`: `main()` in a process that ends with it.

    For the verbs that only compute and print (_COLLECTOR_PAUSED) the collector stays off to the end and the
    process ends without tearing the interpreter down: a simulation leaves millions of small objects (fake
    tensors, traces), and collecting and freeing them at exit cost 0.9 s of a 4.9 s `memfit estimate` (and
    re-enabling the collector after the verb another 0.3 s: one full collection), measured on the 2-core
    machine (bench/README.md, issue 15). What an exit must still do is done first: output flushed, atexit
    handlers run (logging, multiprocessing, tempfile); with a non-daemon thread still running the normal exit
    is taken, as it would join it. `train` exits normally: its run owns files and processes. Where a
    `memfit serve` of this environment runs, a compute verb runs in a child of it (memfit.server).
    """
    argv = sys.argv[1:]
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb not in _COLLECTOR_PAUSED:
        sys.exit(main(argv))
    try:
        from memfit.server import run_served  # a `memfit serve` of this environment runs it warm, if one runs

        code = run_served(argv)
    except KeyboardInterrupt:  # before a served child could be told
        print("memfit: interrupted", file=sys.stderr)
        _exit_now(130)
    _exit_now(run_here(argv) if code is None else code)


def run_here(argv: list[str]) -> int:
    """A compute verb (_COLLECTOR_PAUSED) in this process, which ends with it (`entry`; a `memfit serve` child)."""
    gc.disable()  # memfit.collector.paused restores this state: off until the process ends
    quiet_import_noise()
    return main(argv)


def quiet_import_noise() -> None:
    """The loggers of `_IMPORT_NOISE_LOGGERS` at ERROR, for the rest of this process (memfit's own)."""
    for name in _IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _exit_now(code: int) -> None:
    """End the process with `code` after what Python's own exit would do that anyone can see (see `entry`)."""
    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if not hasattr(__import__("atexit"), "_run_exitfuncs") or busy:
        sys.exit(code)
    finish_process()
    os._exit(code)


def finish_process() -> None:
    """What an exit must do before `os._exit`: the atexit handlers (CPython's atexit module), then stdout and
    stderr flushed (`_exit_now`; a `memfit serve` child, memfit.server)."""
    try:
        getattr(__import__("atexit"), "_run_exitfuncs", lambda: None)()
    except BaseException:  # noqa: BLE001 - atexit prints a handler's failure itself
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`memfit estimate | head`) or stream: nothing to save
            pass


if __name__ == "__main__":
    entry()
