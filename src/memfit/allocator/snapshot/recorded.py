"""The recording replayed at its own addresses, and the search for the start state it allows.

The recorded run puts every block where the trace says; only `should_split` (how big each
block is) is the model's, which gives the recorded `allocated` (the trace holds requested
sizes). It is also the test of a start state: a state that is not the real one sooner or
later meets an entry it cannot hold (an `alloc` at an address where no cached block
starts), raised by the model as `LayoutConflict`.

The final segments leave one thing open (memfit.allocator.snapshot.start): the size of a
block allocated before the recording, freed in it, with a cached gap of more than 1 MiB
after it; it is its rounded request plus a tail of 0 to 1 MiB. `search_start` starts
with every such block at its rounded request and, at each conflict, gives the open block
that precedes the conflicting address the tail that makes a cached block start there (the
only size that can: every cached large-pool block is > 1 MiB, so the gap cannot hold a
second free block): first all in one run that grows the blocks on the spot, then, should
the state so found still meet a conflict, one block per run, until the recording replays
or no open block explains the conflict. Then no state the data allow is exact: the state that got furthest is
replayed with the recorded layout forced at each entry it cannot hold (`carve_at`, or the
entry skipped), and the figures say how far they can be off.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memfit.allocator.caching import K_SMALL_SIZE, AllocatorModel, Block, Driver, LayoutConflict, round_size
from memfit.allocator.conf import AllocConf
from memfit.allocator.snapshot.read import _GROWS, _RELEASES, _SEGMENT_ACTIONS, _Entry
from memfit.allocator.snapshot.start import StartState, _seed, start_state
from memfit.units import format_bytes

__all__ = ["Recording", "StartSearch", "recorded_run", "search_start", "fresh_address"]


@dataclass(frozen=True)
class Recording:
    """The recording's figures, replayed at its own addresses."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    final_reserved_bytes: int
    final_allocated_bytes: int
    reserved_after: tuple[int, ...]  #: reserved bytes after every trace entry
    ops: tuple[tuple[int, tuple[str, int, int]], ...]  #: (entry index, (action, address, bytes)) of segment ops
    forced: tuple[int, ...] = ()  #: entries the start state could not hold: layout forced there
    skipped: tuple[int, ...] = ()  #: entries of those that could not be forced either (left out)
    forced_bytes: int = 0  #: the most the forced and skipped entries can move `allocated`

    @property
    def segment_allocs(self) -> int:
        return sum(op[1][0] in _GROWS for op in self.ops)

    @property
    def segment_frees(self) -> int:
        return sum(op[1][0] in _RELEASES for op in self.ops)


@dataclass(frozen=True)
class StartSearch:
    """How the start state was chosen among those the final segments allow."""

    open_blocks: int  #: blocks whose size the final segments leave open
    pinned: tuple[tuple[int, int], ...]  #: (address, bytes) of those whose size the trace fixed
    tries: int  #: start states replayed
    forced: tuple[int, ...]  #: trace entries no start state tried could hold (empty: one state holds all)
    skipped: tuple[int, ...]  #: of those, the entries left out
    #: how far the allocated figures can be off: the size range of each open block the trace did not fix,
    #: plus up to 1 MiB per forced entry and the rounded size of each skipped alloc
    allocated_uncertainty_bytes: int

    @property
    def consistent(self) -> bool:
        """One start state the final segments allow holds every recorded entry."""
        return not self.forced

    def notes(self) -> list[str]:
        out = []
        if self.open_blocks:
            fixed = ""
            if self.pinned:
                tails = sorted({n for _, n in self.pinned})
                sizes = ", ".join(format_bytes(t) for t in tails[:4]) + (", ..." if len(tails) > 4 else "")
                where = ", ".join(f"{a:#x}" for a, _ in self.pinned[:3]) + (", ..." if len(self.pinned) > 3 else "")
                fixed = (f"; the trace fixes {len(self.pinned)} of them ({self.tries} start states tried: blocks of "
                         f"{sizes} at {where})")
            rest = self.open_blocks - len(self.pinned)
            out.append(f"the final segments leave the size of {self.open_blocks} blocks allocated before the recording "
                       "and freed in it open (their rounded request plus a tail of up to 1 MiB)" + fixed
                       + (f"; {'the other ' if self.pinned else ''}{rest} get their rounded request" if rest else ""))
        if self.forced:
            out.append(
                f"no start state the final segments allow holds the whole recording (first: entry {self.forced[0]}); "
                f"replayed from the closest one with the recorded layout forced at {len(self.forced)} entries"
                + (f" ({len(self.skipped)} left out)" if self.skipped else "")
                + ": reserved memory and the segment operations are the recorded ones, and memfit's choices after "
                f"entry {self.forced[0]} start from a state the recording contradicts")
        if self.allocated_uncertainty_bytes:
            out.append(f"allocated figures can be off by up to {format_bytes(self.allocated_uncertainty_bytes)} "
                       "(block sizes neither the segments nor the trace fix)")
        return out


