"""Real CUDA allocator traces (tests/data/snapshots, see SOURCE.md) replayed exactly; the safe loader; `memfit replay`."""

import copy
import gzip
import json
import os
import pickle

import pytest

from helpers import DATA_DIR, REPO_ROOT
from memfit.allocator import caching as allocator
from memfit.allocator.conf import AllocConf
from memfit.allocator.snapshot import load_snapshot, loads_snapshot, replay_snapshot, start_state
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.units import MiB

DATA = DATA_DIR / "snapshots"
FILES = sorted(DATA.glob("*.json.gz"))


def _load(name):
    return json.loads(gzip.decompress((DATA / name).read_bytes()))


def _recorded_reserved(snap, device=0):
    """Reserved memory before and after every entry, from the file alone (no memfit code)."""
    trace = snap["device_traces"][device]
    delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    change = sum(delta.get(e["action"], 0) * e["size"] for e in trace)
    level = sum(s["total_size"] for s in snap["segments"] if s["device"] == device) - change
    out = [level]
    for e in trace:
        level += delta.get(e["action"], 0) * e["size"]
        out.append(level)
    return out


def test_real_files_are_derived_data_with_a_source():
    names = [f.name for f in FILES]
    assert len(names) == 10 and "wedsonlin_medium_ctx512_trainstep.json.gz" in names
    source = (DATA / "SOURCE.md").read_text()
    for f in FILES:
        assert f"`{f.name}`" in source
        assert f.stat().st_size < 100_000
        assert len(_load(f.name)["source"]["sha256"]) == 64


def _traced_devices():
    """(file, device) of every device trace with entries: a snapshot of several GPUs holds one trace each."""
    out = []
    for f in FILES:
        traces = _load(f.name)["device_traces"]
        out += [(f, d) for d, t in enumerate(traces) if t]
    return out


def _case_id(x):
    return x.name.split(".")[0] if hasattr(x, "name") else f"device{x}"


@pytest.mark.parametrize(("path", "device"), _traced_devices(), ids=_case_id)
def test_real_trace_replays_exactly(path, device):
    snap = _load(path.name)
    trace = snap["device_traces"][device]
    r = replay_snapshot(snap, device=device)
    levels = _recorded_reserved(snap, device)
    assert r.recorded.peak_reserved_bytes == max(levels)
    assert r.recorded.segment_allocs == sum(e["action"] in ("segment_alloc", "segment_map") for e in trace)
    assert r.recorded.segment_frees == sum(e["action"] in ("segment_free", "segment_unmap") for e in trace)
    # memfit's own choices reproduce the recording
    assert r.segment_sequence_equal and r.reserved_equal_after_every_event
    assert r.address_mismatches == 0 and r.final_state_equal
    assert r.first_divergence is None and r.exact
    assert r.modelled == r.recorded


BENCH_FILES = sorted((REPO_ROOT / "bench" / "data" / "snapshots").glob("*.json.gz"))


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCH_FILES, ids=lambda p: p.name.split(".")[0])
def test_bench_trace_replays_exactly(path):
    # the larger real traces bench/snapshot_replay.py replays (bench/data/snapshots/SOURCE.md)
    snap = json.loads(gzip.decompress(path.read_bytes()))
    assert f"`{path.name}`" in (path.parent / "SOURCE.md").read_text()
    for device, trace in enumerate(snap["device_traces"]):
        if trace:
            r = replay_snapshot(snap, device=device)
            assert r.recorded.peak_reserved_bytes == max(_recorded_reserved(snap, device))
            assert r.exact and r.modelled == r.recorded


def test_kkaitlyn_figures():
    # the 2.7B model's first full step: 782 cudaMalloc and 430 cudaFree (an empty_cache()
    # first), 56.91 GiB reserved at the peak
    r = replay_snapshot(_load("kkaitlyn_2.7b_ctx128_fullstep.json.gz"))
    assert (r.modelled.segment_allocs, r.modelled.segment_frees) == (782, 430)
    assert r.modelled.peak_reserved_bytes == 61_111_009_280
    assert r.modelled.peak_allocated_bytes == 55_079_000_576


