"""The plan, diagnose and replay pages (memfit.report.plan_view / diagnose_view / replay_view) and their
`--html FILE` flags: self-contained, drawn from the results' own figures."""

import gzip
import json
import pickle
import re
from html.parser import HTMLParser

import pytest

from helpers import DATA_DIR
from memfit.allocator.snapshot import replay_snapshot, what_if
from memfit.cli import main
from memfit.diagnosis.verb import diagnose
from memfit.planner.search import Plan, PlanResult
from memfit.report.diagnose_view import memory_bar, render_diagnosis_html
from memfit.report.plan_view import change_text, plan_points, render_plan_html
from memfit.report.replay_view import downsample, render_replay_html
from memfit.units import GiB, MiB

SNAPSHOTS = DATA_DIR / "snapshots"
CORPUS = {c["id"]: c for c in json.loads((DATA_DIR / "oom" / "corpus.json").read_text(encoding="utf-8"))}

#: What makes a browser fetch something (src=, a <link>/<script> href, CSS url() and @import, the fetching
#: script APIs); an <a href> to the docs would be allowed, these pages have none.
_RESOURCE = re.compile(r"""(?:\bsrc\s*=|<link\b[^>]*\bhref\s*=|<script\b[^>]*\bhref\s*=|\burl\s*\(|@import|"""
                       r"""\bfetch\s*\(|XMLHttpRequest|\bimport\s*\(|new\s+(?:Worker|WebSocket|EventSource))""", re.I)
_REMOTE_ATTR = re.compile(r"""\b(?:src|href|action|data|poster)\s*=\s*["']?\s*(?:https?:)?//""", re.I)


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(text):
    assert len(text.encode()) < 5 * 2**20
    assert not _RESOURCE.search(text) and not _REMOTE_ATTR.search(text)
    p = _Tags()
    p.feed(text)
    p.close()
    assert not {t for t, _ in p.tags} & {"link", "img", "iframe", "object", "embed", "script", "audio", "video"}
    return p.tags


def _load(name):
    return json.loads(gzip.decompress((SNAPSHOTS / name).read_bytes()))


def _file_reserved(snap):
    """Reserved bytes after every entry, from the file alone (segment sizes and segment ops)."""
    trace = snap["device_traces"][0]
    delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    level = sum(s["total_size"] for s in snap["segments"] if s["device"] == 0) - sum(
        delta.get(e["action"], 0) * e["size"] for e in trace)
    out = []
    for e in trace:
        level += delta.get(e["action"], 0) * e["size"]
        out.append(level)
    return out


# -- replay ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["select_n_bert_inference_offload.json.gz", "wedsonlin_medium_ctx128_trainstep.json.gz"])
def test_the_replay_lines_are_the_recording_and_the_model(name):
    snap = _load(name)
    r = replay_snapshot(snap)
    assert list(r.recorded_reserved_bytes) == _file_reserved(snap)
    assert r.exact and r.modelled_reserved_bytes == r.recorded_reserved_bytes  # exact: equal after every entry
    series = [[], []]
    variants = [what_if(snap, t, reserved_after=s) for t, s in zip([None, "expandable_segments:True"], series)]
    assert [len(s) for s in series] == [r.num_entries] * 2
    assert [max(s) for s in series] == [v.peak_reserved_bytes for v in variants]
    tags = _tags(render_replay_html(name, 0, r, variants, series))
    lines = {a["data-series"] + ":" + a["data-settings"]: int(a["data-peak-bytes"]) for t, a in tags
             if t == "path" and "data-series" in a}
    assert lines == {"recorded:recorded": r.recorded.peak_reserved_bytes,
                     "modelled:modelled": r.modelled.peak_reserved_bytes,
                     "what-if:as recorded": variants[0].peak_reserved_bytes,
                     "what-if:expandable_segments:True": variants[1].peak_reserved_bytes}
    assert not any(a.get("data-marker") == "divergence" for _, a in tags)


def test_downsampling_keeps_the_extremes_and_the_order():
    values = [(i * 7919) % 1000 for i in range(50_000)]
    pts = downsample(values, 500)
    assert len(pts) <= 1000 and [i for i, _ in pts] == sorted(i for i, _ in pts)
    assert max(v for _, v in pts) == max(values) and min(v for _, v in pts) == min(values)
    assert downsample([3, 1, 2]) == [(0, 3), (1, 1), (2, 2)]


