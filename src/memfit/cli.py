"""`memfit` command line: one module per verb in memfit.commands.

Each verb module has `<verb>_command_parser(subparsers)` and `<verb>_command(args) -> int`,
as accelerate's commands do. User errors (`MemfitError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from memfit.errors import MemfitError

__all__ = ["main"]

VERBS = ("estimate", "plan", "diagnose", "train", "replay")
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


if __name__ == "__main__":
    sys.exit(main())
