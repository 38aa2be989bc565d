"""`memfit diagnose [LOGFILE|-] [--text ...] [--lang en|zh] [--json] [--plan PLAN.json]`.

The log (a file or stdin) is read in any encoding `memfit.oom_text.decode_log` reads: UTF-8,
and the UTF-16 with BOM that Windows PowerShell 5 writes with ``>``.

Exit codes: 0 an out-of-memory error was found and explained; 1 none found; 2 user error
(missing or unreadable file, a plan file that is not a memfit plan), raised as MemfitError
and printed by memfit.cli as one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.commands.estimate import add_setup_arguments, build_setup
from memfit.errors import MemfitError
from memfit.files import read_json_object
from memfit.diagnosis.strings import LANGS, t
from memfit.oom_text import decode_log

if TYPE_CHECKING:
    from memfit.diagnosis.verb import Diagnosis

# memfit.diagnosis.verb is imported where it runs: the CLI imports every verb's module to build its parser
# (memfit.cli), and an estimate does not need it

__all__ = ["diagnose_command_parser", "diagnose_command"]


def diagnose_command_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "diagnose",
        help="explain a CUDA out-of-memory error from a log or traceback",
        description="Find the last out-of-memory error in a training log or traceback and explain "
        "where it happened, why, and what helps.",
    )
    parser.add_argument("logfile", nargs="?", help="log or traceback file (UTF-8 or UTF-16); `-` reads stdin")
    parser.add_argument("--text", help="the error text itself instead of a file")
    parser.add_argument("--lang", choices=LANGS, default="en", help="output language (default: en)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--html", default=None, metavar="FILE.html",
                        help="also write the diagnosis (the message's figures as one bar of the GPU's memory, the "
                             "causes, the remedies) as one self-contained HTML file (works offline)")
    parser.add_argument("--plan", dest="plan_file", default=None,
                        help="a plan saved with `memfit plan ... --json > plan.json`: print its chosen change")
    group = parser.add_argument_group("the run that failed (hands the diagnosis to the planner)")
    add_setup_arguments(group, model_option=True)
    parser.set_defaults(func=diagnose_command)
    return parser


def _read_source(args: argparse.Namespace) -> tuple[str, str]:
    if args.text is not None and args.logfile is not None:
        raise MemfitError(f"got both a log file `{args.logfile}` and --text; give one of them")
    if args.text is not None:
        return args.text, "--text"
    if args.logfile is None:
        raise MemfitError("no input `(none)`; pass a log file, `-` to read stdin, or --text \"<error message>\"")
    if args.logfile == "-":
        buffer = getattr(sys.stdin, "buffer", None)  # bytes: a UTF-16 pipe from PowerShell decodes too
        return (decode_log(buffer.read()) if buffer is not None else sys.stdin.read()), "stdin"
    from memfit.diagnosis.verb import read_log

    return read_log(args.logfile), str(Path(args.logfile))


def _gpu_processes() -> list[tuple[int, int, int]]:
    """(device, pid, bytes) of compute processes now, via NVML when installed; else []."""
    from memfit.gpus.outside_pytorch import gpu_processes

    return gpu_processes() or []


def to_json(d: Diagnosis, gpu_processes: list[tuple[int, int, int]]) -> dict:
    m = d.message
    return {
        "is_oom": d.is_oom,
        "oom_count": d.oom_count,
        "format": m.format if m else None,
        "backend": m.backend if m else None,
        "device": m.device if m else None,
        "tried_to_allocate_bytes": m.tried_to_allocate_bytes if m else None,
        "total_bytes": m.total_bytes if m else None,
        "free_bytes": m.free_bytes if m else None,
        "allocated_bytes": m.allocated_bytes if m else None,
        "reserved_bytes": m.reserved_bytes if m else None,
        "reserved_unallocated_bytes": m.reserved_unallocated_bytes if m else None,
        "non_pytorch_bytes": d.non_pytorch_bytes,
        "process_used_bytes": m.process_used_bytes if m else None,
        "allowed_bytes": m.allowed_bytes if m else None,
        "private_pool_bytes": m.private_pool_bytes if m else 0,
        "other_allocations_bytes": m.other_allocations_bytes if m else None,
        "other_processes": [{"pid": pid, "bytes": b} for pid, b in (m.other_processes if m else ())],
        "phase": d.phase,
        "phase_frame": d.phase_frame,
        "operation": d.operation,
        "operation_frame": d.operation_frame,
        "operation_context": list(d.operation_context),
        "model_part": d.model_part or None,
        "model_part_frame": d.model_part_frame or None,
        "causes": [{"kind": c.kind, "bytes": c.bytes, "text": c.text, "primary": c.primary} for c in d.causes],
        "advice": list(d.advice),
        "advice_ids": list(d.advice_ids),
        "remedies": list(d.remedies),
        "message": m.raw if m else None,
        "gpu_processes_now": [{"device": g, "pid": pid, "bytes": b} for g, pid, b in gpu_processes],
    }


def _print_rich(d: Diagnosis, gpu_processes: list[tuple[int, int, int]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from memfit.diagnosis.causes import _fmt

    lang, m = d.lang, d.message
    assert m is not None
    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    title = {"cpu": "title.cpu", "rocm": "title.rocm", "xpu": "title.xpu", "mps": "title.mps"}.get(m.backend or "", "title")
    console.rule(t(title, lang))
    if d.oom_count > 1:
        console.print(t("count", lang, count=d.oom_count))
    console.print(f"[bold]{t('label.message', lang)}:[/bold] {escape(m.raw)}", markup=True)
    console.print(f"[bold]{t('label.format', lang)}:[/bold] {m.format}")
    console.print(f"[bold]{t('label.phase', lang)}:[/bold] {t('phase.' + d.phase, lang)}")
    if d.phase_frame:
        console.print(f"[bold]{t('label.frame', lang)}:[/bold] {escape(d.phase_frame)}", markup=True)
    if d.operation != "unknown":
        inside = ", ".join(t("operation." + o, lang) for o in d.operation_context)
        extra = f" ({t('label.operation_context', lang)}: {inside})" if inside else ""
        console.print(f"[bold]{t('label.operation', lang)}:[/bold] {escape(t('operation.' + d.operation, lang) + extra)}",
                      markup=True)
        if d.operation_frame and d.operation_frame != d.phase_frame:
            console.print(f"[bold]{t('label.frame', lang)}:[/bold] {escape(d.operation_frame)}", markup=True)
    if d.model_part:
        console.print(f"[bold]{t('label.model_part', lang)}:[/bold] {escape(t('part.' + d.model_part, lang))}",
                      markup=True)
        console.print(f"[bold]{t('label.frame', lang)}:[/bold] {escape(d.model_part_frame)}", markup=True)
    rows: list[tuple[str, int | None, bool]] = []  # (label, value, shown when unknown)
    if m.has_numbers:
        rows = [("num.tried", m.tried_to_allocate_bytes, True), ("num.total", m.total_bytes, True),
                ("num.free", m.free_bytes, True), ("num.allocated", m.allocated_bytes, True),
                ("num.reserved", m.reserved_bytes, True), ("num.unallocated", m.reserved_unallocated_bytes, True),
                ("num.non_pytorch", m.non_pytorch_bytes, True), ("num.process", m.process_used_bytes, False),
                ("num.allowed", m.allowed_bytes, False), ("num.private", m.private_pool_bytes or None, False)]
    elif m.format == "mps":
        rows = [("num.tried", m.tried_to_allocate_bytes, True), ("num.mps_allocated", m.reserved_bytes, True),
                ("num.mps_other", m.other_allocations_bytes, True), ("num.mps_allowed", m.allowed_bytes, True)]
    if rows:
        table = Table(title=t("label.numbers", lang), show_header=False)
        for key, value, always in rows:
            if value is not None or always:
                table.add_row(t(key, lang), _fmt(value, lang))
        console.print(table)
    console.print(f"[bold]{t('label.causes', lang)}[/bold]")
    for c in d.causes:
        tag = f" [bold red]({t('label.primary', lang)})[/bold red]" if c.primary else ""
        console.print("  • ", escape(c.text), tag, sep="", markup=True)
    console.print(f"[bold]{t('label.advice', lang)}[/bold]")
    for i, a in enumerate(d.advice, 1):
        console.print(f"  {i}. ", a, sep="", markup=False)
    if gpu_processes:
        console.print(f"[bold]{t('label.gpu_processes', lang)}[/bold]")
        for g, pid, b in gpu_processes:
            console.print(f"  GPU {g}  PID {pid}  {_fmt(b)}")


def _saved_plan(path: str) -> dict:
    data = read_json_object(path, "plan file", "save one with `memfit plan ... --json > plan.json`")
    if data.get("schema") != "memfit.plan/1":
        raise MemfitError(f"`{path}` is not a memfit plan (schema `memfit.plan/1`); save one with `memfit plan --json`")
    return data


def diagnose_command(args: argparse.Namespace) -> int:
    if getattr(args, "html", None) is not None:
        from memfit.report import check_html_path

        check_html_path(args.html)  # fail before the work, not after it
    text, source = _read_source(args)
    setup = None
    if args.model is not None or args.args_file is not None:
        setup, _, _ = build_setup(args)  # `--args` without `--model`: the file's "model", else a MemfitError
    saved = _saved_plan(args.plan_file) if args.plan_file else None
    from memfit.diagnosis.verb import diagnose

    d = diagnose(text, lang=args.lang, setup=setup)
    gpu_processes = _gpu_processes() if d.is_oom else []
    if getattr(args, "html", None) is not None:
        from memfit.report import write_html
        from memfit.report.diagnose_view import render_diagnosis_html

        print(f"memfit diagnose: {write_html(args.html, render_diagnosis_html(d))} written", file=sys.stderr)
    if args.json:
        out = to_json(d, gpu_processes)
        if d.plan is not None:
            out["plan"] = d.plan.to_json()
        if saved is not None:
            out["saved_plan"] = saved
        print(json.dumps(out, ensure_ascii=False, indent=2, default=str))
    elif not d.is_oom:
        print(t("no_oom", args.lang, source=source))
    else:
        _print_rich(d, gpu_processes)
        if d.plan is not None:
            from memfit.commands.plan import render

            print()
            render(d.plan)
        elif saved is not None:
            _print_saved(saved)
    return 0 if d.is_oom else 1


def _print_saved(saved: dict) -> None:
    chosen = saved.get("chosen")
    if chosen is None:
        print("The saved plan has no configuration that fits; see its `suggestions`.")
        return
    p = saved["plans"][chosen]
    print("The saved plan's change:")
    for k, v in p.get("env", {}).items():
        print(f"  export {k}={v}")
    if p.get("changes"):
        print("  TrainingArguments(..., " + ", ".join(f"{k}={v!r}" for k, v in p["changes"].items()) + ")")
    for line in p.get("code", []):
        print("  " + line)