def test_start_state_has_blocks_allocated_before_recording():
    # wedsonlin's step was recorded after warm-up: no segment operation at all, 377 segments
    # already there, and 438 blocks allocated before and freed during the recording
    snap = _load("wedsonlin_medium_ctx128_trainstep.json.gz")
    st = start_state(snap)
    assert len(st.segments) == 377
    assert st.inferred_sizes == 438
    assert st.reserved_bytes == sum(s["total_size"] for s in snap["segments"])


def test_release_runs_without_frames_use_the_model():
    # without the emptyCache frame, the release run before a cudaMalloc is told apart by
    # whether the model still finds a cached block first; the replay stays exact
    snap = _load("kkaitlyn_2.7b_ctx128_fullstep.json.gz")
    for e in snap["device_traces"][0]:
        e.pop("frames", None)
    assert replay_snapshot(snap).exact


def test_truncated_trace_replays_exactly():
    # the ring buffer dropped its oldest entries: the state at the first kept one is
    # reconstructed the same way (cuts inside a malloc's segment_alloc/alloc pair included)
    snap = _load("kkaitlyn_2.7b_ctx128_fullstep.json.gz")
    trace = snap["device_traces"][0]
    cuts = [k for k in range(1, len(trace)) if trace[k - 1]["action"] == "segment_alloc"][:3] + [431, 5000, 12345]
    for k in cuts:
        cut = dict(snap, device_traces=[trace[k:]])
        assert replay_snapshot(cut).exact, k


def test_wrong_tie_breaking_is_caught(monkeypatch):
    # a model that breaks best-fit ties by the highest address still makes the same
    # cudaMallocs here, but puts thousands of blocks elsewhere: the replay says so
    orig = allocator.AllocatorModel.find_free_block

    def highest_address(self, pool, stream, size):
        i = orig(self, pool, stream, size)
        if i is None:
            return None
        size_i = pool.blocks[pool.keys[i]].size
        while i + 1 < len(pool.keys) and pool.blocks[pool.keys[i + 1]].size == size_i \
                and pool.blocks[pool.keys[i + 1]].stream == stream:
            i += 1
        return i

    monkeypatch.setattr(allocator.AllocatorModel, "find_free_block", highest_address)
    r = replay_snapshot(_load("kkaitlyn_2.7b_ctx128_fullstep.json.gz"))
    assert r.address_mismatches > 1000 and not r.final_state_equal and not r.exact


def test_wrong_settings_diverge():
    # replayed as if max_split_size_mb:128 had been set, BERT's trace diverges at entry 122:
    # the 64 MiB request may not take the cached (oversize) block the recording reused
    r = replay_snapshot(_load("select_n_bert_inference_offload.json.gz"), conf=AllocConf(max_split_size_bytes=128 * MiB))
    assert not r.exact and not r.segment_sequence_equal
    d = r.first_divergence
    assert d.event_index == 122
    assert d.recorded == "alloc 67108864 B at 0x7fe92e000000"
    assert d.modelled.startswith("segment_alloc 67108864 B, alloc 67108864 B at ")


