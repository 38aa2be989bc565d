"""Allocator scenarios derived by hand from c10/cuda/CUDACachingAllocator.cpp rules."""

import random

import pytest

from memfit.allocator.conf import AllocConf
from memfit.allocator import AllocatorModel, Driver, get_allocation_size, replay, replay_snapshot, round_size
from memfit.errors import MemfitError
from memfit.trace import TraceEvent
from memfit.units import KiB, MiB


def A(i, n, phase="setup"):
    return TraceEvent("alloc", i, n, phase=phase)


def F(i, phase="setup"):
    return TraceEvent("free", i, 0, phase=phase)


EMPTY = TraceEvent("empty_cache", -1, 0)


def test_round_size_and_pools():
    assert round_size(1) == 512  # < kMinBlockSize -> 512
    assert round_size(513) == 1024  # next multiple of 512
    assert round_size(MiB) == MiB  # still the small pool (<= kSmallSize)
    assert round_size(MiB + 1) == MiB + 512  # large pool
    assert get_allocation_size(MiB) == 2 * MiB  # kSmallBuffer
    assert get_allocation_size(MiB + 512) == 20 * MiB  # kLargeBuffer for 1..10 MiB
    assert get_allocation_size(12 * MiB) == 12 * MiB  # >= kMinLargeAlloc: rounded to 2 MiB
    assert get_allocation_size(11 * MiB) == 12 * MiB


def test_roundup_power2_divisions():
    conf = AllocConf(roundup_power2_divisions=4)
    # 3 MiB + 1: floor pow2 = 2 MiB, step = 2 MiB >> log2(4) = 512 KiB -> 3.5 MiB
    assert round_size(3 * MiB + 1, conf) == 3 * MiB + 512 * KiB
    assert round_size(4 * MiB, conf) == 4 * MiB  # powers of two stay
    assert round_size(1200, conf) == 1536  # 1200 <= 512 * 4: plain 512 rounding


def test_one_byte_gets_a_small_segment():
    r = replay([A(1, 1)])
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.num_cudamalloc) == (512, 2 * MiB, 1)


def test_small_blocks_share_a_2mib_segment():
    # 100 x 1000 B -> 1024 B blocks, all split off one 2 MiB segment (remainder >= 512)
    r = replay([A(i, 1000) for i in range(100)])
    assert r.peak_allocated_bytes == 100 * 1024
    assert r.peak_reserved_bytes == 2 * MiB
    assert r.num_cudamalloc == 1
    # 3 x 1 MiB: first splits a 2 MiB segment (1 MiB left), second takes the rest exactly,
    # third needs a new segment -> 4 MiB reserved, 2 cudaMalloc
    r = replay([A(i, MiB) for i in range(3)])
    assert (r.peak_reserved_bytes, r.num_cudamalloc) == (4 * MiB, 2)


def test_mid_size_request_packs_a_20mib_segment():
    # 5 MiB -> 20 MiB segment, split (15 MiB left > kSmallSize); the second 5 MiB reuses it
    r = replay([A(1, 5 * MiB), A(2, 5 * MiB)])
    assert r.peak_reserved_bytes == 20 * MiB
    assert r.peak_allocated_bytes == 10 * MiB
    assert r.num_cudamalloc == 1
    assert r.fragmentation_at_peak_bytes == 10 * MiB


def test_large_request_gets_its_own_segment():
    r = replay([A(1, 12 * MiB)])
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (12 * MiB, 12 * MiB)
    # 11 MiB -> 12 MiB segment; remainder 1 MiB is not > kSmallSize, so the block stays
    # whole and memory_allocated counts all 12 MiB
    r = replay([A(1, 11 * MiB)])
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (12 * MiB, 12 * MiB)


def test_split_and_merge():
    # A, B = 5 MiB each at the start of one 20 MiB segment; freeing both merges the segment
    # back into one 20 MiB block, which then serves 18 MiB (split, 2 MiB > 1 MiB left)
    r = replay([A(1, 5 * MiB), A(2, 5 * MiB), F(1), F(2), A(3, 18 * MiB)])
    assert r.num_cudamalloc == 1
    assert r.final_reserved_bytes == 20 * MiB
    assert r.final_allocated_bytes == 18 * MiB


