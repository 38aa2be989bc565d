"""The estimate as one self-contained interactive HTML file.

Works offline and makes no network request of any kind: the data (a JSON script,
`<script id="memfit-data" type="application/json">`) and the charting code (memfit.report._chart,
hand-written JavaScript drawing SVG) are inline, the styles too; no font, image or script is
referenced. The page: the memory timeline (allocated stacked by category, the reserved line, the
GPU's memory and what PyTorch can use, the phases as bands, the peak and an OOM marked; hovering a
point lists the largest live tensors: size, category, module, shape, dtype), then the breakdown at the peak,
per-phase peaks, what `nvidia-smi` would show, the steady state of a long run, the allocator what-ifs (the trace
replayed with other PYTORCH_CUDA_ALLOC_CONF settings), the OOM message and the report's notes.

Stable hooks for tests and tools: `path[data-category=<category>]` (one per category),
`path[data-series=reserved]`, `line[data-line=gpu-total|pytorch-capacity|required]`,
`#memfit-what-ifs` (one row per setting), `[data-marker=peak]` (its `data-bytes`), `[data-marker=oom]`, `[data-marker=oom-request]` (the failing request on
top of what was allocated: `data-bytes` their sum, `data-request-bytes`), `#memfit-tooltip` (rows `tr.tensor`, and
at the OOM `tr.request`). The main timeline is rank 0's (its data's `ranks`: the ranks it stands for); a multi-GPU
run whose ranks differ (ZeRO-2's gradient partitions) has one more timeline per other group of ranks, drawn by the
same script: `[data-rank-timeline]` boxes (`data-ranks`) in `#memfit-per-rank`, each with its own svg, tooltip and
`script.memfit-rank-data` JSON.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from memfit.errors import MemfitError
from memfit.report._chart import CHART_JS
from memfit.report.style import PHASE_COLORS, category_color, category_label
from memfit.report.timeline import DEFAULT_MAX_SAMPLES, Timeline, report_timeline, timeline
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.estimator import MemoryReport

__all__ = ["render_html", "timeline_data", "timeline_ranks", "rank_timelines", "notebook_html", "page", "DATA_SCHEMA"]

DATA_SCHEMA = "memfit.report.timeline/1"

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;margin:24px auto;max-width:1180px;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
.sub{color:#555;margin:0 0 14px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:17px}.card span{color:#666;font-size:12px}
.bad{color:#b00020}.good{color:#1b7f3b}
#memfit-chart-wrap,.chart-wrap{position:relative}
#memfit-chart,.chart{width:100%;height:auto;display:block;font-size:11px}
.grid{stroke:#e3e3e3}.frame{stroke:#888}
.band-label{fill:#555;font-size:11px}
.reserved{fill:none;stroke:#111;stroke-width:1.6}
.hline{stroke-width:1.3;stroke-dasharray:6 4}
.hline.gpu-total{stroke:#b00020}.hline.pytorch-capacity{stroke:#e07b00}.hline.required{stroke:#6a3d9a}
.hline-label{fill:#333;font-size:11px}
.peak{fill:#fff;stroke:#111;stroke-width:2;pointer-events:none}
.peak-label{font-weight:600;fill:#111;paint-order:stroke;stroke:#fff;stroke-width:3px}
.oom{stroke:#b00020;stroke-width:2}.oom-label{fill:#b00020;font-weight:600;paint-order:stroke;stroke:#fff;stroke-width:3px}
.oom-request{fill:#b00020;fill-opacity:.35;stroke:#b00020;stroke-width:1.5;stroke-dasharray:4 2}
.oom-point{fill:#b00020;stroke:#fff;stroke-width:1.5;pointer-events:none}
#memfit-tooltip tr.request td,.tooltip tr.request td{color:#b00020;font-weight:600}
.cursor{stroke:#333;stroke-dasharray:2 2;pointer-events:none}.cursor-dot{fill:#111;pointer-events:none}
#memfit-tooltip,.tooltip{position:absolute;display:none;background:#fff;border:1px solid #999;border-radius:4px;
box-shadow:0 2px 8px rgba(0,0,0,.2);padding:6px 8px;font-size:12px;pointer-events:none;max-width:640px;z-index:2}
#memfit-tooltip table,.tooltip table{border-collapse:collapse;margin-top:4px}
#memfit-tooltip td,#memfit-tooltip th,.tooltip td,.tooltip th{padding:1px 6px;text-align:left;white-space:nowrap}
h3{font-size:14px;margin:20px 0 6px}
.tt-head{font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:6px 0 0 80px;font-size:13px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:5px;vertical-align:-1px}
table.t{border-collapse:collapse;margin:4px 0}
table.t td,table.t th{border-bottom:1px solid #eee;padding:3px 12px 3px 0;text-align:left}
.num{text-align:right!important;font-variant-numeric:tabular-nums}
pre{background:#f7f7f7;border:1px solid #ddd;padding:10px;white-space:pre-wrap}
ul.notes li{margin:3px 0}
"""


