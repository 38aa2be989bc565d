"""Static SVG charts the plan, diagnose and replay pages inline: drawn here in Python, so these pages
need no script at all (hovering a point shows its SVG `<title>`, which every browser renders).

One chart area with a byte axis (binary units, about six gridlines, as the timeline's script draws
it) and a linear or byte x axis; callers add points, lines and bars in data units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memfit.report.html import _e
from memfit.units import format_bytes

__all__ = ["Chart", "byte_ticks", "linear_ticks"]


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5, 10 times a power of ten at or above `raw`."""
    mag = 10 ** math.floor(math.log10(raw))
    return next(f * mag for f in (1, 2, 2.5, 5, 10) if f * mag >= raw)


def byte_ticks(vmax: float) -> list[tuple[float, str]]:
    """Gridlines for 0..vmax bytes in GiB, MiB or KiB steps (as memfit.report._chart's y axis)."""
    unit = 1024 ** 3 if vmax >= 2 * 1024 ** 3 else 1024 ** 2 if vmax >= 2 * 1024 ** 2 else 1024
    step = _nice_step(max(vmax / unit / 6, 1e-9))
    out, v = [], 0.0
    while v <= vmax / unit + 1e-9:
        out.append((v * unit, format_bytes(v * unit).replace(".00", "")))
        v += step
    return out


def linear_ticks(vmin: float, vmax: float, fmt: str = "{:g}") -> list[tuple[float, str]]:
    step = _nice_step(max((vmax - vmin) / 6, 1e-12))
    v = math.floor(vmin / step) * step
    out = []
    while v <= vmax + 1e-12:
        if v >= vmin - 1e-12:
            out.append((v, fmt.format(round(v, 10))))
        v += step
    return out


@dataclass
class Chart:
    """An SVG chart of `width` x `height` user units; x in [x0, x1], y (bytes) in [0, y1]."""

    x0: float
    x1: float
    y1: float
    width: int = 1100
    height: int = 440
    left: int = 84
    right: int = 24
    top: int = 28
    bottom: int = 48
    parts: list[str] = field(default_factory=list)

    def X(self, x: float) -> float:
        span = (self.x1 - self.x0) or 1
        return self.left + (self.width - self.left - self.right) * (x - self.x0) / span

    def Y(self, y: float) -> float:
        ph = self.height - self.top - self.bottom
        return self.top + ph - ph * y / (self.y1 or 1)

    def axes(self, x_ticks: list[tuple[float, str]], x_label: str, y_label: str = "") -> None:
        r, b = self.width - self.right, self.height - self.bottom
        for v, label in byte_ticks(self.y1):
            y = self.Y(v)
            self.parts.append(f'<line class="grid" x1="{self.left}" x2="{r}" y1="{y:.1f}" y2="{y:.1f}"/>'
                              f'<text x="{self.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(label)}</text>')
        for v, label in x_ticks:
            x = self.X(v)
            self.parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{self.top}" y2="{b}"/>'
                              f'<text x="{x:.1f}" y="{b + 16}" text-anchor="middle">{_e(label)}</text>')
        self.parts.append(f'<line class="frame" x1="{self.left}" x2="{r}" y1="{b}" y2="{b}"/>'
                          f'<line class="frame" x1="{self.left}" x2="{self.left}" y1="{self.top}" y2="{b}"/>'
                          f'<text x="{(self.left + r) / 2:.1f}" y="{self.height - 8}" text-anchor="middle">'
                          f"{_e(x_label)}</text>")
        if y_label:
            self.parts.append(f'<text x="14" y="{self.top + (b - self.top) / 2:.1f}" text-anchor="middle" '
                              f'transform="rotate(-90 14 {self.top + (b - self.top) / 2:.1f})">{_e(y_label)}</text>')

    def hline(self, y: float, label: str, cls: str, attrs: str = "") -> None:
        yy = self.Y(y)
        r = self.width - self.right
        self.parts.append(f'<line class="hline {cls}" x1="{self.left}" x2="{r}" y1="{yy:.1f}" y2="{yy:.1f}" {attrs}/>'
                          f'<text class="hline-label" x="{r - 4}" y="{yy - 5:.1f}" text-anchor="end">{_e(label)}</text>')

    def polyline(self, points: list[tuple[float, float]], cls: str, attrs: str = "", title: str = "") -> None:
        d = "M" + "L".join(f"{self.X(x):.2f},{self.Y(y):.2f}" for x, y in points)
        t = f"<title>{_e(title)}</title>" if title else ""
        self.parts.append(f'<path class="{cls}" d="{d}" {attrs}>{t}</path>')

    def point(self, x: float, y: float, r: float, cls: str, title: str, attrs: str = "") -> None:
        self.parts.append(f'<circle class="{cls}" cx="{self.X(x):.1f}" cy="{self.Y(y):.1f}" r="{r}" {attrs}>'
                          f"<title>{_e(title)}</title></circle>")

    def text(self, x: float, y: float, label: str, cls: str = "", anchor: str = "start", dy: float = 0) -> None:
        self.parts.append(f'<text class="{cls}" x="{self.X(x):.1f}" y="{self.Y(y) + dy:.1f}" '
                          f'text-anchor="{anchor}">{_e(label)}</text>')

    def svg(self, element_id: str, label: str) -> str:
        return (f'<svg id="{element_id}" class="chart" viewBox="0 0 {self.width} {self.height}" role="img" '
                f'aria-label="{_e(label)}">' + "".join(self.parts) + "</svg>")
