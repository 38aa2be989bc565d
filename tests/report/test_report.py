"""memfit.report: the estimate's timeline, the self-contained HTML view and the static plot."""

import html
import json
import re
from html.parser import HTMLParser

import pytest

from memfit import TrainSetup, estimate
from memfit.errors import MemfitError
from memfit.estimator import MemoryReport
from memfit.report import check_view_paths, report_timeline, write_views
from memfit.report.timeline import timeline
from memfit.trace import TraceEvent
from memfit.units import MiB


@pytest.fixture(scope="module")
def report(tiny_bert_dir):
    """No GPU: reserved memory replayed at `required_bytes`."""
    return estimate(TrainSetup(model=tiny_bert_dir, max_length=16))


@pytest.fixture(scope="module")
def t4_report(tiny_bert_dir):
    return estimate(TrainSetup(model=tiny_bert_dir, max_length=64, per_device_train_batch_size=4), gpu="T4")


@pytest.fixture(scope="module")
def oom_report(tiny_bert_dir):
    """Runs out of memory in the first forward: 96 MiB for PyTorch on a T4."""
    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=256, per_device_train_batch_size=32), gpu="T4",
                 capacity_bytes=96 * MiB)
    assert r.fits is False and r.oom is not None
    return r


# -- the timeline ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["report", "t4_report"])
def test_the_timeline_peaks_are_the_reports(name, request):
    r = request.getfixturevalue(name)
    tl = report_timeline(r)
    assert max(s.allocated_bytes for s in tl.samples) == r.peak_allocated_bytes == tl.peak_allocated_bytes
    assert max(s.reserved_bytes for s in tl.samples) == r.peak_reserved_bytes
    assert all(s.allocated_bytes == sum(s.by_category.values()) for s in tl.samples)
    assert all(set(s.by_category) == set(tl.categories) for s in tl.samples)
    # at the peak: the report's breakdown, category by category
    peak = next(s for s in tl.samples if s.index == tl.peak_index)
    assert {c: b for c, b in peak.by_category.items() if b} == {c: b for c, b in r.breakdown.items() if b}
    # every category of the breakdown is a series; the timeline has more only for what is live elsewhere
    assert {c for c, b in r.breakdown.items() if b} <= set(tl.categories) <= set(r.breakdown)
    assert tl.oom_index is None and tl.num_events == len(r.trace)


def test_the_timeline_phases_and_the_largest_live_storages(report):
    tl = report_timeline(report)
    phases = [sp.phase for sp in tl.spans]
    assert phases[:7] == ["setup"] + ["forward", "backward", "optimizer"] * 2 and phases[7:] in ([], ["eval"])
    assert [sp.step for sp in tl.spans if sp.phase == "optimizer"] == [1, 2]
    assert tl.spans[0].start == 0 and tl.spans[-1].end == tl.num_events - 1
    assert all(a.end + 1 == b.start for a, b in zip(tl.spans, tl.spans[1:]))
    for s in tl.samples:
        sizes = [t.size_bytes for t in s.top]
        assert sizes == sorted(sizes, reverse=True) and len(sizes) <= 8
        assert sum(sizes) <= s.allocated_bytes
    peak = next(s for s in tl.samples if s.index == tl.peak_index)
    assert peak.top and peak.top[0].category in tl.categories


def test_downsampling_keeps_the_peaks_and_the_ends(report):
    full = report_timeline(report)
    assert len(full.samples) == full.num_events  # a short trace: every event
    tl = report_timeline(report, max_samples=40)
    assert 16 <= len(tl.samples) <= 40
    assert max(s.allocated_bytes for s in tl.samples) == report.peak_allocated_bytes
    assert max(s.reserved_bytes for s in tl.samples) == report.peak_reserved_bytes
    assert tl.samples[0].index == 0 and tl.samples[-1].index == tl.num_events - 1
    assert [s.index for s in tl.samples] == sorted({s.index for s in tl.samples})
    with pytest.raises(MemfitError, match="at least 16"):
        report_timeline(report, max_samples=3)