def _json_script(data: Any) -> str:
    """JSON safe inside a <script> element: `<`, `>` and `&` escaped (they occur only in strings)."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _lines(report: "MemoryReport", *, required: bool = True) -> list[dict[str, Any]]:
    out = []
    if report.gpu is not None:
        out.append({"id": "gpu-total", "label": f"GPU memory ({report.gpu['name']})",
                    "bytes": report.gpu["total_bytes"]})
        if report.capacity_bytes is not None:
            out.append({"id": "pytorch-capacity", "label": "what PyTorch can use", "bytes": report.capacity_bytes})
    if required and report.required_bytes is not None:
        out.append({"id": "required", "label": "required (smallest memory PyTorch needs)",
                    "bytes": report.required_bytes})
    return out


def timeline_ranks(report: "MemoryReport") -> list[int]:
    """The ranks the report's own timeline (rank 0's trace) stands for: every rank where they hold the same
    (memfit.estimator: `parallel.ranks_alike`), rank 0's group where ZeRO-2's gradient partitions differ, rank 0
    alone otherwise."""
    p = report.parallel
    if not p:
        return [0]
    for group in p.get("ranks") or []:
        if 0 in group["ranks"]:
            return list(group["ranks"])
    return list(range(p.get("world_size", 1))) if p.get("ranks_alike") else [0]


def timeline_data(report: "MemoryReport", tl: Timeline, ranks: list[int] | None = None) -> dict[str, Any]:
    """What the page's script draws (the `memfit-data` JSON). `ranks`: the group of ranks of a timeline of another
    trace than the report's own (`MemoryReport.rank_traces`): its peaks are its own, the OOM only where its replay
    runs out (the report's message is rank 0's) and no `required` line (the report's is rank 0's)."""
    own = ranks is None
    tensors: dict[str, dict[str, Any]] = {}
    samples = []
    for s in tl.samples:
        for t in s.top:
            if str(t.id) not in tensors:
                tensors[str(t.id)] = {"size_bytes": t.size_bytes, "category": t.category, "module": t.module,
                                      "phase": t.phase, "shape": None if t.shape is None else list(t.shape),
                                      "dtype": t.dtype}
        samples.append({"index": s.index, "phase": s.phase, "step": s.step, "allocated_bytes": s.allocated_bytes,
                        "reserved_bytes": s.reserved_bytes,
                        "by_category": {c: b for c, b in s.by_category.items() if b},
                        "top": [t.id for t in s.top]})
    oom = None
    if (own and report.oom is not None) or tl.oom_index is not None:
        o = report.oom if own else None
        oom = {"index": tl.oom_index, "phase": o.phase if o else tl.spans[-1].phase,
               "step": o.step if o else tl.spans[-1].step, "message": o.message if o else None, "request": None}
        r = tl.oom_request
        if r is not None:  # the failing request, drawn on top of what was allocated when it failed
            oom["request"] = {"size_bytes": r.size_bytes, "category": r.category, "module": r.module,
                              "phase": r.phase, "shape": None if r.shape is None else list(r.shape), "dtype": r.dtype,
                              "allocated_bytes": tl.samples[-1].allocated_bytes,
                              # the message's "Tried to allocate": the segment the allocator asked the driver for
                              "tried_bytes": o.tried_to_allocate_bytes if o else None,
                              "total_bytes": tl.samples[-1].allocated_bytes + r.size_bytes}
    parallel = report.parallel or {}
    return {
        "schema": DATA_SCHEMA,
        "model": report.model,
        "rank": parallel.get("rank", 0) if own else ranks[0],
        "ranks": timeline_ranks(report) if own else list(ranks),
        "world_size": parallel.get("world_size", 1),
        "peak_allocated_bytes": report.peak_allocated_bytes if own else tl.peak_allocated_bytes,
        "peak_reserved_bytes": report.peak_reserved_bytes if own else tl.peak_reserved_bytes,
        "peak_index": tl.peak_index,
        "num_events": tl.num_events,
        "replay_capacity_bytes": tl.replay_capacity_bytes,
        "categories": list(tl.categories),
        "colors": {c: category_color(c, i) for i, c in enumerate(tl.categories)},
        "labels": {c: category_label(c) for c in tl.categories},
        "phase_colors": PHASE_COLORS,
        "lines": _lines(report, required=own),
        "spans": [{"phase": sp.phase, "step": sp.step, "start": sp.start, "end": sp.end} for sp in tl.spans],
        "oom": oom,
        "samples": samples,
        "tensors": tensors,
    }


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def page(title: str, css: str, body: str, *, view: str | None = None, lang: str = "en") -> str:
    """A whole self-contained page: the document shell every view of memfit.report shares."""
    view_attr = f' data-view="{view}"' if view else ""
    return ("<!DOCTYPE html>\n<html lang=" + _e(lang) + "><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width,initial-scale=1">'
            f"<title>{_e(title)}</title><style>{css}</style></head>"
            f"<body{view_attr}>{body}</body></html>\n")


def _card(label: str, value: str, note: str = "", cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<div class="card"><span>{_e(label)}</span><b{c}>{_e(value)}</b><span>{_e(note)}</span></div>'


def _summary(report: "MemoryReport") -> str:
    oom_in_trace = report.oom is not None and report.oom.step in (None, 1, 2)
    cards = [
        _card("peak allocated", format_bytes(report.peak_allocated_bytes),
              f"in {report.peak_phase}" + (", with memory enough to get there" if oom_in_trace else "")),
        _card("peak reserved", format_bytes(report.peak_reserved_bytes), "caching-allocator model"),
    ]
    if report.gpu is not None:
        cards.append(_card("nvidia-smi would show", format_bytes(report.device_used_bytes),
                           f"of {format_bytes(report.gpu['total_bytes'])} ({report.gpu['name']})"))
        fits = "fits" if report.fits else "does not fit"
        head = report.headroom_bytes
        note = (f"{format_bytes(head)} spare" if head is not None and head >= 0
                else f"{format_bytes(report.shortfall_bytes or 0)} short")
        cards.append(_card("on this GPU", fits, note, "good" if report.fits else "bad"))
    if report.required_bytes is not None:
        cards.append(_card("required", format_bytes(report.required_bytes), "smallest memory PyTorch needs"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _table(head: list[str], rows: list[list[str]], num_cols: set[int] = frozenset({1, 2})) -> str:
    th = "".join(f'<th{" class=num" if i in num_cols else ""}>{_e(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in num_cols else ""}>{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f'<table class="t"><tr>{th}</tr>{body}</table>'


def _breakdown(report: "MemoryReport", tl: Timeline | None) -> str:
    cats = list(tl.categories) if tl is not None else list(report.breakdown)
    total = report.peak_allocated_bytes or 1
    rows = []
    for i, (cat, b) in enumerate(report.breakdown.items()):
        if not b:
            continue
        pos = cats.index(cat) if cat in cats else i
        sw = f'<i style="display:inline-block;width:10px;height:10px;background:{category_color(cat, pos)}"></i> '
        rows.append([sw + _e(category_label(cat)), _e(format_bytes(b)), f"{100 * b / total:.1f}%"])
    rows.append(["<b>total</b>", f"<b>{_e(format_bytes(report.peak_allocated_bytes))}</b>", ""])
    return (f"<h2>At the peak ({_e(report.peak_phase)})</h2>" + _table(["category", "bytes", "share"], rows))


def _phases(report: "MemoryReport") -> str:
    rows = []
    for phase, b in report.phases.items():
        res = report.reserved_by_phase.get(phase)
        rows.append([_e(phase), _e(format_bytes(b)), "not reached" if res is None else _e(format_bytes(res))])
    return "<h2>Peak per phase</h2>" + _table(["phase", "allocated", "reserved"], rows)


def _device(report: "MemoryReport") -> str:
    rows = [
        ["reserved by PyTorch's allocator at its peak", _e(format_bytes(report.peak_reserved_bytes))],
        ["outside PyTorch (CUDA context, kernels, libraries)", _e(format_bytes(report.non_pytorch_bytes))],
        ["<b>what nvidia-smi would show</b>", f"<b>{_e(format_bytes(report.device_used_bytes))}</b>"],
        ["reserved at the allocated peak", _e(format_bytes(report.reserved_at_peak_allocated_bytes))],
        ["fragmentation at the reserved peak", _e(format_bytes(report.fragmentation_at_peak_bytes))],
    ]
    if report.paged_bytes:
        rows.append(["paged optimizer state (CUDA managed memory, in no figure above)",
                     _e(format_bytes(report.paged_bytes))])
    if report.parallel:
        p = report.parallel
        for key, label in (("nvidia_smi_per_gpu_bytes", "nvidia-smi per GPU"), ("nccl_bytes", "NCCL buffers"),
                           ("host_bytes_per_rank", "host memory per rank"),
                           ("host_bytes_per_node", "host memory per node")):
            if isinstance(p.get(key), int):
                rows.append([_e(label), _e(format_bytes(p[key]))])
    out = "<h2>What nvidia-smi would show</h2>" + _table(["", "bytes"], rows, {1})
    st = report.steady_state
    if st is not None and st.step_reserved_bytes:
        steps = ", ".join(format_bytes(b) for b in st.step_reserved_bytes)
        settled = (f"settles from step {st.settled_after_steps}" if st.settled_after_steps is not None
                   else "still changing" if st.oom_step is None else f"runs out of memory in step {st.oom_step}")
        out += (f"<h2>A long run</h2><p>peak reserved over {st.steps_replayed} optimizer steps: "
                f"<b>{_e(format_bytes(st.reserved_bytes))}</b> ({_e(settled)}); per step: {_e(steps)}</p>")
    return out


#: The allocator settings the page tries on the run's trace, after the run's own: those memfit's plan tries when a
#: configuration does not fit (memfit.planner.search `_verified_plan`, memfit.remedies.allocator).
WHAT_IF_SETTINGS = ("expandable_segments:True", "max_split_size_mb:128")


def _what_ifs(report: "MemoryReport", tl: Timeline | None = None) -> str:
    """The run's trace replayed with other PYTORCH_CUDA_ALLOC_CONF settings (memfit.allocator.caching.replay, the
    capacity of the estimate's own replay): peak reserved, fragmentation and whether it completes. The run's own
    row is the replay of the timeline `tl` when it is that very replay (same settings and capacity)."""
    if not report.trace:
        return ""
    from memfit.allocator.caching import replay
    from memfit.allocator.conf import parse_alloc_conf

    capacity = report.capacity_bytes if report.capacity_bytes is not None else report.required_bytes
    own = report.alloc_conf if report.alloc_conf not in ("", "(default)") else ""
    rows = []
    for text in (None,) + WHAT_IF_SETTINGS:
        if text is not None and text.split(":")[0] in own:
            continue  # the run sets it already
        settings = own if text is None else (f"{own},{text}" if own else text)
        try:
            conf = report.replay_conf if text is None and report.replay_conf is not None else parse_alloc_conf(settings)
        except (ValueError, MemfitError):  # memfit's own texts parse; a report built by hand may not
            continue
        if text is not None and conf.backend == "cudaMallocAsync":
            continue
        if (text is None and tl is not None and tl.replay is not None and tl.conf == conf
                and tl.replay_capacity_bytes == capacity and tl.num_events == tl.replay.num_events):
            r = tl.replay
        else:
            r = replay(report.trace, conf=conf, capacity_bytes=capacity)
        verdict = ("runs out of memory in " + r.oom.phase) if r.oom is not None else "completes"
        rows.append([_e(settings or "(defaults)") + (" <i>(this run)</i>" if text is None else ""),
                     _e(format_bytes(r.peak_reserved_bytes)), _e(format_bytes(r.fragmentation_at_peak_bytes)),
                     str(r.num_cudamalloc), f'<span class="{"bad" if r.oom else "good"}">{_e(verdict)}</span>'])
    where = "what PyTorch can use on this GPU" if report.capacity_bytes is not None else "the required memory"
    return (f"<h2>Allocator settings</h2><p class=sub>The same trace replayed by the caching-allocator model with "
            f"other PYTORCH_CUDA_ALLOC_CONF settings, within {_e(where)} "
            f"({_e(format_bytes(capacity or 0))}).</p>"
            + _table(["PYTORCH_CUDA_ALLOC_CONF", "peak reserved", "fragmentation at the peak", "cudaMalloc calls",
                      "the simulated steps"], rows, {1, 2, 3}).replace('<table class="t">', '<table class="t" id="memfit-what-ifs">'))


def rank_timelines(report: "MemoryReport") -> list[tuple[list[int], Timeline]]:
    """The timeline of each other group of ranks whose memory differs from rank 0's (`MemoryReport.rank_traces`,
    ZeRO-2's gradient partitions), with its ranks: its trace replayed with the report's allocator settings on the
    same GPU (what PyTorch can use there; without a GPU, without a limit: the required memory is rank 0's)."""
    p = report.parallel or {}
    groups = [g for g in p.get("ranks") or [] if 0 not in g["ranks"] and report.rank_traces.get(g["ranks"][0])]
    if not groups:
        return []
    from memfit.allocator.conf import parse_alloc_conf

    conf = report.replay_conf if report.replay_conf is not None else parse_alloc_conf(report.alloc_conf)
    # the samples of all these timelines together stay near one timeline's (the page stays a few MB)
    samples = max(500, DEFAULT_MAX_SAMPLES // len(groups))
    return [(list(g["ranks"]), timeline(report.rank_traces[g["ranks"][0]], conf=conf,
                                        capacity_bytes=report.capacity_bytes, max_samples=samples))
            for g in groups]


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _rank_timeline(report: "MemoryReport", ranks: list[int], tl: Timeline) -> str:
    where = (f"on the {report.gpu['name']}, within what PyTorch can use there" if report.gpu is not None
             else "without a memory limit (no GPU given; the required memory above is rank 0's)")
    if tl.oom_index is not None:
        where += f"; it runs out of memory at trace event {tl.oom_index}"
    label = _ranks_text(ranks)
    return (f'<h3>{_e(label[0].upper() + label[1:])}</h3>'
            f'<div data-rank-timeline data-ranks="{_e(",".join(map(str, ranks)))}">'
            f"<p class=sub>Peak allocated {_e(format_bytes(tl.peak_allocated_bytes))}, "
            f"peak reserved {_e(format_bytes(tl.peak_reserved_bytes))}, its own trace replayed {_e(where)}.</p>"
            f'<div class="chart-wrap"><svg class="chart" role="img" aria-label="memory timeline of {_e(label)}"></svg>'
            f'<div class="tooltip"></div></div>{_legend(tl)}<p class="sub off-scale"></p>'
            f'<script type="application/json" class="memfit-rank-data">{_json_script(timeline_data(report, tl, ranks))}'
            "</script></div>")


def _ranks(report: "MemoryReport", rank_tls: list[tuple[list[int], Timeline]] = ()) -> str:
    """Multi-GPU: what each rank holds. The main timeline is rank 0's; where ranks differ (ZeRO-2's gradient
    partitions, memfit.parallel.rank) each group is listed with its peak and drawn with its own timeline, where they
    are alike the page says why and that the main timeline is every rank's."""
    p = report.parallel
    if not p:
        return ""
    ranks = p.get("ranks") or []
    out = f'<h2 id="memfit-per-rank">Per rank</h2><p class=sub>{_e(p.get("ranks_differ", ""))}</p>'
    world = p.get("world_size", 1)
    if not ranks and p.get("ranks_alike"):
        out += f"<p>The timeline above is each of the {_e(world)} ranks' own: they hold the same memory.</p>"
    elif not ranks:
        out += "<p>The timeline above is rank 0's; the other ranks are not simulated one by one.</p>"
    if ranks:
        rows = [[_e(", ".join(map(str, d["ranks"]))), _e(format_bytes(d["peak_allocated_bytes"])),
                 _e(format_bytes(d.get("grads_in_partition_bytes", 0)))] for d in ranks]
        out += _table(["ranks", "peak allocated", "gradient partition buffer"], rows).replace(
            '<table class="t">', '<table class="t" id="memfit-ranks">')
        own = timeline_ranks(report)
        out += (f"<p>The timeline above is {_e(_ranks_text(own))}'s"
                + (", and each other group of ranks has its own below: the same chart of its own trace."
                   if rank_tls else ".") + "</p>")
        out += "".join(_rank_timeline(report, g, tl) for g, tl in rank_tls)
    return out


def _oom(report: "MemoryReport", tl: Timeline | None) -> str:
    o = report.oom
    if o is None:
        return ""
    where = f"{o.phase}" + (f" of optimizer step {o.step}" if o.step is not None else "")
    if tl is not None and tl.oom_index is None:
        where += " (a later repetition of the simulated step: past the end of this timeline)"
    elif tl is not None:
        where += f" (trace event {tl.oom_index}, marked on the timeline)"
    return (f'<h2 class="bad">Out of memory</h2><p>The run runs out of memory in the {_e(where)}, allocating '
            f"{_e(format_bytes(o.tried_to_allocate_bytes))} of {_e(o.category)} with "
            f"{_e(format_bytes(o.allocated_bytes))} allocated and {_e(format_bytes(o.reserved_bytes))} reserved. "
            f'PyTorch would print:</p><pre id="memfit-oom-message">{_e(o.message)}</pre>')


def _notes(report: "MemoryReport", tl: Timeline | None) -> str:
    notes = list(report.notes)
    if tl is not None and all(t.shape is None for s in tl.samples for t in s.top):
        notes.append("the trace records storages (bytes, category, module, phase), not tensors: shape and dtype "
                     "are not known")
    if not notes:
        return ""
    return "<h2>Notes</h2><ul class=notes>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"


def _title(report: "MemoryReport") -> str:
    return f"memfit estimate: {report.model}"


def _subtitle(report: "MemoryReport") -> str:
    setup = report.setup
    bits = [report.task, f"batch {setup.get('per_device_train_batch_size')}", f"length {setup.get('sequence_length')}",
            setup.get("precision") or "", f"{report.trainable_params:,} of {report.params:,} parameters trained"]
    if report.gpu is not None:
        bits.append(report.gpu["name"])
    else:
        bits.append("no GPU given")
    if report.parallel:
        bits.append(f"{report.parallel.get('strategy')} over {report.parallel.get('world_size')} GPUs")
    return " \u00b7 ".join(str(b) for b in bits if b)


def _chart_intro(report: "MemoryReport", tl: Timeline) -> str:
    parts = ["Allocated memory stacked by category, reserved memory (black line) as the caching-allocator model "
             "replays the run"]
    if report.gpu is None:
        parts.append(", on a GPU that leaves exactly the required memory to PyTorch (no GPU given)")
    else:
        parts.append(f", on the {report.gpu['name']}")
    parts.append(". Hover to see the largest live tensors (size, category, module, shape, dtype).")
    if report.parallel:
        parts.append(f" Rank 0 of {report.parallel.get('world_size')} (ranks differ: "
                     f"{report.parallel.get('ranks_differ', 'unknown')}; see Per rank below).")
    return "<p class=sub>" + _e("".join(parts)) + "</p>"


def _legend(tl: Timeline) -> str:
    items = "".join(f'<span data-legend-category="{_e(c)}"><i style="background:{category_color(c, i)}"></i>'
                    f"{_e(category_label(c))}</span>" for i, c in enumerate(tl.categories))
    items += '<span><i style="background:#111;height:2px;vertical-align:3px"></i>reserved</span>'
    return f'<div class="legend">{items}</div>'


def _body(report: "MemoryReport", tl: Timeline) -> str:
    return (f"<h1>{_e(_title(report))}</h1><p class=sub>{_e(_subtitle(report))}</p>{_summary(report)}"
            f"<h2>Memory over the simulated steps</h2>{_chart_intro(report, tl)}"
            '<div id="memfit-chart-wrap"><svg id="memfit-chart" role="img" aria-label="memory timeline"></svg>'
            '<div id="memfit-tooltip"></div></div>'
            f'{_legend(tl)}<p id="memfit-off-scale" class=sub></p>'
            f"{_oom(report, tl)}{_breakdown(report, tl)}{_phases(report)}{_device(report)}{_ranks(report, rank_timelines(report))}{_what_ifs(report, tl)}"
            f"{_notes(report, tl)}"
            f'<script id="memfit-data" type="application/json">{_json_script(timeline_data(report, tl))}</script>'
            f"<script>{CHART_JS}</script>")


def render_html(report: "MemoryReport", tl: Timeline) -> str:
    """The whole page for `report` and its timeline `tl` (memfit.report.report_timeline)."""
    return page(_title(report), _CSS, _body(report, tl))


def notebook_html(report: "MemoryReport") -> str:
    """The report in a notebook cell: the page in an isolated frame (its ids and script stay its own), or
    the tables alone when the report has no trace (read from memfit's cache)."""
    if not report.trace:
        return (f"<div><b>{_e(_title(report))}</b><p>{_e(_subtitle(report))}</p>{_summary(report)}"
                f"{_oom(report, None)}{_breakdown(report, None)}{_phases(report)}{_device(report)}"
                f"{_notes(report, None)}<p><i>no trace (read from memfit's cache): estimate with cache=False to see "
                "the timeline</i></p></div>")
    page = render_html(report, report_timeline(report))
    return (f'<iframe srcdoc="{_e(page)}" style="width:100%;height:1100px;border:1px solid #ddd" '
            'sandbox="allow-scripts"></iframe>')
