"""Every snapshot format feature on small synthetic traces: settings as PyTorch wrote them,
several streams with free_requested / free_completed, expandable segments, empty_cache,
oom entries, truncated traces.

The synthetic recordings are written by memfit's allocator model with every `record_trace`
point reported (as `_record_memory_history` would record them); the replay then has to
reconstruct the start state from the final segments alone and reproduce the recording.
"""

import random

import pytest

from memfit.allocator.conf import AllocConf
from memfit.allocator import AllocatorModel, Driver
from memfit.allocator.snapshot import conf_from_snapshot, replay_snapshot, start_state, what_if
from memfit.errors import MemfitError
from memfit.units import MiB

DIVS_DICT = {str(1 << k): 0 for k in range(16)}


def record(conf, *, seed=0, n=3000, streams=(0,), cross_stream=0.0, capacity=None, empty_every=0,
           settings=None, big=False, free_p=0.55):
    """A snapshot of a random workload: (mallocs on `streams`, frees, record_stream frees
    completed later, empty_cache every `empty_every` calls, OOMs caught and continued)."""
    rng = random.Random(seed)
    trace = []

    def on_event(action, ptr, size, stream):
        e = {"action": action, "addr": ptr, "size": size, "stream": stream, "time_us": len(trace)}
        if action == "oom":
            e["device_free"] = e.pop("addr")
        if action == "segment_free" and in_empty_cache:
            e["frames"] = [{"name": "NativeCachingAllocator::emptyCache()", "filename": "", "line": 0}]
        trace.append(e)

    in_empty_cache = False
    m = AllocatorModel(conf, Driver(capacity), on_event=on_event)
    live, pending = [], []
    for i in range(n):
        r = rng.random()
        if empty_every and i % empty_every == empty_every - 1:
            in_empty_cache = True
            m.empty_cache()
            in_empty_cache = False
        elif pending and r < 0.1:
            b = pending.pop(rng.randrange(len(pending)))
            if b.pending:  # else empty_cache's synchronize_and_free_events completed it already
                m.free_completed(b)  # its events completed
        elif live and r < free_p:
            b = live.pop(rng.randrange(len(live)))
            if rng.random() < cross_stream:
                m.free_requested(b)  # used on another stream: returns to the pool later
                pending.append(b)
            else:
                m.free(b)
        else:
            size = rng.choice((rng.randint(1, 4096), rng.randint(4096, MiB), rng.randint(MiB, 48 * MiB))
                              + ((rng.randint(48 * MiB, 256 * MiB),) if big else ()))
            b, _ = m.malloc(size, rng.choice(streams))
            if b is not None:
                live.append(b)
    snap = {"segments": m.state(), "device_traces": [trace]}
    if settings is not None:
        snap["allocator_settings"] = settings
    return snap, m


def _exact(snap, **kw):
    r = replay_snapshot(snap, **kw)
    assert r.first_divergence is None, r.first_divergence
    assert r.segment_sequence_equal and r.reserved_equal_after_every_event
    assert r.address_mismatches == 0 and r.final_state_equal
    assert r.modelled == r.recorded
    return r


# -- settings as PyTorch wrote them ---------------------------------------------------------------
def test_settings_dict_and_unlimited_split():
    # torch >= 2.6: roundup_power2_divisions as {interval MiB: divisions}; SIZE_MAX as -1
    conf = conf_from_snapshot({"allocator_settings": {
        "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
        "expandable_segments": False, "roundup_power2_divisions": dict(DIVS_DICT, **{"4": 8, "32768": 2})}})
    assert conf.max_split_size_bytes is None
    assert conf.garbage_collection_threshold is None
    assert conf.roundup_power2_divisions[2] == 8 and conf.roundup_power2_divisions[15] == 2
    assert sum(conf.roundup_power2_divisions) == 10
    for unlimited in (-1, (1 << 64) - 1, (1 << 63) - 1):
        assert conf_from_snapshot({"allocator_settings": {"max_split_size": unlimited}}).max_split_size_bytes is None
    assert conf_from_snapshot({"allocator_settings": {"max_split_size": 128 * MiB}}).max_split_size_bytes == 128 * MiB


def test_settings_list_int_and_absent():
    assert conf_from_snapshot({"allocator_settings": {"roundup_power2_divisions": [4] * 16}}).roundup_power2_divisions == (4,) * 16
    assert conf_from_snapshot({"allocator_settings": {"roundup_power2_divisions": 2}}).roundup_power2_divisions == (2,) * 16
    conf = conf_from_snapshot({"segments": [], "device_traces": []})
    assert conf == AllocConf() and "no allocator_settings" in conf.notes[0]
    conf = conf_from_snapshot({"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "max_non_split_rounding_mb:64",
                                                      "expandable_segments": True}})
    assert conf.max_non_split_rounding_bytes == 64 * MiB and conf.expandable_segments
    with pytest.raises(MemfitError, match="`3`"):
        conf_from_snapshot({"allocator_settings": {"roundup_power2_divisions": {"3": 1}}})


def test_recorded_settings_are_used():
    # the same workload recorded with divisions 4 replays exactly only with them
    settings = {"max_split_size": -1, "roundup_power2_divisions": dict(DIVS_DICT, **{"1": 4, "2": 4, "4": 4})}
    snap, _ = record(AllocConf(roundup_power2_divisions=(4, 4, 4) + (0,) * 13), seed=3, settings=settings)
    _exact(snap)
    # sizes rounded differently: no start state holds the layout; replayed with it forced, and said so
    r = replay_snapshot(snap, conf=AllocConf())
    assert not r.exact and r.search.forced and not r.search.consistent
    assert r.search.allocated_uncertainty_bytes > 0
    assert any("no start state the final segments allow holds the whole recording" in n for n in r.notes)


