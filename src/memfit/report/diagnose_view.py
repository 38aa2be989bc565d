"""A diagnosis as one self-contained HTML page: the out-of-memory message's figures as one stacked bar
of the GPU's memory (live tensors, cached but unused, private pools, outside PyTorch, other
processes, free) with the failed request drawn against the free part, then the causes (the primary
one first) and the remedies, and the plan when the diagnosis was given the run's setup.

A view of what `memfit.diagnose` read, nothing recomputed: the bar is the message's own figures
(`memfit.oom_text.OomMessage`: allocated, reserved, reserved but unallocated, total, free), and the
memory outside PyTorch is `total - free - reserved` split into other processes (the diagnosis's
`other_processes` cause: the processes the message lists, this one left out) and the rest (CUDA
context, libraries, this process outside its cache). No script.

Stable hooks: `rect[data-segment=<name>]` (`data-bytes`), `rect[data-segment=request]`,
`li.cause` (`data-kind`, `data-primary`), `ol.advice li`, `#memfit-oom-message`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.report.html import _CSS, _e, page
from memfit.report.plan_view import PLAN_CSS, plan_body
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.diagnosis.verb import Diagnosis

__all__ = ["Segment", "memory_bar", "render_diagnosis_html"]

_DIAG_CSS = """
.bar{width:100%;height:auto;display:block;font-size:12px}
li.cause.primary{font-weight:600}
.seg-label{fill:#222}
"""

#: Segment colours (Okabe & Ito 2008 as memfit.report.style, free memory light grey).
_COLORS = {"live": "#0072B2", "private_pools": "#56B4E9", "cached_unused": "#E69F00", "outside_pytorch": "#CC79A7",
           "other_processes": "#D55E00", "free": "#e6e6e6", "request": "#b00020"}
_LABELS = {"live": "live tensors", "private_pools": "private pools (CUDA graphs)", "cached_unused": "cached but unused",
           "outside_pytorch": "outside PyTorch (CUDA context, libraries)", "other_processes": "other processes",
           "free": "free", "request": "the request"}


@dataclass(frozen=True)
class Segment:
    """One part of the GPU's memory as the message gives it."""

    name: str  #: live, private_pools, cached_unused, outside_pytorch, other_processes, free
    label: str
    bytes: int


def memory_bar(d: "Diagnosis") -> tuple[list[Segment], int | None] | None:
    """The message's figures as parts of the GPU's memory (they add up to its total), and the request's bytes;
    None when the message has no device figures (a CPU, MPS or NCCL message, or an old format without them)."""
    m = d.message
    if m is None or not m.has_numbers or m.reserved_bytes is None or m.free_bytes is None:
        return None
    C, F, R = m.total_bytes, m.free_bytes, m.reserved_bytes
    if F > C:  # a free figure above the capacity measures no device (memfit.diagnosis.causes: inconsistent_free)
        return None
    A = m.allocated_bytes or 0
    U = m.reserved_unallocated_bytes if m.reserved_unallocated_bytes is not None else max(R - A, 0)
    P = m.private_pool_bytes or 0
    outside = max(C - F - R, 0)
    others = next((c.bytes for c in d.causes if c.kind == "other_processes" and c.bytes), 0)
    others = min(others, outside)
    parts = [("live", A), ("private_pools", P), ("cached_unused", U), ("outside_pytorch", outside - others),
             ("other_processes", others), ("free", F)]
    return [Segment(n, _LABELS[n], b) for n, b in parts if b > 0], m.tried_to_allocate_bytes


def _bar_svg(segments: list[Segment], request: int | None, total: int) -> str:
    W, left, right = 1100, 10, 10
    pw = W - left - right
    scale = pw / max(total, 1)
    out = []
    x = float(left)
    free_x = None
    for s in segments:
        w = s.bytes * scale
        if s.name == "free":
            free_x = x
        out.append(f'<rect x="{x:.1f}" y="30" width="{max(w, 0.5):.1f}" height="46" fill="{_COLORS[s.name]}" '
                   f'stroke="#fff" data-segment="{s.name}" data-bytes="{s.bytes}"><title>{_e(s.label)}: '
                   f"{_e(format_bytes(s.bytes))}</title></rect>")
        if w > 90:
            out.append(f'<text class="seg-label" x="{x + 5:.1f}" y="58">{_e(format_bytes(s.bytes))}</text>')
        x += w
    H = 100
    if request:
        start = free_x if free_x is not None else left + pw
        w = request * scale
        over = start + w > left + pw
        w_drawn = min(w, left + pw - start) if start < left + pw else 0
        label = f"the request: {format_bytes(request)}" + (" (more than is free)" if over else "")
        if w_drawn > 0:
            out.append(f'<rect x="{start:.1f}" y="86" width="{max(w_drawn, 1.5):.1f}" height="16" '
                       f'fill="{_COLORS["request"]}" data-segment="request" data-bytes="{request}"><title>'
                       f"{_e(label)}</title></rect>")
        else:
            out.append(f'<rect x="{left + pw - 1.5:.1f}" y="86" width="1.5" height="16" fill="{_COLORS["request"]}" '
                       f'data-segment="request" data-bytes="{request}"><title>{_e(label)}</title></rect>')
        anchor = "end" if start > left + pw * 0.6 else "start"  # the label on the side with room
        tx = start + w_drawn + 4 if anchor == "start" else start - 4
        out.append(f'<text x="{tx:.1f}" y="99" text-anchor="{anchor}" fill="#b00020">{_e(label)}</text>')
        H = 112
    out.append(f'<text x="{left}" y="20">GPU memory: {_e(format_bytes(total))}</text>')
    return (f'<svg id="memfit-diagnose-bar" class="bar" viewBox="0 0 {W} {H}" role="img" '
            f'aria-label="the GPU memory at the failure">' + "".join(out) + "</svg>")


def _legend(segments: list[Segment], request: int | None) -> str:
    items = [(s.name, f"{s.label}: {format_bytes(s.bytes)}") for s in segments]
    if request:
        items.append(("request", f"the request: {format_bytes(request)}"))
    return '<div class="legend" style="margin-left:10px">' + "".join(
        f'<span data-legend-segment="{n}"><i style="background:{_COLORS[n]}"></i>{_e(text)}</span>'
        for n, text in items) + "</div>"


def _body(d: "Diagnosis") -> str:
    from memfit.diagnosis.strings import t

    lang, m = d.lang, d.message
    if not d.is_oom or m is None:
        return "<h1>memfit diagnose</h1><p>No out-of-memory error was found in the text.</p>"
    out = [f"<h1>{_e(t('title', lang))}</h1>"]
    if d.oom_count > 1:
        out.append(f"<p class=sub>{_e(t('count', lang, count=d.oom_count))}</p>")
    out.append(f'<pre id="memfit-oom-message">{_e(m.raw)}</pre>')
    facts = [(t("label.phase", lang), t("phase." + d.phase, lang))]
    if d.operation != "unknown":
        facts.append((t("label.operation", lang), t("operation." + d.operation, lang)))
    if d.phase_frame:
        facts.append((t("label.frame", lang), d.phase_frame))
    out.append("<table class=t>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
               + "</table>")
    bar = memory_bar(d)
    if bar is not None:
        segments, request = bar
        out.append(f"<h2>{_e(t('label.numbers', lang))}</h2>{_bar_svg(segments, request, m.total_bytes)}"
                   f"{_legend(segments, request)}")
    else:
        out.append("<p class=sub>The message gives no device figures to draw.</p>")
    out.append(f"<h2>{_e(t('label.causes', lang))}</h2><ul class=causes>")
    for c in d.causes:
        tag = f' <b class="bad">({_e(t("label.primary", lang))})</b>' if c.primary else ""
        out.append(f'<li class="cause{" primary" if c.primary else ""}" data-kind="{_e(c.kind)}" '
                   f'data-primary="{str(c.primary).lower()}">{_e(c.text)}{tag}</li>')
    out.append(f"</ul><h2>{_e(t('label.advice', lang))}</h2><ol class=advice>"
               + "".join(f"<li>{_e(a)}</li>" for a in d.advice) + "</ol>")
    return "".join(out)


def render_diagnosis_html(d: "Diagnosis") -> str:
    """The whole page of a Diagnosis; with its plan (a setup was given) the plan's page follows it."""
    plan = "" if d.plan is None else f'<div id="memfit-plan">{plan_body(d.plan)}</div>'

    return page("memfit diagnose", _CSS + _DIAG_CSS + PLAN_CSS, _body(d) + plan, view="diagnose", lang=d.lang)
