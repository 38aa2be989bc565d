"""`memfit serve [--idle-minutes N] [--stop]`: keep a warm process for this environment's compute verbs.

While it runs, `memfit estimate`, `plan`, `diagnose` and `replay` started in the same environment run in a
child forked from it, with torch, transformers and memfit already imported (memfit.server). Exit codes: 0
done, 1 `--stop` found no server, 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import sys

from memfit.errors import MemfitError

__all__ = ["serve_command_parser", "serve_command"]


def serve_command_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from memfit.server import DEFAULT_IDLE_S

    p = subparsers.add_parser(
        "serve", help="keep a warm process: later estimates and plans here start without their imports",
        description="Import torch, transformers and memfit once and wait: every `memfit estimate`, `plan`, "
                    "`diagnose` and `replay` started in the same environment (same memfit, packages, Python "
                    "and import-time environment variables) runs in a process forked from this one, with its "
                    "own arguments, folder, environment and terminal, and gets the same result as on its own. "
                    "Runs in the foreground (`memfit serve &` to keep the shell); ends after the idle time, "
                    "on Ctrl-C or on `memfit serve --stop`. MEMFIT_NO_SERVER=1 makes a command run alone.",
    )
    p.add_argument("--idle-minutes", type=str, default=None, metavar="N",
                   help=f"exit after N minutes without a request (default {DEFAULT_IDLE_S / 60:g})")
    p.add_argument("--stop", action="store_true", help="stop the server of this environment and exit")
    p.set_defaults(func=serve_command)
    return p


def _idle_seconds(text: str | None) -> float:
    from memfit.server import DEFAULT_IDLE_S

    if text is None:
        return DEFAULT_IDLE_S
    try:
        minutes = float(text)
    except ValueError:
        raise MemfitError(f"--idle-minutes `{text}` is not a number; give minutes, e.g. `--idle-minutes 30`") from None
    if not math.isfinite(minutes) or minutes <= 0:
        raise MemfitError(f"--idle-minutes `{text}` must be a number of minutes above 0, e.g. `--idle-minutes 30`")
    return minutes * 60


def serve_command(args: argparse.Namespace) -> int:
    from memfit import server

    if args.stop:
        if server.stop():
            print(f"memfit serve: stopped the server at {server.socket_path()}")
            return 0
        print(f"memfit serve: no server runs for this environment ({server.socket_path()})", file=sys.stderr)
        return 1
    idle_s = _idle_seconds(args.idle_minutes)

    def ready(path) -> None:
        print(f"memfit serve: ready at {path}; estimate, plan, diagnose and replay in this environment start "
              f"warm. Ends after {idle_s / 60:g} idle minutes, on Ctrl-C or `memfit serve --stop`.", flush=True)

    served = server.serve(idle_s=idle_s, ready=ready)
    print(f"memfit serve: ended after {served} request{'s' if served != 1 else ''}")
    return 0