def fresh_address(entries: Sequence[_Entry], st: StartState) -> int:
    """An address above every recorded one: where segments the recording does not show are placed."""
    max_addr = max([e.addr for e in entries if e.action != "oom"] + [s[0] + s[1] for s in st.segments] + [1 << 32])
    return (max_addr + (1 << 40)) & ~((1 << 21) - 1)


def recorded_run(conf: AllocConf, st: StartState, entries: Sequence[_Entry], fresh_from: int, va: int | None,
                 *, forcing: bool = False, tails: dict[int, int] | None = None) -> Recording:
    """The recording replayed at its own addresses from `st`.

    Raises LayoutConflict (with `entry_index` set) at the first entry `st` cannot hold,
    unless `forcing`: then the layout is forced there and the entry recorded in `forced`.
    With `tails` (a dict), an `alloc` conflict that an open block still live from the start
    explains grows that block on the spot and goes on; `tails` gets {address: bytes} of each
    (the figures of such a run are not the recording's: replay the start state they give).
    """
    rec = AllocatorModel(conf, Driver(None, fresh_from), va_bytes=va)
    live = _seed(rec, st)
    seeded = dict(live) if tails is not None else {}
    open_sizes = {a: (lo, hi) for a, lo, hi in st.open_sizes}
    starts = sorted(open_sizes)
    reserved: list[int] = []
    peak_alloc, peak_res = rec.allocated, rec.reserved
    ops: list[tuple[int, tuple[str, int, int]]] = []
    forced: list[int] = []
    skipped: list[int] = []
    forced_bytes = 0
    for e in entries:
        a = e.action
        try:
            if a == "alloc":
                try:
                    live[e.addr] = rec.malloc_at(e.size, e.stream, e.addr)
                except LayoutConflict:
                    if tails is None or not _grow_tail(rec, live, seeded, starts, open_sizes, e.addr, tails):
                        raise
                    live[e.addr] = rec.malloc_at(e.size, e.stream, e.addr)
                peak_alloc = max(peak_alloc, rec.allocated)
            elif a == "free_requested":  # (a block is missing only where its alloc was left out)
                b = live.get(e.addr)
                if b is not None:
                    rec.free_requested(b)
            elif a == "free_completed":
                b = live.pop(e.addr, None)
                if b is not None:
                    rec.free_completed(b)
            elif a == "segment_alloc":
                rec.segment_alloc_at(e.addr, e.size, e.stream)
            elif a == "segment_free":
                rec.segment_free_at(e.addr, e.size)
            elif a == "segment_map":
                if rec.free_at.get(e.addr) is None:  # the first page of a new expandable segment
                    pool = rec.small if _small_after(entries, e.index, conf) else rec.large
                    rec.new_expandable_segment(pool, e.stream, base=e.addr)
                rec.segment_map_at(e.addr, e.size)
            elif a == "segment_unmap":
                rec.segment_unmap_at(e.addr, e.size)
        except LayoutConflict as err:
            if not forcing:
                err.entry_index = e.index  # type: ignore[attr-defined]
                raise
            forced.append(e.index)
            if a == "alloc":
                b = rec.carve_at(e.size, e.stream, e.addr)
                if b is not None:
                    live[e.addr] = b
                    forced_bytes += K_SMALL_SIZE  # should_split's tail: at most 1 MiB more or less
                    peak_alloc = max(peak_alloc, rec.allocated)
                else:
                    skipped.append(e.index)
                    forced_bytes += round_size(e.size, conf)
            else:
                skipped.append(e.index)
        if a in _SEGMENT_ACTIONS:
            ops.append((e.index, (a, e.addr, e.size)))
        peak_res = max(peak_res, rec.reserved)
        reserved.append(rec.reserved)
    return Recording(peak_res, peak_alloc, rec.reserved, rec.allocated, tuple(reserved), tuple(ops),
                     tuple(forced), tuple(skipped), forced_bytes)


