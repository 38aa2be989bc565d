"""`memfit replay SNAPSHOT.pickle [--device N] [--max-split-size-mb N] [--what-if CONF] [--json]`.

Replays a recorded CUDA allocator trace (`torch.cuda.memory._dump_snapshot()`) through
memfit's allocator model, from the state at the start of the recording, and compares:
peak reserved and allocated, cudaMalloc counts, the sequence of segment operations (equal,
or the first divergence), then what `expandable_segments:True` and `max_split_size_mb:N`
would have done on the same trace.

Exit codes: 0 the replay reproduced the recording exactly; 1 it diverged; 2 user error (a
missing, unreadable, malicious or non-snapshot file), raised as MemfitError and printed by
memfit.cli.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from memfit.allocator.conf import AllocConf
from memfit.errors import MemfitError
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.allocator.snapshot import DeviceSummary, SnapshotReplay, WhatIf

# memfit.allocator.snapshot is imported where it runs: the CLI imports every verb's module to build its parser
# (memfit.cli), and an estimate does not need it

__all__ = ["replay_command_parser", "replay_command"]


def replay_command_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay",
        help="replay a real CUDA memory snapshot through memfit's allocator model",
        description="Replay the device trace of a `torch.cuda.memory._dump_snapshot()` pickle through memfit's "
                    "model of the CUDA caching allocator, from the state when recording started, and compare it "
                    "with what the real allocator did; then show what other allocator settings would have done. "
                    "The pickle is read without running code from it.",
    )
    p.add_argument("snapshot", help="the .pickle written by torch.cuda.memory._dump_snapshot(path)")
    p.add_argument("--device", type=int, default=None,
                   help="which device's trace (default: the device that ran out of memory, else the first one with "
                        "a trace); every device is summed up in one line")
    p.add_argument("--max-split-size-mb", type=int, default=128,
                   help="the max_split_size_mb to try on the trace (default 128)")
    p.add_argument("--what-if", action="append", default=[], metavar="CONF",
                   help="other PYTORCH_CUDA_ALLOC_CONF settings to try (repeatable)")
    p.add_argument("--gpu", default=None,
                   help="the GPU it was recorded on (e.g. A100-80GB): its memory sizes expandable segments' "
                        "address space; only expandable-segment traces need it")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--html", default=None, metavar="FILE.html",
                   help="also write recorded against modelled reserved memory over the trace, the first divergence "
                        "and the other settings' lines as one self-contained HTML file (works offline)")
    p.add_argument("--plot", default=None, metavar="FILE.png|.svg",
                   help="also write the same lines as a static picture (matplotlib, the `viz` extra)")
    p.set_defaults(func=replay_command)
    return p


def _conf_json(conf: AllocConf) -> dict:
    divs = conf.roundup_power2_divisions
    return {
        "max_split_size_bytes": conf.max_split_size_bytes,
        "expandable_segments": conf.expandable_segments,
        "garbage_collection_threshold": conf.garbage_collection_threshold,
        "roundup_power2_divisions": list(divs) if isinstance(divs, tuple) else divs,
    }


def to_json(path: str, device: int, r: SnapshotReplay, variants: list[WhatIf],
            devices: Sequence[DeviceSummary] = ()) -> dict:
    st = r.start
    return {
        "snapshot": path,
        "device": device,
        "devices": [asdict(d) for d in devices],
        "entries": r.num_entries,
        "exact": r.exact,
        "recorded": asdict(r.recorded),
        "modelled": asdict(r.modelled),
        "segment_sequence_equal": r.segment_sequence_equal,
        "reserved_equal_after_every_event": r.reserved_equal_after_every_event,
        "address_mismatches": r.address_mismatches,
        "final_state_equal": r.final_state_equal,
        "first_divergence": asdict(r.first_divergence) if r.first_divergence else None,
        "start": {"segments": len(st.segments) + sum(len(x[3]) for x in st.expandable),
                  "live_blocks": len(st.blocks), "reserved_bytes": st.reserved_bytes,
                  "allocated_bytes": st.allocated_bytes, "inferred_block_sizes": st.inferred_sizes,
                  "open_block_sizes": r.search.open_blocks if r.search else 0,
                  "sizes_fixed_by_trace": [list(x) for x in r.search.pinned] if r.search else [],
                  "forced_entries": list(r.search.forced) if r.search else [],
                  "allocated_uncertainty_bytes": r.search.allocated_uncertainty_bytes if r.search else 0},
        "settings": _conf_json(r.conf),
        "what_if": [asdict(v) for v in variants],
        "notes": list(r.notes),
    }


def _settings_text(conf: AllocConf) -> str:
    parts = [f"max_split_size {'unlimited' if conf.max_split_size_bytes is None else format_bytes(conf.max_split_size_bytes)}",
             f"expandable_segments {conf.expandable_segments}"]
    divs = conf.roundup_power2_divisions
    if isinstance(divs, tuple) and any(divs):
        parts.append(f"roundup_power2_divisions {list(divs)}")
    if conf.garbage_collection_threshold:
        parts.append(f"garbage_collection_threshold {conf.garbage_collection_threshold}")
    return ", ".join(parts)


def device_line(d: DeviceSummary, shown: int) -> str:
    """One device of the snapshot in one line."""
    oom = (f"; out of memory at entry {d.oom_entry} (asked {format_bytes(d.oom_requested_bytes or 0)}, "
           f"{format_bytes(d.oom_free_bytes or 0)} free)" if d.oom_entry is not None else "")
    mark = "  <- replayed" if d.device == shown else ""
    return (f"device {d.device}: {d.entries} trace entries, {d.segments} segments, peak reserved "
            f"{format_bytes(d.peak_reserved_bytes)}, reserved at the end {format_bytes(d.final_reserved_bytes)}"
            f"{oom}{mark}")


def render(path: str, device: int, r: SnapshotReplay, variants: list[WhatIf],
           devices: Sequence[DeviceSummary] = ()) -> None:
    st = r.start
    print(f"memfit replay {path}: {r.num_entries} trace entries on device {device}; settings: {_settings_text(r.conf)}")
    if len(devices) > 1:
        print(f"  the snapshot holds {len(devices)} devices (--device N replays another):")
        for d in devices:
            print(f"    {device_line(d, device)}")
    print(f"  at the start of recording: {len(st.segments) + len(st.expandable)} segments, {len(st.blocks)} live blocks, "
          f"reserved {format_bytes(st.reserved_bytes)}, allocated {format_bytes(st.allocated_bytes)} "
          "(the final segments with the trace undone)")
    rows = [
        ("peak reserved", format_bytes(r.recorded.peak_reserved_bytes), format_bytes(r.modelled.peak_reserved_bytes)),
        ("peak allocated", format_bytes(r.recorded.peak_allocated_bytes), format_bytes(r.modelled.peak_allocated_bytes)),
        ("cudaMalloc (segment_alloc/map)", str(r.recorded.segment_allocs), str(r.modelled.segment_allocs)),
        ("cudaFree (segment_free/unmap)", str(r.recorded.segment_frees), str(r.modelled.segment_frees)),
        ("final reserved", format_bytes(r.recorded.final_reserved_bytes), format_bytes(r.modelled.final_reserved_bytes)),
    ]
    print(f"  {'':32} {'recorded':>14} {'memfit':>14}")
    for name, rec, mod in rows:
        print(f"  {name:32} {rec:>14} {mod:>14}")
    if r.exact:
        print(f"  exact: the same {r.recorded.segment_allocs + r.recorded.segment_frees} segment operations (sizes, "
              "order), the same reserved memory after every entry, every block at the recorded address, and the "
              "same final segments")
    else:
        d = r.first_divergence
        if d is not None:
            print(f"  first divergence at trace entry {d.event_index}: the recording did `{d.recorded}`, "
                  f"memfit did `{d.modelled}`")
        print(f"  segment sequence equal: {r.segment_sequence_equal}; reserved equal after every entry: "
              f"{r.reserved_equal_after_every_event}; blocks at another address: {r.address_mismatches}; "
              f"final segments equal: {r.final_state_equal}")
    if variants:
        base = variants[0]
        print("  other settings on this trace (each run starts from an empty cache holding the blocks live at the "
              "start; compare the rows with each other):")
        for v in variants:
            delta = "" if v is base else f" ({_signed(v.peak_reserved_bytes - base.peak_reserved_bytes)})"
            print(f"    {v.settings:30} peak reserved {format_bytes(v.peak_reserved_bytes):>12}{delta}, "
                  f"cudaMalloc {v.segment_allocs}")
    for note in r.notes:
        print(f"  note: {note}")


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


def replay_command(args: argparse.Namespace) -> int:
    if args.max_split_size_mb is not None and args.max_split_size_mb < 20:
        raise MemfitError(f"--max-split-size-mb `{args.max_split_size_mb}` is below PyTorch's minimum of 20 "
                          "(kLargeBuffer); use e.g. `--max-split-size-mb 128`")
    if args.device is not None and args.device < 0:
        raise MemfitError(f"--device `{args.device}` is negative; give the CUDA device index, e.g. `--device 0`")
    from memfit.allocator.conf import parse_alloc_conf

    for text in args.what_if:  # checked before the snapshot is read
        if parse_alloc_conf(text).backend == "cudaMallocAsync":
            raise MemfitError(f"--what-if `{text}`: backend:cudaMallocAsync is not modelled (its pool is managed by "
                              "the CUDA driver), so memfit cannot say what it would have done; drop it")
    html, plot = getattr(args, "html", None), getattr(args, "plot", None)
    if html is not None or plot is not None:
        from memfit.report import check_view_paths

        check_view_paths(html, plot)  # fail before the replay, not after it
    memory = None
    if args.gpu is not None:
        from memfit.gpus.catalog import resolve_gpu

        memory = resolve_gpu(args.gpu).total_bytes
    from memfit.allocator.snapshot import default_device, device_summaries, load_snapshot, replay_snapshot, what_if

    snapshot = load_snapshot(args.snapshot)
    devices = device_summaries(snapshot)
    if args.device is None:
        args.device = default_device(devices)
    r = replay_snapshot(snapshot, device=args.device, device_memory_bytes=memory)
    tries = [None, "expandable_segments:True", f"max_split_size_mb:{args.max_split_size_mb}", *args.what_if]
    drawn = html is not None or plot is not None
    series: list[list[int] | None] = [[] if drawn else None for _ in tries]  # the page's and the picture's lines
    variants = [what_if(snapshot, t, device=args.device, device_memory_bytes=memory, reserved_after=s)
                for t, s in zip(tries, series)]
    if html is not None:
        import sys

        from memfit.report import write_html
        from memfit.report.replay_view import render_replay_html

        page = render_replay_html(args.snapshot, args.device, r, variants, series)
        print(f"memfit replay: {write_html(html, page)} written", file=sys.stderr)
    if plot is not None:
        import sys
        from pathlib import Path

        from memfit.report import write_file
        from memfit.report.replay_plot import render_replay_plot

        data = render_replay_plot(args.snapshot, args.device, r, variants, series, Path(plot).suffix.lower())
        print(f"memfit replay: {write_file(plot, data, '--plot')} written", file=sys.stderr)
    if args.json:
        print(json.dumps(to_json(args.snapshot, args.device, r, variants, devices), indent=2))
    else:
        render(args.snapshot, args.device, r, variants, devices)
    return 0 if r.exact else 1