def test_best_fit_picks_smallest_adequate_block():
    ev = [A(1, 12 * MiB), A(2, 14 * MiB), A(3, 16 * MiB), F(1), F(2), F(3)]
    # 11 MiB -> the 12 MiB block (not 14 or 16); 1 MiB left is not split off
    r = replay(ev + [A(4, 11 * MiB)])
    assert r.final_allocated_bytes == 12 * MiB and r.num_cudamalloc == 3
    # then 13 MiB -> the 14 MiB block
    r = replay(ev + [A(4, 11 * MiB), A(5, 13 * MiB)])
    assert r.final_allocated_bytes == 26 * MiB and r.num_cudamalloc == 3


def test_max_split_size_oversize_blocks():
    conf = AllocConf(max_split_size_bytes=20 * MiB)
    # a 30 MiB cached block is oversize: a 5 MiB request may not take it -> new 20 MiB segment
    r = replay([A(1, 30 * MiB), F(1), A(2, 5 * MiB)], conf=conf)
    assert (r.final_reserved_bytes, r.num_cudamalloc) == (50 * MiB, 2)
    # 25 MiB >= max_split takes it (30 < 25 + 20) and it is not split: 30 MiB allocated
    r = replay([A(1, 30 * MiB), F(1), A(2, 25 * MiB)], conf=conf)
    assert (r.final_allocated_bytes, r.num_cudamalloc) == (30 * MiB, 1)
    # a 60 MiB block is too big for 30 MiB (60 >= 30 + kLargeBuffer) -> new segment
    r = replay([A(1, 60 * MiB), F(1), A(2, 30 * MiB)], conf=conf)
    assert (r.final_reserved_bytes, r.num_cudamalloc) == (90 * MiB, 2)
    # without max_split the 30 MiB block is split for 5 MiB (25 MiB left > 1 MiB)
    r = replay([A(1, 30 * MiB), F(1), A(2, 5 * MiB)])
    assert (r.final_reserved_bytes, r.num_cudamalloc) == (30 * MiB, 1)


def test_oom_retry_releases_cached_segments():
    # 30 MiB cached in the large pool; a 1 KiB request needs a 2 MiB small segment:
    # 30 + 2 > 31 MiB -> cudaMalloc fails -> release_cached_blocks frees the 30 MiB
    # segment (unsplit) -> the retry succeeds
    r = replay([A(1, 30 * MiB), F(1), A(2, KiB)], capacity_bytes=31 * MiB)
    assert r.oom is None
    assert (r.final_reserved_bytes, r.num_cudafree, r.num_alloc_retries, r.num_cudamalloc) == (2 * MiB, 1, 1, 2)


def test_release_available_cached_blocks_with_max_split():
    # oversize 30 MiB cached; 5 MiB needs a 20 MiB segment; 30 + 20 > 40 -> cudaMalloc fails;
    # release_available_cached_blocks frees the 30 MiB block (>= max(5, 20) MiB) -> success,
    # and no "retry" is counted (that is only the release_cached_blocks path)
    r = replay([A(1, 30 * MiB), F(1), A(2, 5 * MiB)], conf=AllocConf(max_split_size_bytes=20 * MiB),
               capacity_bytes=40 * MiB)
    assert r.oom is None
    assert (r.final_reserved_bytes, r.num_alloc_retries, r.num_cudafree) == (20 * MiB, 0, 1)


def test_genuine_oom_reports_rounded_segment_size():
    ev = [A(1, 30 * MiB), TraceEvent("alloc", 2, 5 * MiB, category="activations", phase="forward", module="l.0")]
    r = replay(ev, capacity_bytes=45 * MiB)
    assert r.oom is not None
    # "Tried to allocate" prints alloc_size: a 5 MiB request wants a 20 MiB segment
    assert r.oom.tried_to_allocate_bytes == 20 * MiB
    assert r.oom.requested_bytes == 5 * MiB
    assert (r.oom.event_index, r.oom.phase, r.oom.category, r.oom.module) == (1, "forward", "activations", "l.0")
    assert (r.oom.allocated_bytes, r.oom.reserved_bytes, r.oom.free_bytes) == (30 * MiB, 30 * MiB, 15 * MiB)
    r = replay([A(1, 30 * MiB), A(2, 12 * MiB)], capacity_bytes=40 * MiB)
    assert r.oom is not None and r.oom.tried_to_allocate_bytes == 12 * MiB


def _growing_batches():
    ev = [A(i, 30 * MiB) for i in range(10)] + [F(i) for i in range(10)]
    return ev + [A(100 + i, 32 * MiB) for i in range(10)]


