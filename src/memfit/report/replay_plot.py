"""A snapshot replay as a static picture (matplotlib, Agg backend): PNG or SVG, for papers and issues.

The lines of the HTML replay view (memfit.report.replay_view): the reserved memory the recording shows and the one
memfit's allocator model gives after every trace entry, the first divergence marked, and what other allocator
settings would have reserved on the same trace. Lines longer than `replay_view.MAX_POINTS` are downsampled the
same way (each bucket's lowest and highest value: the peaks stay). matplotlib is the `viz` extra.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memfit.errors import MemfitError
from memfit.report.plot import require_matplotlib
from memfit.report.replay_view import WHAT_IF_COLORS, downsample
from memfit.units import GiB, MiB, format_bytes

if TYPE_CHECKING:
    from memfit.allocator.snapshot import SnapshotReplay, WhatIf

__all__ = ["render_replay_plot"]

_FORMATS = {".png": "png", ".svg": "svg"}
_DPI = 100  #: 1300 x 620 pixels at the figure size below, as memfit.report.plot


def render_replay_plot(path: str, device: int, r: "SnapshotReplay", variants: Sequence["WhatIf"],
                       series: Sequence[Sequence[int] | None] = (), suffix: str = ".png") -> bytes:
    """The picture of a replay of `path` (device `device`) as PNG or SVG bytes; `series[i]` the reserved bytes after
    every entry of `variants[i]` (as memfit.report.replay_view.render_replay_html takes them)."""
    if suffix not in _FORMATS:
        raise MemfitError(f"`{suffix}`: --plot writes .png or .svg")
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = [("recorded (the real allocator)", r.recorded_reserved_bytes, "#111111", "-", 2.2),
             ("memfit's model of the recorded settings", r.modelled_reserved_bytes, "#0072B2", "--", 1.5)]
    k = 0
    for v, s in zip(variants, series):
        if s:
            lines.append((f"what if: {v.settings}", s, WHAT_IF_COLORS[k % len(WHAT_IF_COLORS)], "-", 1.2))
            k += 1
    top = max((max(vals) for _, vals, _, _, _ in lines if vals), default=1)
    unit, unit_name = (GiB, "GiB") if top >= 2 * GiB else (MiB, "MiB")
    fig = Figure(figsize=(13, 6.2), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, vals, color, style, width in lines:
        if not vals:
            continue
        pts = downsample(vals)
        ax.plot([i for i, _ in pts], [b / unit for _, b in pts], color=color, ls=style, lw=width,
                label=f"{label}: peak {format_bytes(max(vals))}")
    d = r.first_divergence
    if d is not None:
        ax.axvline(d.event_index, color="#b00020", lw=1.5, ls=":")
        ax.text(d.event_index, 0.97, f" first divergence: entry {d.event_index} ", transform=ax.get_xaxis_transform(),
                ha="right" if d.event_index > 0.6 * max(r.num_entries, 1) else "left", va="top", color="#b00020",
                fontweight="bold", fontsize=9)
    ax.set_xlim(0, max(r.num_entries - 1, 1))
    ax.set_ylim(0, top / unit * 1.08)
    ax.set_ylabel(f"reserved memory ({unit_name})")
    ax.set_xlabel(f"trace entry ({r.num_entries} allocator events in the recording)")
    verdict = "replayed exactly" if r.exact else "diverges"
    ax.set_title(f"memfit replay: {path} (device {device}, {verdict})", loc="left", fontsize=11)
    # the what-ifs start from an empty cache holding the blocks live at the start (memfit.allocator.snapshot.what_if)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9,
              title="what-ifs: each from an empty cache holding the blocks live at the start", title_fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=_FORMATS[suffix], metadata={"Software": None} if suffix == ".png" else {"Date": None})
    return buf.getvalue()
