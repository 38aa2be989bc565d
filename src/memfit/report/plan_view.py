"""A plan as one self-contained HTML page: every configuration the search weighed as a point (the
memory it needs on the GPU against its modelled step time), the budget as a line, the fitting ones
marked, the chosen one ringed, and its exact change (environment, TrainingArguments, code; across
GPUs the launch files and commands) ready to copy.

A view of what `memfit.plan` / `memfit.planner.parallel_plan.plan_parallel` returned, nothing
recomputed: a single-GPU plan's points are every configuration its search ranked
(`PlanResult.searched`: the fitted memory model of the partial simulations, small dots), its baseline
and `PlanResult.plans` (the verified ones and the best of the fitted model, `max_plans` of them), with
the step time relative to the setup as given; a multi-GPU plan's points are
`ParallelPlanResult.candidates` (every per-rank simulation), with the modelled seconds of one optimizer
step. No script: a point's details are its SVG `<title>`, shown on hover.

Stable hooks: `circle[data-plan]` (one per plan; `data-fits`, `data-verified`, `data-bytes`,
`data-chosen`), `circle[data-searched]` (one per searched configuration; `data-fits`, `data-bytes`),
`line[data-line=budget]`, `#memfit-change` (the change as text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.report._svg import Chart, linear_ticks
from memfit.report.html import _CSS, _card, _e, _table, page
from memfit.units import format_bytes

__all__ = ["PlanPoint", "plan_points", "change_text", "plan_body", "render_plan_html", "PLAN_CSS"]

PLAN_CSS = """
.chart{width:100%;height:auto;display:block;font-size:11px}
.pt{stroke:#333;stroke-width:1}.pt.fits{fill:#1b7f3b}.pt.nofit{fill:#fff;stroke:#b00020;stroke-width:1.6}
.pt.fitted{fill-opacity:.45}.pt.baseline{fill:#777}.ring{fill:none;stroke:#111;stroke-width:2.2}
.hline.budget{stroke:#b00020}.pt-label{fill:#333;font-size:11px}
.sp{stroke-width:.8}.sp.fits{fill:#1b7f3b;fill-opacity:.35;stroke:#1b7f3b}.sp.nofit{fill:none;stroke:#b00020;stroke-opacity:.6}
"""


@dataclass(frozen=True)
class PlanPoint:
    """One configuration of a plan as the page draws it."""

    index: int | None  #: index into the plans / candidates; None: the setup as given (a single-GPU plan)
    label: str  #: what it changes
    need_bytes: int  #: what it needs of the budget (budget less headroom): a point under the budget line fits
    device_used_bytes: int  #: what nvidia-smi would show (reserved + memory outside PyTorch; per GPU across GPUs)
    peak_reserved_bytes: int
    headroom_bytes: int  #: budget minus what it needs; negative: how far short
    step_time: float  #: relative to the setup as given (single GPU) or seconds per optimizer step (across GPUs)
    fits: bool
    verified: bool  #: a full simulation with the allocator replay (else the search's fitted memory model)
    chosen: bool


def _changes_label(changes: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in changes.items()]
    return ", ".join(parts) or "(as is)"


def _is_parallel(result: Any) -> bool:
    return hasattr(result, "candidates")


def plan_points(result: Any) -> list[PlanPoint]:
    """The points of a PlanResult (the baseline first) or of a ParallelPlanResult (its candidates)."""
    if _is_parallel(result):
        return [PlanPoint(i, f"{c.strategy}: {_changes_label(c.setup_changes)}",
                          result.budget_bytes - c.headroom_bytes, c.device_used_bytes,
                          c.peak_reserved_bytes, c.headroom_bytes, c.step.total_s, c.fits, True, i == result.chosen)
                for i, c in enumerate(result.candidates)]
    b = result.baseline
    budget = result.budget_bytes
    out = [PlanPoint(None, "as is", budget - b.headroom_bytes, b.device_used_bytes, b.peak_reserved_bytes, b.headroom_bytes,
                     b.relative_step_time, b.fits, b.verified, False)]
    out += [PlanPoint(i, _changes_label(p.setup_changes), budget - p.headroom_bytes, p.device_used_bytes, p.peak_reserved_bytes,
                      p.headroom_bytes, p.relative_step_time, p.fits, p.verified, i == result.chosen)
            for i, p in enumerate(result.plans)]
    return out


def change_text(result: Any) -> str | None:
    """The chosen configuration's change, as `memfit plan` prints it: environment, TrainingArguments, code (and
    across GPUs the launch files and commands); None when nothing fits."""
    if result.chosen is None:
        return None
    if _is_parallel(result):
        L = result.launch
        if L is None:
            return None
        lines: list[str] = []
        for name, text in L.files.items():
            lines += [f"# {name}", text.rstrip()]
        lines += [f"export {k}={v}" for k, v in L.env.items()]
        lines.append("TrainingArguments(..., " + ", ".join(f"{k}={v!r}" for k, v in L.training_args.items()) + ")")
        return "\n".join(lines + list(L.code) + list(L.commands))
    p = result.plans[result.chosen]
    lines = [f"export {k}={v}" for k, v in p.env.items()]
    if p.changes:  # GRPO / RLOO plans change GRPOConfig / RLOOConfig (PlanResult.config_class)
        config = getattr(result, "config_class", "TrainingArguments")
        lines.append(f"{config}(..., " + ", ".join(f"{k}={v!r}" for k, v in p.changes.items()) + ")")
    return "\n".join(lines + list(p.code))


def _searched(result: Any) -> list[Any]:
    """A single-GPU plan's searched configurations (memfit.planner.search.SearchedCandidate), best first."""
    return list(getattr(result, "searched", None) or [])


def _chart(result: Any, points: list[PlanPoint], parallel: bool) -> str:
    budget = result.budget_bytes
    searched = _searched(result)
    ymax = max([p.need_bytes for p in points] + [c.need_bytes for c in searched] + [budget]) * 1.08
    xs = [p.step_time for p in points] + [c.relative_step_time for c in searched]
    lo, hi = min(xs), max(xs)
    pad = (hi - lo) * 0.08 or max(hi * 0.1, 0.05)
    c = Chart(max(lo - pad, 0), hi + pad, ymax)
    fmt = "{:g} s" if parallel else "{:g}x"
    c.axes(linear_ticks(c.x0, c.x1, fmt),
           "modelled time of one optimizer step" + (" (seconds)" if parallel else " (relative to the setup as given)"))
    c.hline(budget, f"budget {format_bytes(budget)} ({result.margin:.0%} of the GPU kept free)", "budget",
            f'data-line="budget" data-bytes="{budget}"')
    for i, sc in enumerate(searched):  # underneath the plans: every configuration the search ranked
        title = (f"searched: {_changes_label(sc.setup_changes)}\nneeds {format_bytes(sc.need_bytes)} by the fitted "
                 f"memory model; step time {sc.relative_step_time:g}x; {'fits' if sc.fits else 'does not fit'}")
        c.point(sc.relative_step_time, sc.need_bytes, 3, "sp " + ("fits" if sc.fits else "nofit"), title,
                f'data-searched="{i}" data-fits="{str(sc.fits).lower()}" data-bytes="{sc.need_bytes}"')
    for p in points:
        cls = "pt " + ("fits" if p.fits else "nofit") + ("" if p.verified else " fitted") + (
            " baseline" if p.index is None else "")
        how = "verified by simulation" if p.verified else "memory from the search's fitted model"
        title = (f"{'as is' if p.index is None else f'plan {p.index}'}: {p.label}\n"
                 f"needs {format_bytes(p.need_bytes)} of the budget; nvidia-smi would show "
                 f"{format_bytes(p.device_used_bytes)}; peak reserved "
                 f"{format_bytes(p.peak_reserved_bytes)}; headroom {format_bytes(p.headroom_bytes)}\n"
                 f"step time {fmt.format(round(p.step_time, 3))}; {'fits' if p.fits else 'does not fit'} ({how})")
        attrs = (f'data-plan="{"baseline" if p.index is None else p.index}" data-fits="{str(p.fits).lower()}" '
                 f'data-verified="{str(p.verified).lower()}" data-bytes="{p.need_bytes}" '
                 f'data-chosen="{str(p.chosen).lower()}"')
        c.point(p.step_time, p.need_bytes, 6, cls, title, attrs)
        if p.chosen:
            c.point(p.step_time, p.need_bytes, 11, "ring", title, 'data-marker="chosen"')
            c.text(p.step_time, p.need_bytes, "chosen", "pt-label", "start", -14)
        elif p.index is None:
            c.text(p.step_time, p.need_bytes, "as is", "pt-label", "start", -10)
    return c.svg("memfit-plan-chart", "plans: memory against step time")


def _title(result: Any) -> str:
    if _is_parallel(result):
        return f"memfit plan: {result.world_size} x {result.gpu['name']}"
    return f"memfit plan: {result.gpu['name']}"


def _summary(result: Any, points: list[PlanPoint]) -> str:
    parallel = _is_parallel(result)
    chosen = next((p for p in points if p.chosen), None)
    cards = [_card("GPU", result.gpu["name"], format_bytes(result.gpu["total_bytes"])),
             _card("budget", format_bytes(result.budget_bytes), f"{result.margin:.0%} of the GPU kept free")]
    if not parallel:
        b = points[0]
        cards.append(_card("as is", "fits" if b.fits else "does not fit",
                           f"needs {format_bytes(b.need_bytes)}", "good" if b.fits else "bad"))
    if chosen is not None:
        cards.append(_card("chosen", f"plan {chosen.index}", chosen.label, "good"))
    else:
        cards.append(_card("chosen", "nothing fits" if not (not parallel and points[0].fits) else "as is",
                           "", "bad" if parallel or not points[0].fits else "good"))
    searched = _searched(result)
    if searched:
        cards.append(_card("configurations weighed", str(len(searched)),
                           f"{sum(c.fits for c in searched)} fit by the fitted model"))
    cards.append(_card("simulations", str(result.simulations), f"in {result.elapsed_s:.1f} s"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _rows(points: list[PlanPoint], parallel: bool) -> str:
    rows = []
    for p in points:
        name = "as is" if p.index is None else f"{'&gt; ' if p.chosen else ''}{p.index}"
        step = f"{p.step_time * 1e3:.1f} ms" if parallel else f"{p.step_time:.2f}x"
        rows.append([name, _e(p.label), _e(format_bytes(p.need_bytes)), _e(format_bytes(p.device_used_bytes)),
                     _e(format_bytes(p.headroom_bytes)), step, "yes" if p.fits else "no",
                     "simulated" if p.verified else "fitted model"])
    return _table(["#", "changes", "needs", "nvidia-smi", "headroom", "step", "fits", "memory from"], rows,
                  {2, 3, 4, 5})


def plan_body(result: Any) -> str:
    """The page's body of a PlanResult or a ParallelPlanResult (the diagnose page shows it too)."""
    parallel = _is_parallel(result)
    points = plan_points(result)
    change = change_text(result)
    intro = ("Each point is one configuration: the memory it needs of the budget (the budget less its headroom, "
             "as the search compares them) against its modelled step time. "
             "Filled green: fits the budget; open red: does not; pale: memory from the search's fitted model "
             "rather than a full simulation. Hover a point for its figures.")
    if _searched(result):
        intro += (f" Small dots: all {len(_searched(result))} configurations the search ranked, as the memory model "
                  f"fitted to its {result.simulations} simulations predicts them; large ones: the plans it returned.")
    if parallel:
        intro += f" Per GPU, as rank 0's simulation gives it; global batch {result.global_batch}."
    body = [f"<h1>{_e(_title(result))}</h1>", _summary(result, points), "<h2>Configurations</h2>",
            f"<p class=sub>{_e(intro)}</p>", _chart(result, points, parallel), _rows(points, parallel)]
    if change is not None:
        body.append("<h2>The change</h2><p class=sub>Copy this into the training script or the shell:</p>"
                    f'<pre id="memfit-change">{_e(change)}</pre>')
    elif parallel or not points[0].fits:
        body.append('<h2 class="bad">Nothing fits</h2>')
        if not parallel:
            body.append(f"<p>The closest plan misses by {_e(format_bytes(result.miss_bytes or 0))}.</p><ul>"
                        + "".join(f"<li>{_e(s)}</li>" for s in result.suggestions) + "</ul>")
    else:
        body.append("<p>The setup fits as it is and no faster configuration fits.</p>")
    notes = list(getattr(result, "notes", []) or [])
    notes += [f"not applicable: {k}: {v}" for k, v in (getattr(result, "not_applicable", None) or {}).items()]
    if notes:
        body.append("<h2>Notes</h2><ul class=notes>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    return "".join(body)


def render_plan_html(result: Any) -> str:
    """The whole page of a PlanResult or a ParallelPlanResult."""
    return page(_title(result), _CSS + PLAN_CSS, plan_body(result), view="plan")