def test_timeline_of_a_synthetic_trace_stops_at_the_oom():
    trace = [
        TraceEvent("alloc", 1, 3 * MiB, "weights", "setup", "w"),
        TraceEvent("alloc", 2, 1000, "inputs", "forward", "batch"),  # counted with activations, 1024 B
        TraceEvent("alloc", 3, 5 * MiB, "activations", "forward", "layer.0"),
        TraceEvent("free", 3, 5 * MiB, "activations", "backward", "layer.0"),
        TraceEvent("alloc", 4, 30 * MiB, "temporaries", "backward", "big"),
        TraceEvent("alloc", 5, 1, "temporaries", "optimizer", "never"),
    ]
    ok = timeline(trace, capacity_bytes=None)
    assert ok.oom_index is None and ok.categories == ("weights", "activations", "temporaries")
    assert [s.allocated_bytes for s in ok.samples] == [3 * MiB, 3 * MiB + 1024, 8 * MiB + 1024, 3 * MiB + 1024,
                                                       33 * MiB + 1024, 33 * MiB + 1536]
    assert [t.id for t in ok.samples[2].top] == [3, 1, 2]
    assert ok.samples[2].top[0].module == "layer.0" and ok.samples[2].top[2].category == "activations"
    assert [(sp.phase, sp.step) for sp in ok.spans] == [("setup", None), ("forward", 1), ("backward", 1),
                                                         ("optimizer", 1)]
    # segments: 20 MiB (kLargeBuffer) for the 3 and 5 MiB, 2 MiB (kSmallBuffer) for the batch; 30 MiB more fails
    small = timeline(trace, capacity_bytes=40 * MiB)
    assert small.oom_index == 4 and small.num_events == 5
    last = small.samples[-1]
    assert last.index == 4 and last.allocated_bytes == 3 * MiB + 1024 and 4 not in {t.id for t in last.top}
    assert last.reserved_bytes == 22 * MiB
    # the failing request, never allocated: what the chart stacks on the last sample
    assert ok.oom_request is None
    req = small.oom_request
    assert (req.id, req.size_bytes, req.category, req.module) == (4, 30 * MiB, "temporaries", "big")


def test_the_live_storages_carry_the_shape_dtype_and_module_of_their_tensor(report):
    """The tracker records, at allocation, the tensor that made each storage: its shape and dtype fill the storage
    (numel x element size, at most the 512-rounded size), and the module whose forward made it is named."""
    import math

    import torch

    tl = report_timeline(report)
    peak = next(s for s in tl.samples if s.index == tl.peak_index)
    assert peak.top
    for t in peak.top:
        assert t.shape is not None and t.dtype is not None, t
        elem = torch.empty((), dtype=getattr(torch, t.dtype)).element_size()
        assert 0 < math.prod(t.shape) * elem <= t.size_bytes
    allocs = [e for e in report.trace if e.action == "alloc"]
    weights = [e for e in allocs if e.category == "weights"]
    assert weights and all(e.shape is not None and e.module for e in weights)  # each by its parameter's name
    assert any(e.module.endswith("word_embeddings.weight") for e in weights)
    forward = [e for e in allocs if e.phase == "forward" and e.category == "activations"]
    # tiny BERT has 2 layers: no splice; its layers' activations name their module
    assert any(e.module.startswith("bert.encoder.layer.1.") for e in forward)


def test_the_oom_request_is_the_reports(oom_report):
    tl = report_timeline(oom_report)
    req = tl.oom_request
    assert req is not None and req.category == oom_report.oom.category
    # the message's "Tried to allocate" is the new segment the allocator asks the driver for (a 20 MiB one for a
    # 4 MiB request: CUDACachingAllocator.cpp get_allocation_size), the chart stacks the request itself
    from memfit.allocator.caching import get_allocation_size, round_size

    assert oom_report.oom.tried_to_allocate_bytes == get_allocation_size(round_size(req.size_bytes))
    assert req.size_bytes < oom_report.oom.tried_to_allocate_bytes
    assert tl.samples[-1].allocated_bytes == oom_report.oom.allocated_bytes


def test_the_oom_is_the_last_sample(oom_report):
    tl = report_timeline(oom_report)
    assert tl.oom_index is not None and tl.num_events == tl.oom_index + 1
    last = tl.samples[-1]
    assert last.index == tl.oom_index and last.phase == oom_report.oom.phase
    assert last.reserved_bytes == oom_report.oom.reserved_bytes  # the allocator model's state at the failure
    assert max(s.reserved_bytes for s in tl.samples) <= tl.replay_capacity_bytes == oom_report.capacity_bytes


def test_timeline_api_and_data_frame(report):
    samples = report.timeline()
    assert samples == report_timeline(report).samples
    pd = pytest.importorskip("pandas")
    df = report.timeline(as_frame=True)
    assert isinstance(df, pd.DataFrame) and len(df) == len(samples)
    assert int(df["allocated_bytes"].max()) == report.peak_allocated_bytes
    cats = [c for c in df.columns if c.endswith("_bytes") and c not in ("allocated_bytes", "reserved_bytes")]
    assert (df[cats].sum(axis=1) == df["allocated_bytes"]).all()