def test_expandable_segments_reduce_fragmentation():
    # native: 10 x 30 MiB segments stay cached but cannot hold 32 MiB -> 10 new 32 MiB
    # segments: 300 + 320 = 620 MiB reserved with 320 MiB allocated
    r = replay(_growing_batches())
    assert (r.peak_reserved_bytes, r.num_cudamalloc, r.fragmentation_at_peak_bytes) == (620 * MiB, 20, 300 * MiB)
    # expandable: one segment of 20 MiB pages. 30 MiB allocations alternate between mapping
    # 2 pages (40 MiB, 10 left) and 1 page (10 + 20 = 30) -> 300 MiB in 10 maps. Freed, they
    # merge into one 300 MiB block that holds 9 x 32 MiB; the 10th uses the 12 MiB tail plus
    # one more page -> 320 MiB reserved, 11 mappings, no fragmentation.
    r = replay(_growing_batches(), conf=AllocConf(expandable_segments=True))
    assert (r.peak_reserved_bytes, r.num_cudamalloc, r.fragmentation_at_peak_bytes) == (320 * MiB, 11, 0)
    r = replay(_growing_batches() + [F(100 + i) for i in range(10)] + [EMPTY],
               conf=AllocConf(expandable_segments=True))
    assert r.final_reserved_bytes == 0  # empty_cache unmaps every free page


def test_expandable_oom_needs_pages():
    # 30 MiB in 20 MiB pages needs 40 MiB mapped
    r = replay([A(1, 30 * MiB)], conf=AllocConf(expandable_segments=True), capacity_bytes=39 * MiB)
    assert r.oom is not None and r.oom.tried_to_allocate_bytes == 30 * MiB


def test_empty_cache_frees_only_unsplit_segments():
    # 5 MiB keeps its 20 MiB segment split; the 30 MiB and the small segment are whole again
    ev = [A(1, 5 * MiB), A(2, KiB), A(3, 30 * MiB), F(2), F(3), EMPTY]
    r = replay(ev)
    assert (r.final_reserved_bytes, r.num_cudafree) == (20 * MiB, 2)


def test_per_phase_peaks():
    r = replay([A(1, 12 * MiB, "forward"), A(2, 12 * MiB, "forward"), F(2, "backward"), F(1, "backward"),
                A(3, 2 * MiB, "optimizer")])
    assert r.peak_reserved_by_phase == {"forward": 24 * MiB, "backward": 24 * MiB, "optimizer": 24 * MiB}
    assert r.peak_allocated_by_phase == {"forward": 24 * MiB, "optimizer": 2 * MiB}
    assert r.reserved_at_peak_allocated_bytes == 24 * MiB


def test_zero_byte_and_bad_traces():
    r = replay([A(1, 0), F(1)])
    assert r.peak_reserved_bytes == 0
    with pytest.raises(MemfitError, match="`7`"):
        replay([F(7)])
    with pytest.raises(MemfitError, match="`1`"):
        replay([A(1, 10), A(1, 10)])


def _toy_snapshot():
    # P: 1000 B allocated before recording in small segment S; B: a 20 MiB segment made,
    # used and emptied during recording; A: 12 MiB allocated at the end
    S, B, A = 0x10000000, 0x20000000, 0x30000000
    trace = [
        {"action": "segment_alloc", "addr": B, "size": 20 * MiB},
        {"action": "alloc", "addr": B, "size": 5 * MiB},
        {"action": "free_requested", "addr": B, "size": 5 * MiB},
        {"action": "free_completed", "addr": B, "size": 5 * MiB},
        {"action": "segment_free", "addr": B, "size": 20 * MiB,  # torch.cuda.empty_cache()
         "frames": [{"name": "NativeCachingAllocator::emptyCache()", "filename": "", "line": 0}]},
        {"action": "free_requested", "addr": S, "size": 1000},
        {"action": "free_completed", "addr": S, "size": 1000},
        {"action": "segment_alloc", "addr": A, "size": 12 * MiB},
        {"action": "alloc", "addr": A, "size": 12 * MiB},
    ]
    segments = [
        {"device": 0, "address": S, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "blocks": [{"address": S, "size": 2 * MiB, "requested_size": 1000, "state": "inactive"}]},
        {"device": 0, "address": A, "total_size": 12 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"address": A, "size": 12 * MiB, "requested_size": 12 * MiB, "state": "active_allocated"}]},
    ]
    return {"device_traces": [trace], "segments": segments}


