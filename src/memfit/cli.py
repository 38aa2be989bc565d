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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Make Hugging Face fine-tuning fit in GPU memory.",
    )
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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except MemfitError as err:
        print(f"memfit {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
