"""The timeline as a static stacked area chart (matplotlib, Agg backend): PNG or SVG.

The same timeline the HTML view draws: allocated memory stacked by category, the reserved line,
the GPU's memory and what PyTorch can use (or, without a GPU, the required memory), the phases as
bands, the peak and an OOM marked (the failing request drawn on top of what was allocated then). matplotlib is the `viz` extra (`pip install 'memfit[viz]'`).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from memfit.errors import MemfitError
from memfit.report.style import PHASE_COLORS, category_color, category_label, phase_label
from memfit.report.timeline import Timeline
from memfit.units import GiB, MiB, format_bytes

if TYPE_CHECKING:
    from memfit.estimator import MemoryReport

__all__ = ["require_matplotlib", "render_plot"]

_FORMATS = {".png": "png", ".svg": "svg"}
#: PNG resolution: 1300 x 620 pixels at the figure size below.
_DPI = 100
#: A line (the GPU's memory) more than this many times the run's highest point is named, not drawn,
#: so that the run is not squashed to the bottom of the chart (the HTML view does the same).
_OFF_SCALE = 2


def require_matplotlib() -> None:
    """A one-line MemfitError when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise MemfitError("--plot needs matplotlib, which is not installed; `pip install 'memfit[viz]'` "
                          "(or matplotlib>=3.7), or write --html instead") from err


def render_plot(report: "MemoryReport", tl: Timeline, suffix: str = ".png") -> bytes:
    """The chart as PNG or SVG bytes (`suffix` `.png` or `.svg`)."""
    if suffix not in _FORMATS:
        raise MemfitError(f"`{suffix}`: --plot writes .png or .svg")
    require_matplotlib()
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    lines = []
    if report.gpu is not None:
        lines.append((report.gpu["total_bytes"], f"GPU memory ({report.gpu['name']})", "#b00020"))
        if report.capacity_bytes is not None:
            lines.append((report.capacity_bytes, "what PyTorch can use", "#e07b00"))
    if report.required_bytes is not None:
        lines.append((report.required_bytes, "required", "#6a3d9a"))
    data_top = max(max(s.allocated_bytes, s.reserved_bytes) for s in tl.samples)
    req = tl.oom_request
    if req is not None:  # the failing request on top of what was allocated when it failed
        data_top = max(data_top, tl.samples[-1].allocated_bytes + req.size_bytes)
    shown = [ln for ln in lines if ln[0] <= _OFF_SCALE * data_top]
    top = max([data_top] + [b for b, _, _ in shown])
    off_scale = [f"{ln[1]} {format_bytes(ln[0])} above the scale" for ln in lines if ln not in shown]
    unit, unit_name = (GiB, "GiB") if top >= 2 * GiB else (MiB, "MiB")
    fig = Figure(figsize=(13, 6.2), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = [s.index for s in tl.samples]
    for sp in tl.spans:
        ax.axvspan(sp.start, sp.end + 1, color=PHASE_COLORS.get(sp.phase, "#f5f5f5"), lw=0, zorder=0)
        if sp.end - sp.start > tl.num_events / 30:
            ax.text((sp.start + sp.end) / 2, 1.01, phase_label(sp.phase, sp.step), transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8, color="#555")
    ys = [[s.by_category[c] / unit for s in tl.samples] for c in tl.categories]
    ax.stackplot(x, ys, labels=[category_label(c) for c in tl.categories],
                 colors=[category_color(c, i) for i, c in enumerate(tl.categories)], alpha=0.88, zorder=2)
    ax.plot(x, [s.reserved_bytes / unit for s in tl.samples], color="#111", lw=1.3, label="reserved", zorder=3)
    last = None
    for b, label, color in sorted(shown, reverse=True):
        ax.axhline(b / unit, color=color, ls="--", lw=1.1, zorder=3)
        below = last is not None and last - b < 0.035 * top  # the label above is close: this one under its line
        ax.text(tl.num_events, b / unit, f"{label}: {format_bytes(b)} ", ha="right", va="top" if below else "bottom",
                fontsize=8, color=color)
        last = b
    peak = max(tl.samples, key=lambda s: s.allocated_bytes)
    ax.plot([peak.index], [peak.allocated_bytes / unit], "o", ms=6, mfc="white", mec="#111", zorder=4)
    right = peak.index > 0.7 * tl.num_events
    word = "highest before the OOM" if tl.oom_index is not None else "peak"
    ax.annotate(f"{word} {format_bytes(peak.allocated_bytes)} ({phase_label(peak.phase, peak.step)})",
                (peak.index, peak.allocated_bytes / unit), xytext=(-6 if right else 6, 6), textcoords="offset points",
                ha="right" if right else "left", fontsize=9, fontweight="bold")
    if tl.oom_index is not None:
        ax.axvline(tl.oom_index, color="#b00020", lw=2, zorder=4)
        if req is not None:
            base = tl.samples[-1].allocated_bytes
            ax.bar([tl.oom_index], [req.size_bytes / unit], bottom=[base / unit], width=max(tl.num_events / 150, 1),
                   color="#b00020", alpha=0.4, edgecolor="#b00020", zorder=5, label="failed request")
            ax.plot([tl.oom_index], [(base + req.size_bytes) / unit], "o", ms=6, color="#b00020", zorder=6)
            ax.annotate(f"needs {format_bytes(base + req.size_bytes)}: {format_bytes(base)} allocated + "
                        f"{format_bytes(req.size_bytes)} requested", (tl.oom_index, (base + req.size_bytes) / unit),
                        xytext=(-8, 4), textcoords="offset points", ha="right", fontsize=9, color="#b00020",
                        fontweight="bold")
        ax.text(tl.oom_index, 0.78, "out of memory ", transform=ax.get_xaxis_transform(), ha="right", va="center",
                color="#b00020", fontweight="bold", fontsize=9)
    ax.set_ylim(0, top / unit * 1.06)
    ax.set_xlim(0, max(tl.num_events, 1))
    ax.set_ylabel(f"memory ({unit_name})")
    ax.set_xlabel(f"trace event (program order of the simulated run: {tl.num_events} allocations and frees)")
    where = report.gpu["name"] if report.gpu is not None else "no GPU given"
    rank = f", rank 0 of {report.parallel.get('world_size')}" if report.parallel else ""
    scale = "".join(f"; {t}" for t in off_scale)
    ax.set_title(f"memfit estimate: {report.model} ({where}{rank}{scale})", loc="left", fontsize=11, pad=16)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=_FORMATS[suffix], metadata={"Software": None} if suffix == ".png" else {"Date": None})
    return buf.getvalue()