def test_a_cached_report_has_no_timeline_but_a_summary(report):
    cached = MemoryReport.from_json(report.to_json())
    assert "replay_conf" not in report.to_json()
    with pytest.raises(MemfitError, match="cache=False") as err:
        cached.timeline()
    assert "\n" not in str(err.value)
    assert "no trace" in cached._repr_html_() and "<script" not in cached._repr_html_()
    assert report._repr_html_().startswith("<iframe srcdoc=")


# -- the HTML view ------------------------------------------------------------------------------------
class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.data_script = None
        self._in_data = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        self._in_data = tag == "script" and a.get("id") == "memfit-data"

    def handle_endtag(self, tag):
        self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data_script = (self.data_script or "") + data


#: A reference that makes a browser fetch something: src=/href= to another document (a link or a script),
#: CSS url(...) and @import, and the script APIs that fetch.
_RESOURCE = re.compile(r"""(?:\bsrc\s*=|<link\b[^>]*\bhref\s*=|<script\b[^>]*\bhref\s*=|\burl\s*\(|@import|"""
                       r"""\bfetch\s*\(|XMLHttpRequest|\bimport\s*\(|new\s+(?:Worker|WebSocket|EventSource))""", re.I)
_REMOTE = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\s*\(\s*["']?\s*(?:https?:)?//""", re.I)


def _check_page(text: str, r: MemoryReport):
    assert len(text.encode()) < 5 * 2**20
    page = _Page()
    page.feed(text)
    page.close()
    assert page.data_script is not None
    data = json.loads(page.data_script)
    assert not _RESOURCE.search(text) and not _REMOTE.search(text)
    assert not {t for t, _ in page.tags} & {"link", "img", "iframe", "object", "embed", "audio", "video", "source"}
    assert all("src" not in a for _, a in page.tags)
    assert data["peak_allocated_bytes"] == r.peak_allocated_bytes
    return page, data


def test_the_html_is_one_self_contained_file(t4_report, tmp_path):
    path = t4_report.to_html(tmp_path / "memfit.html")
    text = open(path, encoding="utf-8").read()
    page, data = _check_page(text, t4_report)
    tl = report_timeline(t4_report)
    assert data["categories"] == list(tl.categories)
    assert max(s["allocated_bytes"] for s in data["samples"]) == t4_report.peak_allocated_bytes
    assert max(s["reserved_bytes"] for s in data["samples"]) == t4_report.peak_reserved_bytes
    assert {ln["id"] for ln in data["lines"]} == {"gpu-total", "pytorch-capacity"}
    assert all(str(i) in data["tensors"] for s in data["samples"] for i in s["top"])
    assert ("svg", {"id": "memfit-chart", "role": "img", "aria-label": "memory timeline"}) in page.tags
    assert any(t == "div" and a.get("id") == "memfit-tooltip" for t, a in page.tags)
    assert "nvidia-smi" in text and "T4" in text


def test_the_page_replays_the_trace_with_other_allocator_settings(t4_report, oom_report, tmp_path):
    """The allocator what-ifs: the run's own settings (the timeline's reserved line), then expandable segments and
    max_split_size_mb:128, each replayed on the same trace within the same capacity."""
    from memfit.allocator.caching import replay
    from memfit.allocator.conf import parse_alloc_conf
    from memfit.units import format_bytes

    for r in (t4_report, oom_report):
        text = open(write_views(r, html_path=tmp_path / "w.html")[0], encoding="utf-8").read()
        table = text.split('id="memfit-what-ifs">')[1].split("</table>")[0]
        rows = [re.sub(r"<[^>]+>", "|", row) for row in table.split("<tr>")[2:]]
        assert [row.split("|")[1].split(" ")[0] for row in rows] == ["(defaults)", "expandable_segments:True",
                                                                    "max_split_size_mb:128"]
        tl = report_timeline(r)
        assert format_bytes(tl.peak_reserved_bytes) in rows[0]
        exp = replay(r.trace, conf=parse_alloc_conf("expandable_segments:True"), capacity_bytes=r.capacity_bytes)
        assert format_bytes(exp.peak_reserved_bytes) in rows[1]
        assert ("runs out of memory" in rows[0]) == (tl.oom_index is not None)


def test_the_what_ifs_are_the_figures_of_their_own_replays(t4_report, oom_report, report, tmp_path):
    """Every row of the what-if table, the run's own one included (it reuses the timeline's replay), shows what
    `memfit.allocator.caching.replay` of the trace with that setting gives: peak reserved, fragmentation, cudaMalloc
    calls, the verdict."""
    from memfit.allocator.caching import replay
    from memfit.allocator.conf import parse_alloc_conf
    from memfit.units import format_bytes

    for r in (t4_report, oom_report, report):
        capacity = r.capacity_bytes if r.capacity_bytes is not None else r.required_bytes
        tl = report_timeline(r)
        assert tl.replay == replay(r.trace, conf=r.replay_conf, capacity_bytes=capacity)
        text = open(write_views(r, html_path=tmp_path / "w.html")[0], encoding="utf-8").read()
        table = text.split('id="memfit-what-ifs">')[1].split("</table>")[0]
        cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in table.split("<tr>")[2:]]
        for row, conf in zip(cells, [r.replay_conf] + [parse_alloc_conf(t) for t in ("expandable_segments:True",
                                                                                      "max_split_size_mb:128")],
                             strict=True):
            a = replay(r.trace, conf=conf, capacity_bytes=capacity)
            verdict = "completes" if a.oom is None else "runs out of memory in " + a.oom.phase
            assert row[1:4] == [format_bytes(a.peak_reserved_bytes), format_bytes(a.fragmentation_at_peak_bytes),
                                str(a.num_cudamalloc)]
            assert re.sub(r"<[^>]+>", "", row[4]) == verdict