def test_max_split_size_with_oom_retry():
    # max_split_size_mb:64 and a 1 GiB device: release_available_cached_blocks frees oversize
    # blocks before the full release_cached_blocks; OOMs are caught and the run goes on
    conf = AllocConf(max_split_size_bytes=64 * MiB)
    snap, m = record(conf, seed=5, n=4000, capacity=1024 * MiB, settings={"max_split_size": 64 * MiB},
                     big=True, free_p=0.5)
    trace = snap["device_traces"][0]
    assert sum(e["action"] == "oom" for e in trace) > 0 and m.n_retries > 0
    assert all("device_free" in e and "addr" not in e for e in trace if e["action"] == "oom")
    _exact(snap)


def test_ooms_without_split_limit():
    snap, _ = record(AllocConf(), seed=6, n=4000, capacity=1024 * MiB, big=True, free_p=0.5)
    assert sum(e["action"] == "oom" for e in snap["device_traces"][0]) > 0
    _exact(snap)


# -- streams -------------------------------------------------------------------------------------
def test_several_streams_with_record_stream():
    snap, m = record(AllocConf(), seed=7, n=5000, streams=(0, 94_000_000_001, 94_000_000_002), cross_stream=0.3)
    trace = snap["device_traces"][0]
    assert len({e["stream"] for e in trace}) == 3
    # some frees complete long after they were requested
    requested = {e["addr"]: i for i, e in enumerate(trace) if e["action"] == "free_requested"}
    assert any(e["action"] == "free_completed" and i - requested.get(e["addr"], i) > 1 for i, e in enumerate(trace))
    assert m.pending  # some still wait at the end: `active_pending_free` blocks in the snapshot
    assert any(b["state"] == "active_pending_free" for s in snap["segments"] for b in s["blocks"])
    _exact(snap)


def test_streams_with_empty_cache_and_truncation():
    snap, _ = record(AllocConf(), seed=8, n=5000, streams=(0, 7), cross_stream=0.2, empty_every=700)
    trace = snap["device_traces"][0]
    assert any("frames" in e for e in trace)
    _exact(snap)
    for k in (1, 2, 57, 1000, 2222, len(trace) // 2):  # the ring buffer's oldest entries lost
        _exact(dict(snap, device_traces=[trace[k:]]))


# -- expandable segments ---------------------------------------------------------------------------
def test_expandable_segments():
    conf = AllocConf(expandable_segments=True)
    snap, _ = record(conf, seed=9, n=4000, empty_every=500, settings={"max_split_size": -1, "expandable_segments": True})
    trace = snap["device_traces"][0]
    actions = {e["action"] for e in trace}
    assert {"segment_map", "segment_unmap"} <= actions and "segment_alloc" not in actions
    assert any(s["is_expandable"] for s in snap["segments"])
    r = _exact(snap)
    assert r.recorded.segment_allocs == sum(e["action"] == "segment_map" for e in trace)


def test_expandable_segments_truncated_and_oom():
    conf = AllocConf(expandable_segments=True)
    snap, _ = record(conf, seed=10, n=4000, capacity=1024 * MiB, streams=(0, 3), big=True, free_p=0.5,
                     settings={"max_split_size": -1, "expandable_segments": True})
    trace = snap["device_traces"][0]
    assert any(e["action"] == "oom" for e in trace)
    # best fit counts the unmapped tail, whose size is 1 1/8 of the device memory
    assert not replay_snapshot(snap).exact
    _exact(snap, device_memory_bytes=1024 * MiB)
    # cut after the first pages were mapped: the segments exist at the start of the recording
    first_alloc = next(i for i, e in enumerate(trace) if e["action"] == "alloc")
    k = next(i for i in range(first_alloc + 200, len(trace)) if trace[i]["action"] == "alloc")
    st = start_state(dict(snap, device_traces=[trace[k:]]))
    assert st.expandable
    _exact(dict(snap, device_traces=[trace[k:]]), device_memory_bytes=1024 * MiB)


# -- what-if --------------------------------------------------------------------------------------
def test_what_if_changes_only_the_settings():
    snap, _ = record(AllocConf(), seed=11, n=3000, settings={"max_split_size": -1})
    base = what_if(snap, None)
    again = what_if(snap, "max_split_size_mb:4096")  # no block that large: the same run
    assert (again.peak_reserved_bytes, again.segment_allocs) == (base.peak_reserved_bytes, base.segment_allocs)
    exp = what_if(snap, "expandable_segments:True")
    assert exp.peak_reserved_bytes != base.peak_reserved_bytes
    assert exp.peak_allocated_bytes <= base.peak_allocated_bytes  # blocks are split to the request


def test_cli_gpu_sets_the_expandable_address_space(tmp_path, capsys):
    import pickle

    from memfit.cli import main

    conf = AllocConf(expandable_segments=True)
    snap, _ = record(conf, seed=10, n=4000, capacity=1024 * MiB, streams=(0, 3), big=True, free_p=0.5,
                     settings={"max_split_size": -1, "expandable_segments": True})
    path = tmp_path / "exp.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["replay", str(path)]) == 1
    assert "give it (--gpu)" in capsys.readouterr().out
    assert main(["replay", str(path), "--gpu", "1GiB"]) == 0
    assert "exact: the same" in capsys.readouterr().out
