"""A memfit command run in this process, and how the process ends.

`main` parses the command line and runs the verb (one module per verb in memfit.commands; each has
`<verb>_command_parser(subparsers)` and `<verb>_command(args) -> int`, as accelerate's commands do). User errors
(`MemfitError`) print one line and exit 2. `run_here` runs a compute verb in a process that ends with it, and
`finish_process` is what such a process must still do before `os._exit`. The console script (memfit.cli.entry)
and a `memfit serve` child (memfit.server) both run a command here.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys

from memfit._version import __version__
from memfit.errors import MemfitError

__all__ = ["main", "run_here", "finish_process", "quiet_import_noise", "one_line", "build_parser",
           "COMPUTE_VERBS"]

VERBS = ("estimate", "plan", "diagnose", "train", "replay", "serve", "ui")
#: Verbs that run with Python's cyclic collector paused (memfit.collector: imports and simulations, seconds
#: saved, no result changed); not `train`, a long real training run that needs it.
COMPUTE_VERBS = ("estimate", "plan", "diagnose", "replay")


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
        if args.verb in COMPUTE_VERBS:
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


#: Loggers whose import-time lines are noise in memfit's own process (the verbs in COMPUTE_VERBS):
#: transformers imports torchao where it is installed (transformers/quantizers/quantizer_torchao.py, at
#: import), and torchao 0.18 `__init__.py` logs "Failed to load ..._C_*.so" for each CUDA extension a CPU
#: machine cannot load; torch's `utils/_pytree.py` logs a deprecation for the Enums torchao registers;
#: bitsandbytes 0.50 `backends/cpu/ops.py` warns at import that the optional `kernels` package is missing
#: (`plan` imports it through peft, which liger-kernel imports). memfit.models.float8 and
#: memfit.models.quantization silence the same around their own imports.
_IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


def run_here(argv: list[str]) -> int:
    """A compute verb (COMPUTE_VERBS) in this process, which ends with it (memfit.cli.entry; a `memfit serve`
    child)."""
    gc.disable()  # memfit.collector.paused restores this state: off until the process ends
    quiet_import_noise()
    return main(argv)


def quiet_import_noise() -> None:
    """The loggers of `_IMPORT_NOISE_LOGGERS` at ERROR, for the rest of this process (memfit's own)."""
    for name in _IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def finish_process() -> None:
    """What an exit must do before `os._exit`: the atexit handlers (CPython's atexit module), then stdout and
    stderr flushed (memfit.cli's fast exit; a `memfit serve` child, memfit.server)."""
    try:
        getattr(__import__("atexit"), "_run_exitfuncs", lambda: None)()
    except BaseException:  # noqa: BLE001 - atexit prints a handler's failure itself
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`memfit estimate | head`) or stream: nothing to save
            pass
