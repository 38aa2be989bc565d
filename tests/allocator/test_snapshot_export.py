"""`memfit estimate --snapshot`: the simulated run as a torch.cuda.memory snapshot."""

import base64
import json
import re

import pytest
from torch.cuda import _memory_viz

from memfit.allocator.conf import AllocConf, parse_alloc_conf
from memfit.allocator import replay
from memfit.allocator.snapshot import load_snapshot, loads_snapshot, replay_snapshot
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.estimator import estimate
from memfit.allocator.export import export_snapshot, write_snapshot
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def report(tiny_bert_dir):
    return estimate(TrainSetup(model=tiny_bert_dir, per_device_train_batch_size=4, max_length=64,
                               eval_strategy="epoch"), alloc_conf="")


@pytest.mark.parametrize("conf_text", ["", "expandable_segments:True", "max_split_size_mb:20,roundup_power2_divisions:4"])
def test_replay_of_export_reproduces_memfits_numbers(report, conf_text):
    conf = parse_alloc_conf(conf_text)
    ref = replay(report.trace, conf=conf)
    r = replay_snapshot(export_snapshot(report.trace, conf=conf))
    assert r.exact
    assert r.conf == conf  # the settings travel in allocator_settings
    assert r.modelled.peak_reserved_bytes == r.recorded.peak_reserved_bytes == ref.peak_reserved_bytes
    assert r.modelled.peak_allocated_bytes == r.recorded.peak_allocated_bytes == ref.peak_allocated_bytes
    assert r.modelled.segment_allocs == ref.num_cudamalloc
    assert r.modelled.final_reserved_bytes == ref.final_reserved_bytes
    if not conf_text:
        assert ref.peak_reserved_bytes == report.peak_reserved_bytes


def test_export_stops_at_an_oom(report):
    ref = replay(report.trace)
    cap = ref.peak_reserved_bytes // 2
    snap = export_snapshot(report.trace, capacity_bytes=cap)
    trace = snap["device_traces"][0]
    assert trace[-1]["action"] == "oom" and "device_free" in trace[-1]
    assert replay_snapshot(snap).exact


def test_frames_name_phase_module_and_category(report):
    snap = export_snapshot(report.trace)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    def named(kind):
        return {f["name"] for e in allocs for f in e["frames"] if f["filename"] == kind}

    assert {"forward", "backward", "optimizer", "eval"} <= named("phase")
    assert {"weights", "gradients", "optimizer_state", "activations"} <= named("category")
    modules = {e.module for e in report.trace if e.action == "alloc" and e.module}
    assert modules and modules <= named("module")  # e.g. the autograd node of a backward temporary
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert live and all(b["frames"] for b in live)


def test_memory_viz_renders_the_export(report, tmp_path):
    snap = export_snapshot(report.trace)
    path = write_snapshot(snap, tmp_path / "run.pickle")
    data = load_snapshot(path)  # plain data: the no-globals loader reads it
    # the HTML pages of pytorch.org/memory_viz embed the pickle: it round-trips
    for html in (_memory_viz.trace_plot(data), _memory_viz.trace_plot(data, plot_segments=True),
                 _memory_viz.segment_plot(data)):
        blob = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))[0]["base64"]
        assert loads_snapshot(base64.b64decode(blob).rstrip(b"\x00") or b"", name="html") == data
    # the text views parse every segment, block and trace entry (segsum checks its accounting)
    summary = _memory_viz.segsum(data)
    assert f"segments: {len(data['segments'])}" in summary
    text = _memory_viz.trace(data)
    assert text.count("cudaMalloc(") == sum(e["action"] == "segment_alloc" for e in data["device_traces"][0])
    flame = _memory_viz.segments(data, format_flamegraph=lambda lines: lines)
    # a weight's block is named by its parameter (the trace's module of a setup allocation)
    assert re.search(r"active_allocated;phase:0:setup;module:0:bert\.[\w.]+\.weight;category:0:weights", flame), \
        flame[:500]
    assert _memory_viz.memory(data, format_flamegraph=lambda lines: lines)


def test_cli_estimate_snapshot(tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "est.pickle"
    assert main(["estimate", tiny_bert_dir, "--batch-size", "2", "--max-length", "32", "--alloc-conf", "",
                 "--snapshot", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout stays pure JSON
    assert "snapshot of the simulated run written" in captured.err
    assert main(["replay", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["exact"] is True
    assert rep["modelled"]["peak_reserved_bytes"] == data["peak_reserved_bytes"]
    assert rep["modelled"]["peak_allocated_bytes"] == data["peak_allocated_bytes"]


def test_cli_estimate_snapshot_bad_path(tiny_bert_dir, tmp_path, capsys):
    assert main(["estimate", tiny_bert_dir, "--snapshot", str(tmp_path / "no" / "x.pickle")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "\n" not in err.strip()
    assert main(["estimate", tiny_bert_dir, "--snapshot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_export_rejects_bad_traces():
    from memfit.trace import TraceEvent

    with pytest.raises(MemfitError, match="`1`"):
        export_snapshot([TraceEvent("alloc", 1, 10), TraceEvent("alloc", 1, 10)], conf=AllocConf())