def search_start(snapshot: Mapping[str, Any], entries: Sequence[_Entry], *, device: int, conf: AllocConf,
                 device_memory_bytes: int | None, va: int | None) -> tuple[StartState, Recording, StartSearch]:
    """The start state the recording allows (see the module docstring), its recorded run, and how it was found."""
    sizes: dict[int, int] = {}
    st = start_state(snapshot, device=device, conf=conf, device_memory_bytes=device_memory_bytes)
    fresh_from = fresh_address(entries, st)
    open_sizes = {a: (lo, hi) for a, lo, hi in st.open_sizes}
    starts = sorted(open_sizes)
    best: tuple[int, dict[int, int]] = (-1, {})
    tries = 0
    if open_sizes:  # one pass that grows each open block where the trace shows its tail, then the replay of it
        try:
            recorded_run(conf, st, entries, fresh_from, va, tails=sizes)
        except LayoutConflict:
            pass  # a conflict no tail explains: the tails found so far, then one block at a time
        tries = 1
        if sizes:
            st = start_state(snapshot, device=device, conf=conf, device_memory_bytes=device_memory_bytes,
                             block_sizes=sizes)
    # each try fixes one more open block (a block fixed twice is a conflict no open block explains)
    for tries in range(tries + 1, tries + len(open_sizes) + 2):
        try:
            rec = recorded_run(conf, st, entries, fresh_from, va)
        except LayoutConflict as err:
            at = getattr(err, "entry_index", 0)
            if at > best[0]:
                best = (at, dict(sizes))
            fix = _explaining_block(starts, open_sizes, err.ptr)
            if fix is None or fix[0] in sizes:
                break
            sizes[fix[0]] = fix[1]
            st = start_state(snapshot, device=device, conf=conf, device_memory_bytes=device_memory_bytes,
                             block_sizes=sizes)
            continue
        return st, rec, StartSearch(len(open_sizes), tuple(sorted(sizes.items())), tries, (), (),
                                    _open_range(open_sizes, sizes))
    sizes = best[1]
    st = start_state(snapshot, device=device, conf=conf, device_memory_bytes=device_memory_bytes, block_sizes=sizes)
    rec = recorded_run(conf, st, entries, fresh_from, va, forcing=True)
    return st, rec, StartSearch(len(open_sizes), tuple(sorted(sizes.items())), tries, rec.forced, rec.skipped,
                                _open_range(open_sizes, sizes) + rec.forced_bytes)


def _grow_tail(rec: AllocatorModel, live: Mapping[int, Block], seeded: Mapping[int, Block], starts: list[int],
               open_sizes: Mapping[int, tuple[int, int]], ptr: int, tails: dict[int, int]) -> bool:
    """Give the open block that explains an allocation at `ptr` its tail, in the running model: the block is
    still the one seeded at the start and the cached block after it holds `ptr`. False when that is not so."""
    fix = _explaining_block(starts, open_sizes, ptr)
    if fix is None:
        return False
    addr, size = fix
    block = seeded.get(addr)
    nxt = block.next if block is not None else None
    if (block is None or live.get(addr) is not block or nxt is None or not nxt.available() or not nxt.mapped
            or nxt.ptr != block.ptr + block.size or not nxt.ptr < ptr < nxt.ptr + nxt.size
            or block.ptr + size != ptr):
        return False
    delta = ptr - nxt.ptr
    nxt.pool.remove(nxt)
    nxt.ptr, nxt.size = ptr, nxt.size - delta
    nxt.pool.insert(nxt)
    block.size += delta
    if block.allocated:
        rec.allocated += delta
    tails[addr] = size
    return True


def _explaining_block(starts: list[int], open_sizes: Mapping[int, tuple[int, int]], ptr: int,
                      ) -> tuple[int, int] | None:
    """(address, bytes) of the open block that, that size, ends at `ptr`; None when none can."""
    i = bisect_left(starts, ptr) - 1
    if i < 0:
        return None
    addr = starts[i]
    lo, hi = open_sizes[addr]
    return (addr, ptr - addr) if lo < ptr - addr <= hi else None


def _open_range(open_sizes: Mapping[int, tuple[int, int]], fixed: Mapping[int, int]) -> int:
    return sum(hi - lo for a, (lo, hi) in open_sizes.items() if a not in fixed)


def _small_after(entries: Sequence[_Entry], index: int, conf: AllocConf) -> bool:
    """Whether the first allocation after entry `index` is small-pool (the pool a new expandable segment serves)."""
    for e in entries[index + 1:]:
        if e.action == "alloc":
            return round_size(e.size, conf) <= K_SMALL_SIZE
        if e.action == "oom":
            return e.size <= K_SMALL_SIZE
    return False