def test_snapshot_replay_from_the_start_state():
    snap = _toy_snapshot()
    out = replay_snapshot(snap)  # the exact replay from the reconstructed start state
    assert out.start.blocks == ((0x10000000, 1024, "allocated", 1000),)  # round_size(1000), before recording
    assert out.start.reserved_bytes == 2 * MiB
    assert out.report.peak_reserved_bytes == 22 * MiB  # S + B
    assert out.report.final_reserved_bytes == 14 * MiB  # S + A
    assert out.observed_peak_reserved_bytes == 22 * MiB
    assert out.observed_num_cudamalloc == 2 and out.report.num_cudamalloc == 2
    assert out.exact
    with pytest.raises(MemfitError, match="no trace for device `0`"):
        replay_snapshot({"device_traces": [], "segments": []})


def test_import_snapshot_module_first():
    # allocator_snapshot imports allocator; the old names stay importable from memfit.allocator
    import subprocess
    import sys

    code = ("import memfit.allocator.snapshot as s; import memfit.allocator as a; "
            "assert a.replay_snapshot is s.replay_snapshot; assert a.SnapshotReplay is s.SnapshotReplay")
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ})


def test_blocks_are_reused_only_on_their_stream():
    # BlockComparatorSize compares the stream first: a block freed on stream 1 is not found
    # by a request on stream 0, which cudaMallocs its own 20 MiB segment
    m = AllocatorModel()
    b1, _ = m.malloc(5 * MiB, stream=1)
    base1 = b1.ptr
    m.free(b1)
    b0, _ = m.malloc(5 * MiB, stream=0)
    assert (m.n_malloc, m.reserved) == (2, 40 * MiB)
    b2, _ = m.malloc(5 * MiB, stream=1)
    assert b2.ptr == base1 and m.n_malloc == 2  # stream 1 gets its cached segment back
    assert b0.stream == 0 and b2.stream == 1


def test_block_waiting_for_stream_events_is_not_reused_or_merged():
    # free() of a block used on another stream (record_stream): allocated drops at once,
    # the block returns to the pool only at free_completed (process_events)
    m = AllocatorModel()
    a, _ = m.malloc(5 * MiB)
    base = a.ptr
    m.free_requested(a)
    assert (m.allocated, m.reserved) == (0, 20 * MiB)
    b, _ = m.malloc(5 * MiB)
    assert b.ptr == base + 5 * MiB  # the 15 MiB remainder, not a's memory
    m.free(b)  # b merges with the 10 MiB remainder after it, not with a (still pending)
    assert sorted(x.size for x in m.large.blocks.values()) == [15 * MiB]
    m.free_completed(a)
    assert sorted(x.size for x in m.large.blocks.values()) == [20 * MiB]  # whole again


def test_empty_cache_waits_for_stream_events():
    # release_cached_blocks -> synchronize_and_free_events first: the pending block returns
    # to the pool and its (now whole) segment is cudaFree'd
    m = AllocatorModel()
    a, _ = m.malloc(30 * MiB)
    m.free_requested(a)
    m.empty_cache()
    assert (m.reserved, m.n_free, m.pending) == (0, 1, {})


class _DownDriver(Driver):
    """cudaMalloc hands out decreasing addresses: the later segment is the lower one."""

    def __init__(self):
        super().__init__(None)
        self.next_ptr = 1 << 40

    def cuda_malloc(self, size, reserved):
        self.next_ptr -= size
        return self.next_ptr


def test_best_fit_ties_are_broken_by_address_not_age():
    # two cached 12 MiB segments: get_free_block's lower_bound takes the lower address
    m = AllocatorModel(driver=_DownDriver())
    first, _ = m.malloc(12 * MiB)
    second, _ = m.malloc(12 * MiB)
    assert second.ptr < first.ptr
    low = second.ptr
    m.free(second)
    m.free(first)
    again, _ = m.malloc(12 * MiB)
    assert again.ptr == low


def test_model_reports_trace_entries_as_torch_records_them():
    seen = []
    m = AllocatorModel(driver=Driver(30 * MiB), on_event=lambda *e: seen.append(e))
    b, _ = m.malloc(12 * MiB)
    m.free(b)
    assert m.malloc(40 * MiB)[0] is None
    base = b.ptr
    assert seen == [
        ("segment_alloc", base, 12 * MiB, 0), ("alloc", base, 12 * MiB, 0),
        ("free_requested", base, 12 * MiB, 0), ("free_completed", base, 12 * MiB, 0),
        # the OOM path: cudaMalloc fails, release_cached_blocks frees the cached segment,
        # the retry fails too; `oom` carries the free device bytes and the rounded size
        ("segment_free", base, 12 * MiB, 0), ("oom", 30 * MiB, 40 * MiB, 0),
    ]


