"""The start state of a real trace chosen among those its final segments allow (memfit.allocator.snapshot.recorded).

Data: tests/data/snapshots (real traces, see SOURCE.md).
"""

import copy
import gzip
import json
import pickle

import pytest

from helpers import DATA_DIR
from memfit.allocator.caching import LayoutConflict
from memfit.allocator.snapshot import replay_snapshot, start_state
from memfit.allocator.snapshot.read import _entries, conf_from_snapshot
from memfit.allocator.snapshot.recorded import fresh_address, recorded_run
from memfit.cli import main
from memfit.units import MiB

DATA = DATA_DIR / "snapshots"


def _load(name):
    return json.loads(gzip.decompress((DATA / name).read_bytes()))


def _first_conflict(snap):
    """The entry where the start state without a search (every open block at its rounded request) fails."""
    st = start_state(snap)
    entries = _entries(snap, 0)
    with pytest.raises(LayoutConflict) as err:
        recorded_run(conf_from_snapshot(snap), st, entries, fresh_address(entries, st), None)
    return st, entries[err.value.entry_index], err.value


def test_ambiguous_start_of_a_real_trace_is_searched():
    # the 4 x 512-token step of the CS336 medium model: recorded after warm-up steps, so blocks
    # allocated before the recording kept tails the final segments do not show
    snap = _load("wedsonlin_medium_ctx512_trainstep.json.gz")
    st, entry, err = _first_conflict(snap)
    assert (entry.action, entry.size, entry.addr) == ("alloc", 8 * MiB, 0x8DFA00000) == ("alloc", 8 * MiB, err.ptr)
    r = replay_snapshot(snap)
    assert r.exact and r.search.consistent and not r.search.forced
    open_sizes = {a: (lo, hi) for a, lo, hi in st.open_sizes}
    pinned = dict(r.search.pinned)
    # the block before the conflicting address ends exactly there: its tail made the cached block start at it
    assert pinned[0x8DF510000] == 0x8DFA00000 - 0x8DF510000
    for addr, size in pinned.items():
        lo, hi = open_sizes[addr]
        assert lo < size <= hi <= lo + MiB
    assert r.search.open_blocks == len(open_sizes) > len(pinned)
    # the blocks the trace does not fix bound how far allocated can be off; reserved is the recorded one
    assert r.search.allocated_uncertainty_bytes == sum(hi - lo for a, (lo, hi) in open_sizes.items() if a not in pinned)
    assert any("the trace fixes 3 of them" in n and "the other 30 get their rounded request" in n for n in r.notes)


def test_ring_buffer_that_overwrote_the_start_is_searched():
    # the same trace as a ring buffer that kept only its last entries (`max_entries`): the
    # first 6220 entries, which show how a 3 MiB block came to keep its tail, are gone
    full = _load("kkaitlyn_2.7b_ctx128_fullstep.json.gz")
    snap = dict(full, device_traces=[full["device_traces"][0][6220:]])
    _, entry, _ = _first_conflict(snap)
    assert entry.action == "alloc"
    r = replay_snapshot(snap)
    assert r.exact and r.search.consistent
    assert [size for _, size in r.search.pinned] == [3 * MiB]


def _moved_alloc():
    """The BERT trace with one alloc (and its frees) moved into a block that is live then: no start state holds it."""
    snap = copy.deepcopy(_load("select_n_bert_inference_offload.json.gz"))
    trace = snap["device_traces"][0]
    live, moved = {}, None
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            if live and e["size"] > 1 * MiB:
                other = max(live.values(), key=lambda x: x["size"])
                if other["size"] > 2 * MiB:
                    moved = (e["addr"], other["addr"] + 1 * MiB, i)
                    break
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    assert moved is not None
    old, new, at = moved
    for e in trace[at:]:
        if e["addr"] == old and e["action"] in ("alloc", "free_requested", "free_completed"):
            e["addr"] = new
            if e["action"] == "free_completed":
                break
    return snap, at


def test_trace_no_start_state_holds_is_replayed_and_says_how_far_off():
    # the replay goes on with that entry left out instead of refusing the file
    snap, at = _moved_alloc()
    trace = snap["device_traces"][0]
    r = replay_snapshot(snap)
    assert not r.exact and r.search.forced[0] == at and at in r.search.skipped
    assert r.search.allocated_uncertainty_bytes >= trace[at]["size"]
    assert any("no start state the final segments allow holds the whole recording (first: entry "
               f"{at})" in n for n in r.notes)


def test_cli_replays_a_trace_no_start_state_holds(tmp_path, capsys):
    snap, at = _moved_alloc()
    path = tmp_path / "moved.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["replay", str(path), "--json"]) == 1  # replayed, not exact; not refused (2)
    start = json.loads(capsys.readouterr().out)["start"]
    assert start["forced_entries"][0] == at and start["allocated_uncertainty_bytes"] > 0