def test_the_html_of_an_oom_carries_the_message(oom_report, tmp_path):
    path = write_views(oom_report, html_path=tmp_path / "oom.html")[0]
    text = open(path, encoding="utf-8").read()
    _, data = _check_page(text, oom_report)
    assert data["oom"]["index"] == report_timeline(oom_report).oom_index
    assert data["oom"]["message"] == oom_report.oom.message
    req = data["oom"]["request"]
    last = data["samples"][-1]
    assert last["index"] == data["oom"]["index"]
    assert req["total_bytes"] == last["allocated_bytes"] + req["size_bytes"] == req["allocated_bytes"] + req["size_bytes"]
    import html

    assert html.escape(oom_report.oom.message) in text  # the exact message, shown as text
    assert 'id="memfit-oom-message"' in text


def test_the_seed_like_page_without_gpu_draws_the_required_line(report, tmp_path):
    text = open(report.to_html(tmp_path / "r.htm"), encoding="utf-8").read()
    _, data = _check_page(text, report)
    assert [ln["id"] for ln in data["lines"]] == ["required"]
    assert "no GPU given" in text


# -- the plot ---------------------------------------------------------------------------------------
def test_the_plot_writes_png_and_svg(t4_report, oom_report, tmp_path):
    pytest.importorskip("matplotlib")
    png, svg = write_views(t4_report, plot_path=tmp_path / "m.png")[0], t4_report.plot(tmp_path / "m.svg")
    data = open(png, "rb").read()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    text = open(svg, encoding="utf-8").read()
    assert "<svg" in text and len(text) > 10_000
    oom = open(oom_report.plot(tmp_path / "oom.PNG"), "rb").read()
    assert oom.startswith(b"\x89PNG")


def test_write_views_writes_both_in_order(t4_report, tmp_path):
    pytest.importorskip("matplotlib")
    out = write_views(t4_report, html_path=tmp_path / "a.html", plot_path=tmp_path / "a.svg")
    assert out == [str(tmp_path / "a.html"), str(tmp_path / "a.svg")]
    assert write_views(t4_report) == []


# -- bad paths: one line each, before any simulation ------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"plot_path": "out.jpg"}, "`out.jpg`: --plot writes .png or .svg"),
    ({"plot_path": "out"}, "`out`: --plot writes .png or .svg"),
    ({"html_path": "out.pdf"}, "`out.pdf`: --html writes .html"),
    ({"html_path": "no-such-dir/x.html"}, "the directory of `no-such-dir/x.html` does not exist"),
])
def test_bad_view_paths_are_one_line_errors(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MemfitError) as err:
        check_view_paths(**kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_directory_is_not_a_view_path(report, tmp_path):
    (tmp_path / "d.html").mkdir()
    with pytest.raises(MemfitError, match="is a directory"):
        report.to_html(tmp_path / "d.html")
    with pytest.raises(MemfitError, match=r"--plot writes \.png or \.svg"):
        report.plot(tmp_path / "x.jpg")


def test_a_multi_gpu_report_is_drawn_for_rank_0(tiny_bert_dir, tmp_path):
    from memfit.parallel import ParallelSetup

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4", parallel=ParallelSetup(world_size=2,
                                                                                                   strategy="ddp"))
    tl = report_timeline(r)
    assert max(s.allocated_bytes for s in tl.samples) == r.peak_allocated_bytes
    text = open(r.to_html(tmp_path / "ddp.html"), encoding="utf-8").read()
    _, data = _check_page(text, r)
    assert (data["rank"], data["world_size"]) == (0, 2) and "Rank 0 of 2" in text