def test_replays_200k_events():
    """A long random trace (its speed is bench/speed_vs_memtracker.py's): every event counted, and what stays
    allocated at the end is the rounded size of each block still live."""
    rng = random.Random(0)
    events, live, nid, sizes = [], [], 0, {}
    while len(events) < 200_000:
        if live and rng.random() < 0.5:
            events.append(F(live.pop(rng.randrange(len(live)))))
        else:
            size = rng.choice((rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 64 * MiB)))
            events.append(A(nid, size))
            live.append(nid)
            sizes[nid] = size
            nid += 1
    r = replay(events)
    assert r.num_events == 200_000
    # a cached block is split only when the rest is a usable block (CUDACachingAllocator.cpp `shouldSplit`: at least
    # kMinBlockSize = 512 B in the small pool, more than kSmallSize = 1 MiB in the large), so a block may hold up to
    # 511 B / 1 MiB more than its rounded request
    rounded = [round_size(sizes[i]) for i in live]
    slack = sum(511 if b <= MiB else MiB for b in rounded)
    assert sum(rounded) <= r.final_allocated_bytes <= sum(rounded) + slack
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes >= r.final_allocated_bytes


def test_garbage_collection_needs_a_memory_fraction():
    # two cached 30 MiB segments; a 40 MiB request misses. With allowed = 100 MiB and
    # threshold 0.5, reserved 60 > 50 MiB triggers garbage_collect_cached_blocks: both
    # blocks have age 1 (one get_free_block call since they were cached) >= mean age 1,
    # so both are freed before the cudaMalloc -> 40 MiB reserved.
    ev = [A(1, 30 * MiB), A(2, 30 * MiB), F(1), F(2), A(3, 40 * MiB)]
    gc = AllocConf(garbage_collection_threshold=0.5)
    r = replay(ev, conf=gc, allowed_bytes=100 * MiB)
    assert (r.final_reserved_bytes, r.num_cudafree) == (40 * MiB, 2)
    # as in PyTorch, the threshold does nothing without set_per_process_memory_fraction
    r = replay(ev, conf=gc)
    assert (r.final_reserved_bytes, r.num_cudafree) == (100 * MiB, 0)
    # the fraction is also a hard cap: 30 + 30 live > 50 MiB allowed -> OOM
    r = replay([A(1, 30 * MiB), A(2, 30 * MiB)], allowed_bytes=50 * MiB)
    assert r.oom is not None and r.oom.capacity_bytes == 50 * MiB


def _reserved_step_by_step(trace, conf, capacity_bytes):
    """memory_reserved() after each event, the model driven one call at a time (the reference for `reserved_after`)."""
    m = AllocatorModel(conf, Driver(capacity_bytes))
    blocks, out = {}, []
    for ev in trace:
        if ev.action == "alloc" and ev.size_bytes:
            b, _ = m.malloc(ev.size_bytes)
            if b is None:
                out.append(m.reserved)
                return out
            blocks[ev.id] = b
        elif ev.action == "free" and ev.id in blocks:
            m.free(blocks.pop(ev.id))
        elif ev.action == "empty_cache":
            m.release_cached_blocks()
        out.append(m.reserved)
    return out


@pytest.mark.parametrize("conf", [AllocConf(), AllocConf(expandable_segments=True),
                                  AllocConf(max_split_size_bytes=64 * MiB)])
@pytest.mark.parametrize("capacity", [None, 1024 * MiB])
def test_reserved_after_is_memory_reserved_after_each_event(conf, capacity):
    """`replay(reserved_after=...)`: one value per event replayed (zero-byte requests and frees included), the last
    one at an OOM the cache as the failed request leaves it; the replay's report is the same with or without it."""
    rng = random.Random(1)
    trace, live, nid = [], [], 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            trace.append(F(live.pop(rng.randrange(len(live)))))
        elif rng.random() < 0.01:
            trace.append(EMPTY)
        else:
            nid += 1
            trace.append(A(nid, rng.choice([0, 100, 4 * KiB, 700 * KiB, 3 * MiB, 12 * MiB, 25 * MiB, 90 * MiB])))
            live.append(nid)
    series: list[int] = []
    with_series = replay(trace, conf=conf, capacity_bytes=capacity, reserved_after=series)
    assert with_series == replay(trace, conf=conf, capacity_bytes=capacity)
    assert series == _reserved_step_by_step(trace, conf, capacity)
    assert len(series) == with_series.num_events
    assert (with_series.oom is not None) == (capacity is not None and len(series) < len(trace))
    assert max(series) == with_series.peak_reserved_bytes
