"""`memfit ui [--host 127.0.0.1] [--port 7860]`: the web app (memfit.ui; the `ui` extra) on this machine.

    memfit ui                       # http://127.0.0.1:7860, this machine only
    memfit ui --port 8080
    memfit ui --host 0.0.0.0        # reachable from other machines: anyone who reaches the port can run it

It binds to loopback unless told otherwise, runs one simulation at a time with a bounded queue, and reads no
file but those uploaded to it.
"""

from __future__ import annotations

import argparse

from memfit.errors import MemfitError

__all__ = ["ui_command_parser", "ui_command"]


def ui_command_parser(subparsers) -> argparse.ArgumentParser:
    from memfit.ui.settings import DEFAULT_MAX_QUEUE, DEFAULT_PORT  # not the app: the CLI starts fast

    p = subparsers.add_parser("ui", help="the web app: a form for estimate, plan and diagnose (needs `memfit[ui]`)",
                              description="Start memfit's web app (Gradio) on this machine: the setup as a form, "
                                          "estimate and plan buttons, a box for an OOM message, the results as "
                                          "the --html views.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"runs that may wait for the one running (default {DEFAULT_MAX_QUEUE}); more are refused")
    p.set_defaults(func=ui_command)
    return p


def ui_command(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise MemfitError(f"--port `{args.port}` is not a TCP port; give one from 1 to 65535, e.g. `--port 7860`")
    if args.max_queue < 1:
        raise MemfitError(f"--max-queue `{args.max_queue}` must be at least 1")
    from memfit.ui.app import build_app, launch

    demo = build_app(max_queue=args.max_queue)
    print(f"memfit ui: http://{args.host}:{args.port} (Ctrl+C stops it)", flush=True)
    launch(demo, server_name=args.host, server_port=args.port, show_error=False, quiet=True, footer_links=[])
    return 0