def test_cli_replay_html_marks_the_first_divergence(tmp_path, capsys):
    snap = _load("select_n_bert_inference_offload.json.gz")
    snap["allocator_settings"] = {"max_split_size": 128 * MiB, "expandable_segments": False}
    path = tmp_path / "diverging.pickle"
    path.write_bytes(pickle.dumps(snap))
    page = tmp_path / "replay.html"
    assert main(["replay", str(path), "--html", str(page), "--what-if", "roundup_power2_divisions:4"]) == 1
    assert f"{page} written" in capsys.readouterr().err
    text = page.read_text(encoding="utf-8")
    tags = _tags(text)
    marker = next(a for _, a in tags if a.get("data-marker") == "divergence")
    assert marker["data-index"] == "122"
    assert {a["data-settings"] for t, a in tags if a.get("data-series") == "what-if"} == {
        "as recorded", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4"}
    assert "At trace entry 122" in text


def test_cli_replay_html_bad_path_fails_before_reading(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.pickle"), "--html", str(tmp_path / "r.txt")]) == 2
    assert "--html writes .html" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.pickle"), "--plot", str(tmp_path / "r.jpg")]) == 2
    assert "--plot writes .png or .svg" in capsys.readouterr().err


def test_cli_replay_plot_draws_the_lines_and_the_divergence(tmp_path, capsys):
    """--plot: the HTML view's lines as a picture; the SVG keeps each text as a comment (matplotlib's svg backend)."""
    pytest.importorskip("matplotlib")
    snap = _load("select_n_bert_inference_offload.json.gz")
    snap["allocator_settings"] = {"max_split_size": 128 * MiB, "expandable_segments": False}
    path = tmp_path / "diverging.pickle"
    path.write_bytes(pickle.dumps(snap))
    svg, png = tmp_path / "replay.svg", tmp_path / "replay.png"
    assert main(["replay", str(path), "--plot", str(svg), "--json"]) == 1
    captured = capsys.readouterr()
    json.loads(captured.out)  # --json stays JSON
    assert f"{svg} written" in captured.err
    text = svg.read_text(encoding="utf-8")
    r = replay_snapshot(snap)
    for label in ("recorded (the real allocator)", "memfit's model of the recorded settings",
                  "what if: expandable_segments:True", "what if: max_split_size_mb:128", "first divergence: entry 122"):
        assert label in text, label
    from memfit.units import format_bytes

    assert f"peak {format_bytes(r.recorded.peak_reserved_bytes)}" in text
    assert main(["replay", str(path), "--plot", str(png)]) == 1
    assert png.read_bytes().startswith(b"\x89PNG")


# -- diagnose -------------------------------------------------------------------------------------------
def test_the_bar_is_the_messages_figures():
    # 23.64 GiB total, 264 MiB free, 7.63 GiB allocated, 40.11 MiB cached; NVML lists 0.41 GiB + 14.85 GiB
    # in two other processes, and this process holds 8.04 GiB
    d = diagnose(CORPUS["rlinf255"]["text"])
    m = d.message
    segments, request = memory_bar(d)
    by = {s.name: s.bytes for s in segments}
    assert sum(by.values()) == m.total_bytes
    assert by["live"] == m.allocated_bytes and by["cached_unused"] == m.reserved_unallocated_bytes
    assert by["free"] == m.free_bytes and request == m.tried_to_allocate_bytes == 86 * MiB
    assert by["other_processes"] == sum(b for _, b in m.other_processes)  # this process is not listed here
    assert by["outside_pytorch"] + by["other_processes"] == m.total_bytes - m.free_bytes - m.reserved_bytes
    tags = _tags(render_diagnosis_html(d))
    drawn = {a["data-segment"]: int(a["data-bytes"]) for t, a in tags if t == "rect" and "data-segment" in a}
    assert drawn == {**by, "request": request}
    primary = [a["data-kind"] for t, a in tags if t == "li" and a.get("data-primary") == "true"]
    assert primary == [CORPUS["rlinf255"]["primary"]] == ["other_processes"]


def test_a_message_that_lists_this_process_leaves_it_out_of_the_others():
    d = diagnose(CORPUS["pr99699"]["text"])  # "Process 1246069 has 577.00 MiB" and this process 15.32 GiB
    by = {s.name: s.bytes for s in memory_bar(d)[0]}
    assert sum(by.values()) == d.message.total_bytes
    assert by["live"] == d.message.allocated_bytes and by["free"] == d.message.free_bytes


def test_a_message_without_device_figures_has_no_bar():
    d = diagnose("RuntimeError: CUDA out of memory.")
    assert d.is_oom and memory_bar(d) is None
    text = render_diagnosis_html(d)
    _tags(text)
    assert "no device figures" in text


def test_cli_diagnose_html(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(CORPUS["rlinf255"]["text"], encoding="utf-8")
    page = tmp_path / "diagnosis.html"
    assert main(["diagnose", str(log), "--html", str(page), "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # --json stays JSON
    assert f"{page} written" in captured.err
    assert "Other processes hold" in page.read_text(encoding="utf-8")
    assert main(["diagnose", str(log), "--html", str(tmp_path / "nodir" / "d.html")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- plan -----------------------------------------------------------------------------------------------
def _plan(fits, headroom, step, verified=True, **changes):
    return Plan(remedies=["x"], setup_changes=changes, changes=changes, env={"PYTORCH_CUDA_ALLOC_CONF": "a:b"} if
                changes else {}, code=["model.gradient_checkpointing_enable()"] if changes else [],
                peak_allocated_bytes=GiB, peak_reserved_bytes=GiB, device_used_bytes=GiB + 300 * MiB,
                headroom_bytes=headroom, relative_step_time=step, fits=fits, verified=verified)


def test_plan_points_are_the_plans_need_against_the_budget():
    budget = 10 * GiB
    result = PlanResult(fits_as_is=False, baseline=_plan(False, -2 * GiB, 1.0), chosen=1,
                        plans=[_plan(False, -GiB, 0.8, bf16=True), _plan(True, GiB, 1.2, gradient_checkpointing=True),
                               _plan(True, 3 * GiB, 1.5, False, optim="adafactor")],
                        gpu={"name": "T4", "total_bytes": 16 * GiB}, margin=0.05, budget_bytes=budget, miss_bytes=None,
                        suggestions=[], not_applicable={}, elapsed_s=1.0, simulations=4)
    points = plan_points(result)
    assert [p.need_bytes for p in points] == [12 * GiB, 11 * GiB, 9 * GiB, 7 * GiB]
    assert [p.fits for p in points] == [p.need_bytes <= budget for p in points]
    assert [p.chosen for p in points] == [False, False, True, False]
    assert change_text(result) == ("export PYTORCH_CUDA_ALLOC_CONF=a:b\nTrainingArguments(..., "
                                   "gradient_checkpointing=True)\nmodel.gradient_checkpointing_enable()")
    text = render_plan_html(result)
    tags = _tags(text)
    circles = [a for t, a in tags if t == "circle" and "data-plan" in a]
    assert [a["data-plan"] for a in circles] == ["baseline", "0", "1", "2"]
    assert [a["data-fits"] for a in circles] == ["false", "false", "true", "true"]
    assert [a["data-verified"] for a in circles] == ["true", "true", "true", "false"]
    assert next(a for t, a in tags if a.get("data-line") == "budget")["data-bytes"] == str(budget)
    assert "gradient_checkpointing=True" in text.split('id="memfit-change">')[1].split("</pre>")[0]
    assert not [a for t, a in tags if "data-searched" in a]  # nothing searched: no dots


def test_every_searched_configuration_is_a_point():
    from memfit.planner.search import SearchedCandidate

    searched = [SearchedCandidate({"per_device_train_batch_size": b}, (8 + b) * GiB, 1 + b / 10, 8 + b <= 10)
                for b in (1, 2, 4)]
    result = PlanResult(fits_as_is=False, baseline=_plan(False, -2 * GiB, 1.0), chosen=None, plans=[],
                        gpu={"name": "T4", "total_bytes": 16 * GiB}, margin=0.05, budget_bytes=10 * GiB, miss_bytes=GiB,
                        suggestions=[], not_applicable={}, elapsed_s=1.0, simulations=4, searched=searched)
    tags = _tags(render_plan_html(result))
    dots = [a for t, a in tags if t == "circle" and "data-searched" in a]
    assert [(int(a["data-bytes"]), a["data-fits"]) for a in dots] == [(9 * GiB, "true"), (10 * GiB, "true"),
                                                                      (12 * GiB, "false")]
    budget_y = float(next(a for t, a in tags if a.get("data-line") == "budget")["y1"])
    assert [float(a["cy"]) >= budget_y for a in dots] == [True, True, False]  # fitting ones on or under the line
    # the JSON round trip keeps them (memfit's cache of plans)
    assert PlanResult.from_json(json.loads(json.dumps(result.to_json()))) == result


@pytest.mark.slow
def test_cli_plan_html_of_a_real_plan(tmp_path, capsys):
    """A BERT that does not fit a 1771 MiB GPU as is (about 20 s of simulations)."""
    from transformers import BertConfig

    BertConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, intermediate_size=1024,
               vocab_size=8000).save_pretrained(tmp_path)
    page = tmp_path / "plan.html"
    args = [str(tmp_path), "--batch-size", "16", "--grad-accum", "2", "--max-length", "512", "--gpu", "1771MiB",
            "--no-cache"]
    assert main(["plan", *args, "--html", str(page), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tags = _tags(page.read_text(encoding="utf-8"))
    circles = [a for t, a in tags if t == "circle" and "data-plan" in a]
    assert len(circles) == 1 + len(data["plans"])
    assert [a["data-fits"] == "true" for a in circles] == [data["baseline"]["fits"]] + [p["fits"] for p in data["plans"]]
    need = [data["budget_bytes"] - p["headroom_bytes"] for p in [data["baseline"], *data["plans"]]]
    assert [int(a["data-bytes"]) for a in circles] == need
    chosen = [a["data-plan"] for a in circles if a["data-chosen"] == "true"]
    assert chosen == [str(data["chosen"])]
    # every configuration the search ranked is a point too, the plans among them
    dots = [a for t, a in tags if t == "circle" and "data-searched" in a]
    assert len(dots) == len(data["searched"]) >= len(data["plans"])
    assert [int(a["data-bytes"]) for a in dots] == [c["need_bytes"] for c in data["searched"]]
    assert [a["data-fits"] == "true" for a in dots] == [c["need_bytes"] <= data["budget_bytes"] for c in data["searched"]]
    searched = {json.dumps(c["setup_changes"], sort_keys=True) for c in data["searched"]}
    assert all(json.dumps(p["setup_changes"], sort_keys=True) in searched for p in data["plans"])
