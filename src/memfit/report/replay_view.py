"""A snapshot replay as one self-contained HTML page: the reserved memory the recording shows against
the one memfit's allocator model gives, after every trace entry, the first divergence marked, and
what other allocator settings would have reserved on the same trace as extra lines.

A view of what `memfit.allocator.snapshot.replay_snapshot` and `what_if` computed: the recorded
and modelled lines are `SnapshotReplay.recorded_reserved_bytes` / `modelled_reserved_bytes`, each
what-if line the `reserved_after` list `what_if` filled. Lines longer than `MAX_POINTS` keep, per
bucket of entries, their lowest and highest value (the peaks stay). No script: a line's name is its
SVG `<title>`.

Stable hooks: `path[data-series=recorded|modelled|what-if]` (`data-peak-bytes`, `data-settings`),
`[data-marker=divergence]` (`data-index`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memfit.report._svg import Chart, linear_ticks
from memfit.report.html import _CSS, _card, _e, _table, page
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.allocator.snapshot import SnapshotReplay, WhatIf

__all__ = ["MAX_POINTS", "WHAT_IF_COLORS", "downsample", "render_replay_html"]

#: Points per line at most (min and max per bucket: twice this many vertices).
MAX_POINTS = 2000

_REPLAY_CSS = """
.chart{width:100%;height:auto;display:block;font-size:11px}
.ln{fill:none;stroke-width:1.6}.ln.recorded{stroke:#111;stroke-width:2.4}.ln.modelled{stroke:#0072B2;stroke-dasharray:5 3}
.div{stroke:#b00020;stroke-width:1.5;stroke-dasharray:3 3}.div-label{fill:#b00020;font-weight:600}
"""
#: What-if line colours (Okabe & Ito 2008, as memfit.report.style).
WHAT_IF_COLORS = ("#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#999999")


def downsample(values: Sequence[int], max_points: int = MAX_POINTS) -> list[tuple[int, int]]:
    """(entry index, bytes) of `values`, at most about 2 * max_points of them: every value when there are
    few, else each bucket's lowest and highest in order (the maximum is always kept)."""
    n = len(values)
    if n <= 2 * max_points:
        return list(enumerate(values))
    out: list[tuple[int, int]] = []
    size = n / max_points
    for k in range(max_points):
        lo, hi = int(k * size), min(int((k + 1) * size), n)
        if lo >= hi:
            continue
        i_min = min(range(lo, hi), key=values.__getitem__)
        i_max = max(range(lo, hi), key=values.__getitem__)
        out += sorted({(i_min, values[i_min]), (i_max, values[i_max])})
    return out


def _chart(r: "SnapshotReplay", variants: Sequence["WhatIf"], series: Sequence[Sequence[int] | None]) -> str:
    lines = [("recorded", "recorded (the real allocator)", r.recorded_reserved_bytes, "recorded"),
             ("modelled", "memfit's model of the recorded settings", r.modelled_reserved_bytes, "modelled")]
    lines += [("what-if", f"what if: {v.settings}", s, v.settings) for v, s in zip(variants, series) if s]
    top = max((max(vals) for _, _, vals, _ in lines if vals), default=1)
    n = max(r.num_entries, 2)
    c = Chart(0, n - 1, top * 1.08)
    c.axes(linear_ticks(0, n - 1, "{:g}"), f"trace entry ({r.num_entries} allocator events in the recording)")
    k = 0
    for kind, label, vals, settings in lines:
        if not vals:
            continue
        color = ""
        if kind == "what-if":
            color = f'style="stroke:{WHAT_IF_COLORS[k % len(WHAT_IF_COLORS)]}"'
            k += 1
        c.polyline(downsample(vals), f"ln {kind}", f'data-series="{kind}" data-settings="{_e(settings)}" '
                   f'data-peak-bytes="{max(vals)}" {color}', f"{label}: peak {format_bytes(max(vals))}")
    d = r.first_divergence
    if d is not None:
        x = min(d.event_index, n - 1)
        c.parts.append(f'<line class="div" x1="{c.X(x):.1f}" x2="{c.X(x):.1f}" y1="{c.top}" '
                       f'y2="{c.height - c.bottom}" data-marker="divergence" data-index="{d.event_index}"/>')
        c.text(x, top * 1.04, f"first divergence: entry {d.event_index}", "div-label",
               "end" if x > (n - 1) * 0.6 else "start", 0)
    return c.svg("memfit-replay-chart", "reserved memory over the trace")


def _legend(variants: Sequence["WhatIf"], series: Sequence[Sequence[int] | None]) -> str:
    items = ['<span><i style="background:#111"></i>recorded</span>',
             '<span><i style="background:#0072B2"></i>memfit (recorded settings)</span>']
    k = 0
    for v, s in zip(variants, series):
        if s:
            items.append(f'<span><i style="background:{WHAT_IF_COLORS[k % len(WHAT_IF_COLORS)]}"></i>'
                         f"what if: {_e(v.settings)}</span>")
            k += 1
    return '<div class="legend">' + "".join(items) + "</div>"


def render_replay_html(path: str, device: int, r: "SnapshotReplay", variants: Sequence["WhatIf"],
                       series: Sequence[Sequence[int] | None] = ()) -> str:
    """The whole page of a replay of `path` (device `device`), with `series[i]` the reserved bytes after every
    entry of `variants[i]` (`what_if(..., reserved_after=[])`; None or empty: not drawn)."""
    title = f"memfit replay: {path}"
    verdict = "exact" if r.exact else "diverges"
    cards = [_card("entries", str(r.num_entries), f"device {device}"),
             _card("replay", verdict, "same segment operations, reserved, addresses, final state" if r.exact
                   else "see the first divergence", "good" if r.exact else "bad"),
             _card("peak reserved, recorded", format_bytes(r.recorded.peak_reserved_bytes)),
             _card("peak reserved, memfit", format_bytes(r.modelled.peak_reserved_bytes))]
    rows = [["peak reserved", _e(format_bytes(r.recorded.peak_reserved_bytes)),
             _e(format_bytes(r.modelled.peak_reserved_bytes))],
            ["peak allocated", _e(format_bytes(r.recorded.peak_allocated_bytes)),
             _e(format_bytes(r.modelled.peak_allocated_bytes))],
            ["cudaMalloc (segment_alloc/map)", str(r.recorded.segment_allocs), str(r.modelled.segment_allocs)],
            ["cudaFree (segment_free/unmap)", str(r.recorded.segment_frees), str(r.modelled.segment_frees)],
            ["final reserved", _e(format_bytes(r.recorded.final_reserved_bytes)),
             _e(format_bytes(r.modelled.final_reserved_bytes))]]
    body = [f"<h1>{_e(title)}</h1>", '<div class="cards">' + "".join(cards) + "</div>",
            "<h2>Reserved memory over the trace</h2>",
            "<p class=sub>After every trace entry: what the real allocator reserved, what memfit's model reserves on "
            "the same calls, and what other settings would have reserved (each from an empty cache holding the "
            "blocks live at the start: compare them with each other).</p>",
            _chart(r, variants, series), _legend(variants, series),
            "<h2>Recorded and modelled</h2>", _table(["", "recorded", "memfit"], rows)]
    d = r.first_divergence
    if d is not None:
        body.append(f'<h2 class="bad">First divergence</h2><p id="memfit-divergence">At trace entry {d.event_index}: '
                    f"the recording did <code>{_e(d.recorded)}</code>, memfit did <code>{_e(d.modelled)}</code>.</p>")
    if variants:
        base = variants[0]
        vrows = [[_e(v.settings), _e(format_bytes(v.peak_reserved_bytes)),
                  "" if v is base else _e(("+" if v.peak_reserved_bytes >= base.peak_reserved_bytes else "-")
                                          + format_bytes(abs(v.peak_reserved_bytes - base.peak_reserved_bytes))),
                  str(v.segment_allocs)] for v in variants]
        body.append("<h2>Other settings on this trace</h2>"
                    + _table(["settings", "peak reserved", "change", "cudaMalloc"], vrows, {1, 2, 3}))
    if r.notes:
        body.append("<h2>Notes</h2><ul class=notes>" + "".join(f"<li>{_e(n)}</li>" for n in r.notes) + "</ul>")
    return page(title, _CSS + _REPLAY_CSS, "".join(body), view="replay")
