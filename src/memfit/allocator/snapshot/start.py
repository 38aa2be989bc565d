"""The allocator's state when the first recorded entry of a snapshot's trace happened.

The trace is a ring buffer (`TraceEntryRingBuffer`, `max_entries`): recording often
starts, or its oldest entries were overwritten, after memory was allocated. The state at
the first recorded entry is reconstructed from the final `segments` (with their blocks)
by undoing the trace backwards; blocks that were allocated before the recording and freed
in it get `round_size(requested)` bytes (plus the tail a large-pool block keeps when the
remainder was too small to split: every cached large-pool block is > 1 MiB, see
`should_split`).

One case the final segments leave open: a block allocated before the recording, freed
in it, and followed by a cached gap of more than 1 MiB. Its size is its rounded request
plus a tail of 0 to 1 MiB (a tail stays in the block when, at its allocation, the memory
after it was taken by a block freed before the recording). `StartState.open_sizes` lists
those blocks with the sizes they can have; `block_sizes` picks one
(`memfit.allocator.snapshot.recorded` searches them against the trace).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.allocator.caching import _DEFAULT_VA_BYTES as _DEFAULT_VA
from memfit.allocator.caching import (
    K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE, AllocatorModel, Block, round_size,
)
from memfit.allocator.conf import AllocConf
from memfit.allocator.snapshot.read import (
    _KNOWN_ACTIONS, _Entry, _entries, _final_segments, conf_from_snapshot,
)
from memfit.errors import MemfitError

__all__ = ["StartState", "start_state"]


@dataclass
class _Seg:
    addr: int
    size: int
    stream: int
    small: bool


@dataclass(frozen=True)
class StartState:
    """What the allocator held when the first recorded entry happened."""

    #: (address, bytes, stream, small pool) of the cudaMalloc'd segments
    segments: tuple[tuple[int, int, int, bool], ...]
    #: (address, bytes, state `allocated` | `pending`, requested bytes) of the live blocks
    blocks: tuple[tuple[int, int, str, int], ...]
    #: expandable segments: (base, stream, small pool, ((address, bytes), ...) mapped ranges)
    expandable: tuple[tuple[int, int, bool, tuple[tuple[int, int], ...]], ...]
    reserved_bytes: int
    allocated_bytes: int
    inferred_sizes: int  #: blocks whose size came from the request (freed in the trace, allocated before)
    notes: tuple[str, ...] = ()
    #: (address, smallest, largest bytes) of the blocks whose size the final segments leave open
    open_sizes: tuple[tuple[int, int, int], ...] = ()


def start_state(snapshot: Mapping[str, Any], *, device: int = 0, conf: AllocConf | None = None,
                device_memory_bytes: int | None = None, block_sizes: Mapping[int, int] | None = None) -> StartState:
    """Undo the device trace from the final `segments` back to its first entry.

    Args:
        snapshot: the snapshot dict.
        device: which device.
        conf: the allocator settings (default: the recorded ones); they set block sizes.
        device_memory_bytes: the GPU's memory, which sets an expandable segment's address range.
        block_sizes: {address: bytes} for blocks of `open_sizes` (a size outside the block's range is
            clipped to it); the others get their smallest size.
    """
    conf = conf if conf is not None else conf_from_snapshot(snapshot)
    entries = _entries(snapshot, device)
    notes: list[str] = []
    segs: dict[int, _Seg] = {}
    live: dict[int, list[Any]] = {}  # addr -> [size | None, requested, stream, state]
    pages: dict[tuple[int, bool], set[int]] = {}  # expandable: (stream, small) -> mapped page addresses
    seen_at: dict[tuple[int, bool], list[int]] = {}  # expandable: addresses the trace maps / unmaps
    pool_ids = set()
    for s in _final_segments(snapshot, device):
        try:
            addr, total, stream = int(s["address"]), int(s["total_size"]), int(s.get("stream", 0) or 0)
        except (KeyError, TypeError, ValueError):
            raise MemfitError(f"segment `{dict(s)!r:.100}` lacks an integer address/total_size; "
                              "the snapshot is damaged") from None
        small = s.get("segment_type") == "small" if "segment_type" in s else total == K_SMALL_BUFFER
        pool_ids.add(tuple(s.get("segment_pool_id") or (0, 0)))
        if s.get("is_expandable"):
            page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
            pages.setdefault((stream, small), set()).update(range(addr, addr + total, page))
        else:
            segs[addr] = _Seg(addr, total, stream, small)
        for b in s.get("blocks") or []:
            state = b.get("state")
            if state in ("active_allocated", "active_pending_free"):
                live[int(b["address"])] = [int(b["size"]), int(b.get("requested_size", b["size"])), stream,
                                           "allocated" if state == "active_allocated" else "pending"]
    if pool_ids - {(0, 0)}:
        notes.append(f"segments of CUDA-graph private pools {sorted(pool_ids - {(0, 0)})} are replayed as the "
                     "default pool (private pools are not modelled)")

    def _missing(e: _Entry, what: str) -> MemfitError:
        return MemfitError(f"device trace entry {e.index} (`{e.action}` at `{e.addr:#x}`) {what}; the trace and "
                           "the final segments disagree (a snapshot of another device or a damaged file)")

    next_alloc_small: dict[int, bool] = {}  # entry index -> whether the next alloc after it is small
    small_next = False
    for e in reversed(entries):
        if e.action == "alloc":
            small_next = round_size(e.size, conf) <= K_SMALL_SIZE
        elif e.action == "oom":
            small_next = e.size <= K_SMALL_SIZE
        next_alloc_small[e.index] = small_next
    for e in reversed(entries):
        a = e.action
        if a == "alloc":
            b = live.pop(e.addr, None)
            if b is None or b[3] != "allocated":
                raise _missing(e, "allocates a block that is not live afterwards")
        elif a == "free_requested":
            b = live.get(e.addr)
            if b is None or b[3] != "pending":
                raise _missing(e, "frees a block that is not waiting to be freed afterwards")
            b[3] = "allocated"
        elif a == "free_completed":
            if e.addr in live:
                raise _missing(e, "returns a block to the cache that is still live afterwards")
            live[e.addr] = [None, e.size, e.stream, "pending"]
        elif a == "segment_alloc":
            if segs.pop(e.addr, None) is None:
                raise _missing(e, "creates a segment that does not exist afterwards")
        elif a == "segment_free":
            segs[e.addr] = _Seg(e.addr, e.size, e.stream, e.size == K_SMALL_BUFFER)
        elif a in ("segment_map", "segment_unmap"):
            small = next_alloc_small[e.index] if a == "segment_map" else _unmap_pool(pages, e)
            page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
            got = pages.setdefault((e.stream, small), set())
            seen_at.setdefault((e.stream, small), []).append(e.addr)
            rng = set(range(e.addr, e.addr + e.size, page))
            if a == "segment_map":
                got -= rng
            else:
                got |= rng
        elif a not in _KNOWN_ACTIONS:
            notes.append(f"unknown trace action `{a}` (entry {e.index}) ignored")
    # sizes of the blocks allocated before the recording and freed in it
    seg_list = sorted(segs.values(), key=lambda s: s.addr)
    starts = [s.addr for s in seg_list]
    live_addrs = sorted(live)
    inferred = 0
    open_sizes: list[tuple[int, int, int]] = []
    chosen = dict(block_sizes or {})
    for i, addr in enumerate(live_addrs):
        b = live[addr]
        if b[0] is not None:
            continue
        inferred += 1
        j = bisect_right(starts, addr) - 1
        seg = seg_list[j] if j >= 0 and addr < seg_list[j].addr + seg_list[j].size else None
        rounded = round_size(b[1], conf)
        if seg is None:  # in an expandable segment: split whenever >= 512 B remain
            b[0] = rounded
            continue
        end = seg.addr + seg.size
        nxt = live_addrs[i + 1] if i + 1 < len(live_addrs) and live_addrs[i + 1] < end else end
        gap = nxt - addr - rounded
        if gap < 0:
            raise MemfitError(f"block at `{addr:#x}` ({b[1]} B requested) overlaps the next block or its segment's "
                              "end; the trace and the final segments disagree")
        unsplittable = rounded >= conf.max_split_size_effective
        if seg.small or gap == 0:
            b[0] = rounded
        elif gap <= K_SMALL_SIZE or (unsplittable and gap < conf.max_non_split_rounding_bytes):
            b[0] = rounded + gap  # should_split: the remainder stayed in the block
        else:
            # a tail t <= 1 MiB stayed in the block; the cached rest after it, gap - t, is > 1 MiB
            largest = rounded + min(K_SMALL_SIZE, gap - K_SMALL_SIZE - K_MIN_BLOCK_SIZE)
            open_sizes.append((addr, rounded, largest))
            b[0] = min(max(chosen.get(addr, rounded), rounded), largest)
    blocks = tuple(sorted((addr, b[0], b[3], b[1]) for addr, b in live.items()))
    expandable = []
    for (stream, small), got in sorted(pages.items()):
        if not got:
            continue
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        ranges: list[tuple[int, int]] = []
        for p in sorted(got):
            if ranges and ranges[-1][0] + ranges[-1][1] == p:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + page)
            else:
                ranges.append((p, page))
        # the segment starts at or below its lowest page: a lower page the trace maps or
        # unmaps within one address range of the pages is in the same segment
        span = _va_bytes(device_memory_bytes) or _DEFAULT_VA
        top = max(got) + page
        base = min([min(got)] + [a for a in seen_at.get((stream, small), []) if top - span <= a < min(got)])
        expandable.append((base, stream, small, tuple(ranges)))
    reserved = sum(s.size for s in seg_list) + sum(r[1] for x in expandable for r in x[3])
    allocated = sum(b[1] for b in blocks if b[2] == "allocated")
    return StartState(
        segments=tuple((s.addr, s.size, s.stream, s.small) for s in seg_list), blocks=blocks,
        expandable=tuple(expandable), reserved_bytes=reserved, allocated_bytes=allocated,
        inferred_sizes=inferred, notes=tuple(notes), open_sizes=tuple(open_sizes),
    )


def _unmap_pool(pages: dict[tuple[int, bool], set[int]], e: _Entry) -> bool:
    for (stream, small), got in pages.items():
        if stream == e.stream and e.addr in got:
            return small
    return e.size % K_LARGE_BUFFER != 0


def _seed(model: AllocatorModel, st: StartState) -> dict[int, Block]:
    """Put the start state into `model`; returns its live and pending blocks by address."""
    by_seg: dict[int, list[tuple[int, int, str, int]]] = {s[0]: [] for s in st.segments}
    seg_size = {s[0]: s[1] for s in st.segments}
    seg_starts = sorted(by_seg)
    exp_blocks: list[tuple[int, int, str, int]] = []
    for b in st.blocks:
        j = bisect_right(seg_starts, b[0]) - 1
        if j >= 0 and b[0] < seg_starts[j] + seg_size[seg_starts[j]]:
            by_seg[seg_starts[j]].append(b)
        else:
            exp_blocks.append(b)
    out: dict[int, Block] = {}
    for addr, size, stream, small in st.segments:
        for blk in model.add_segment(addr, size, stream, small, by_seg[addr]):
            out[blk.ptr] = blk
    for base, stream, small, ranges in st.expandable:
        rs = [(p, n, [b for b in exp_blocks if p <= b[0] < p + n]) for p, n in ranges]
        for blk in model.add_expandable_segment(base, stream, small, rs):
            out[blk.ptr] = blk
    return out


def _va_bytes(device_memory_bytes: int | None) -> int | None:
    # ExpandableSegment: address space for totalGlobalMem + totalGlobalMem / 8
    return device_memory_bytes + device_memory_bytes // 8 if device_memory_bytes else None