# -- the loader ---------------------------------------------------------------------------------------
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_unrun(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": _Evil(marker)}))
    with pytest.raises(MemfitError, match=r"`(os|posix)\.system`") as err:
        load_snapshot(path)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    with pytest.raises(MemfitError, match="builtins.eval"):
        loads_snapshot(b"cbuiltins\neval\n(S'1+1'\ntR.")


def test_bad_files(tmp_path):
    with pytest.raises(MemfitError, match="does not exist"):
        load_snapshot(tmp_path / "missing.pickle")
    with pytest.raises(MemfitError, match="is a directory"):
        load_snapshot(tmp_path)
    (tmp_path / "log.txt").write_text("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(MemfitError, match="not a readable pickle"):
        load_snapshot(tmp_path / "log.txt")
    (tmp_path / "list.pickle").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(MemfitError, match="not a memory snapshot"):
        load_snapshot(tmp_path / "list.pickle")
    (tmp_path / "dict.pickle").write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(MemfitError, match="`device_traces`"):
        load_snapshot(tmp_path / "dict.pickle")


def test_trace_that_disagrees_with_segments():
    snap = _load("select_n_bert_inference_offload.json.gz")
    bad = copy.deepcopy(snap)
    bad["segments"] = bad["segments"][1:]  # a segment the trace uses is missing
    with pytest.raises(MemfitError, match="disagree"):
        replay_snapshot(bad)
    with pytest.raises(MemfitError, match="no trace for device `5`"):
        replay_snapshot(snap, device=5)


# -- memfit replay --------------------------------------------------------------------------------------
@pytest.fixture()
def bert_pickle(tmp_path):
    path = tmp_path / "bert.pickle"
    path.write_bytes(pickle.dumps(_load("select_n_bert_inference_offload.json.gz")))
    return str(path)


def test_cli_replay_text(bert_pickle, capsys):
    assert main(["replay", bert_pickle]) == 0
    out = capsys.readouterr().out
    assert "exact: the same 13 segment operations" in out
    assert "expandable_segments:True" in out and "max_split_size_mb:128" in out
    assert "no allocator_settings" in out


def test_cli_replay_json(bert_pickle, capsys):
    assert main(["replay", bert_pickle, "--json", "--max-split-size-mb", "64", "--what-if", "roundup_power2_divisions:4"]) == 0
    data = json.loads(capsys.readouterr().out)
    for side in ("recorded", "modelled"):
        assert set(data[side]) >= {"peak_reserved_bytes", "peak_allocated_bytes", "segment_allocs"}
    assert data["recorded"] == data["modelled"]
    assert data["recorded"]["segment_allocs"] == 13
    assert data["segment_sequence_equal"] is True and data["first_divergence"] is None and data["exact"] is True
    assert [w["settings"] for w in data["what_if"]] == [
        "as recorded", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4"]
    # the expandable run packs BERT's weights and activations into fewer bytes than native
    assert data["what_if"][1]["peak_reserved_bytes"] < data["what_if"][0]["peak_reserved_bytes"]


def test_cli_replay_divergence_exits_1(tmp_path, capsys):
    snap = _load("select_n_bert_inference_offload.json.gz")
    snap["allocator_settings"] = {"max_split_size": 128 * MiB, "expandable_segments": False}
    path = tmp_path / "diverging.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "first divergence at trace entry 122" in out
    assert main(["replay", str(path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["segment_sequence_equal"] is False
    assert data["first_divergence"]["event_index"] == 122


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"not a pickle at all", "not a readable pickle"),
    (pickle.dumps({"a": 1}), "not a memory snapshot"),
    (b"cos\nsystem\n(S'echo hi'\ntR.", "`os.system`"),
])
def test_cli_replay_errors(tmp_path, capsys, content, message):
    path = tmp_path / "x.pickle"
    if content is not None:
        path.write_bytes(content)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfit replay: error: ") and message in err and "\n" not in err


def test_cli_replay_bad_flags(bert_pickle, capsys):
    assert main(["replay", bert_pickle, "--max-split-size-mb", "10"]) == 2
    assert "below PyTorch's minimum of 20" in capsys.readouterr().err
    assert main(["replay", bert_pickle, "--what-if", "max_split_size_mb:5"]) == 2
    assert "too small" in capsys.readouterr().err


def test_segments_list_is_named_for_what_it_is(tmp_path):
    # `torch.cuda.memory_snapshot()` returns the segments alone (a list), with no trace to replay
    path = tmp_path / "segments.pickle"
    path.write_bytes(pickle.dumps(_load("select_n_bert_inference_offload.json.gz")["segments"]))
    with pytest.raises(MemfitError, match=r"is a list of 82 segments \(`torch.cuda.memory_snapshot\(\)`\), which holds no "
                                          "trace"):
        load_snapshot(path)