def _rank_data(text: str) -> list[dict]:
    """The JSON of each other group of ranks' timeline on the page."""
    return [json.loads(m) for m in re.findall(r'<script type="application/json" class="memfit-rank-data">(.*?)</script>',
                                              text)]


@pytest.fixture(scope="module")
def zero2_report(tiny_bert_dir):
    from memfit.parallel import ParallelSetup

    return estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4",
                    parallel=ParallelSetup(world_size=3, strategy="zero2"))


def test_ranks_that_differ_are_listed_per_rank(zero2_report, tmp_path):
    """ZeRO-2: each rank's gradient partition buffer differs (memfit.parallel.rank); the page lists every group of
    ranks with its own peak, as the report's `parallel.ranks` has them."""
    r = zero2_report
    text = open(r.to_html(tmp_path / "z2.html"), encoding="utf-8").read()
    assert '<h2 id="memfit-per-rank">Per rank</h2>' in text and html.escape(r.parallel["ranks_differ"]) in text
    from memfit.units import format_bytes

    ranks = r.parallel["ranks"]
    assert [d["ranks"] for d in ranks] == [[0], [1], [2]]  # three partitions that cut the parameters differently
    table = text.split('id="memfit-ranks">')[1].split("</table>")[0]
    assert table.count("<tr>") == 1 + len(ranks)
    assert all(format_bytes(d["peak_allocated_bytes"]) in table for d in ranks)


def test_each_group_of_ranks_that_differ_has_its_own_timeline(zero2_report, tmp_path):
    """ZeRO-2 over 3 ranks: the page carries one timeline per distinct group of ranks, rank 0's (the main one) and
    one of each other group's own trace (`MemoryReport.rank_traces`), each peaking at its group's peak and holding
    its own gradient partition buffer."""
    from memfit.peaks import peaks

    r = zero2_report
    assert sorted(r.rank_traces) == [1, 2] and r.parallel["ranks_alike"] is False
    text = open(r.to_html(tmp_path / "z2.html"), encoding="utf-8").read()
    _, main = _check_page(text, r)
    others = _rank_data(text)
    groups = {tuple(d["ranks"]): d for d in r.parallel["ranks"]}
    assert sorted(tuple(d["ranks"]) for d in [main, *others]) == sorted(groups)
    assert text.count("<div data-rank-timeline") == len(others) == len(groups) - 1
    assert main["ranks"] == [0] and main["peak_allocated_bytes"] == r.peak_allocated_bytes
    for d in others:
        trace = r.rank_traces[d["ranks"][0]]
        assert d["peak_allocated_bytes"] == peaks(trace).overall.bytes == groups[tuple(d["ranks"])][
            "peak_allocated_bytes"] == max(s["allocated_bytes"] for s in d["samples"])
        assert d["num_events"] == len(trace) and d["categories"] == main["categories"]
        assert {ln["id"] for ln in d["lines"]} == {"gpu-total", "pytorch-capacity"}  # `required` is rank 0's
        partition = [e.size_bytes for e in trace if e.module == "DeepSpeed grads_in_partition" and e.action == "alloc"]
        assert partition and set(partition) == {groups[tuple(d["ranks"])]["grads_in_partition_bytes"]}  # once a step
    assert len({d["peak_allocated_bytes"] for d in [main, *others]}) == 3  # the three partitions differ


def test_ranks_that_are_alike_share_the_timeline_and_say_why(tiny_bert_dir, tmp_path):
    """FSDP2 over 4 ranks: every rank holds the same, so the one timeline stands for all four (its data's `ranks`)
    and the page says why; no other timeline."""
    from memfit.parallel import ParallelSetup

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4",
                 parallel=ParallelSetup(world_size=4, strategy="fsdp"))
    assert r.parallel["fsdp_version"] == 2 and r.parallel["ranks_alike"] is True and r.rank_traces == {}
    text = open(r.to_html(tmp_path / "fsdp.html"), encoding="utf-8").read()
    _, data = _check_page(text, r)
    assert data["ranks"] == [0, 1, 2, 3] and _rank_data(text) == [] and "<div data-rank-timeline" not in text
    section = text.split('id="memfit-per-rank">')[1].split("<h2")[0]
    assert html.escape(r.parallel["ranks_differ"]) in section and "each of the 4 ranks' own" in section
