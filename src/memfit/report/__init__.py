"""memfit's own views of an estimate: the memory timeline (`timeline`), one self-contained
interactive HTML file (`html`) and a static stacked area chart (`plot`, matplotlib).

The views only show what `memfit.estimate` computed: the trace it simulated, replayed with the
allocator settings and capacity of its own replay (memfit.report.timeline). They need the
report's trace, so an estimate read from memfit's cache (which keeps no trace) cannot be drawn:
estimate with `cache=False` (the CLI's `--no-cache`).

The CLI's `--html FILE` / `--plot FILE`: `check_view_paths` before the simulation (a bad path
fails at once), `write_views` after it. The other verbs' pages (`plan_view`, `diagnose_view`,
`replay_view`: the plan's configurations, the OOM message's memory bar, a snapshot replay's reserved
lines) are written with `check_html_path` before the work and `write_html` after it; a replay's `--plot`
(`replay_plot`) with `check_view_paths` and `write_file`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import MemfitError
from memfit.report.timeline import Timeline, report_timeline

if TYPE_CHECKING:
    from memfit.estimator import MemoryReport

__all__ = ["report_timeline", "timeline_frame", "check_view_paths", "write_views", "check_html_path", "write_html",
           "write_file", "HTML_SUFFIXES", "PLOT_SUFFIXES"]

HTML_SUFFIXES = (".html", ".htm")
PLOT_SUFFIXES = (".png", ".svg")


def timeline_frame(tl: Timeline) -> Any:
    """The samples as a pandas DataFrame: index, phase, step, allocated_bytes, reserved_bytes and one
    `<category>_bytes` column per category."""
    try:
        import pandas as pd
    except ImportError as err:
        raise MemfitError("timeline(as_frame=True) needs pandas, which is not installed; `pip install pandas` "
                          "or call timeline() for a list of samples") from err
    rows = [{"index": s.index, "phase": s.phase, "step": s.step, "allocated_bytes": s.allocated_bytes,
             "reserved_bytes": s.reserved_bytes, **{f"{c}_bytes": s.by_category[c] for c in tl.categories}}
            for s in tl.samples]
    return pd.DataFrame(rows)


def _check(path: Any, flag: str, suffixes: tuple[str, ...], writes: str) -> Path:
    p = Path(path)
    if p.suffix.lower() not in suffixes:
        raise MemfitError(f"`{path}`: {flag} writes {writes}; give a file name such as `memfit{suffixes[0]}`")
    if p.is_dir():
        raise MemfitError(f"`{path}` is a directory; {flag} needs a file name such as `{p}/memfit{suffixes[0]}`")
    if not p.parent.exists():
        raise MemfitError(f"the directory of `{path}` does not exist; create `{p.parent}` first ({flag})")
    return p


def check_view_paths(html_path: Any = None, plot_path: Any = None) -> None:
    """One-line MemfitError unless the views can be written there (call before the simulation)."""
    if html_path is not None:
        _check(html_path, "--html", HTML_SUFFIXES, ".html")
    if plot_path is not None:
        _check(plot_path, "--plot", PLOT_SUFFIXES, ".png or .svg")
        from memfit.report.plot import require_matplotlib

        require_matplotlib()


def check_html_path(path: Any) -> Path:
    """One-line MemfitError unless an HTML page can be written to `path` (call before the work)."""
    return _check(path, "--html", HTML_SUFFIXES, ".html")


def write_html(path: Any, page: str) -> str:
    """Write `page` (one of the views' `render_*_html`) to `path`; the path written."""
    return _write(check_html_path(path), page.encode("utf-8"), "--html")


def write_views(report: "MemoryReport", html_path: Any = None, plot_path: Any = None) -> list[str]:
    """Write the HTML report and/or the plot of `report`; the paths written, in that order.

    Raises a one-line MemfitError for a bad path or extension, a report without a trace, or a plot
    without matplotlib."""
    check_view_paths(html_path, plot_path)
    if html_path is None and plot_path is None:
        return []
    tl = report_timeline(report)
    written = []
    if html_path is not None:
        from memfit.report.html import render_html

        written.append(_write(Path(html_path), render_html(report, tl).encode("utf-8"), "--html"))
    if plot_path is not None:
        from memfit.report.plot import render_plot

        written.append(_write(Path(plot_path), render_plot(report, tl, Path(plot_path).suffix.lower()), "--plot"))
    return written


def write_file(path: Any, data: bytes, flag: str) -> str:
    """Write a view's bytes (a `--plot` picture) to `path`, checked as `check_view_paths` checks `flag`'s
    paths; the path written."""
    if flag == "--plot":
        _check(path, flag, PLOT_SUFFIXES, ".png or .svg")
    else:
        check_html_path(path)
    return _write(Path(path), data, flag)


def _write(path: Path, data: bytes, flag: str) -> str:
    try:
        path.write_bytes(data)
    except OSError as err:
        raise MemfitError(f"cannot write `{path}` ({err.strerror}); choose a writable path for {flag}") from err
    return str(path)
