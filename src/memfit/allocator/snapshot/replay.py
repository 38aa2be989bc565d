"""A snapshot's trace replayed through memfit's allocator model and compared with the recording.

The model is seeded with the start state (memfit.allocator.snapshot.start: real addresses,
sizes, streams) and the device trace is replayed through it; the CUDA driver's own
decisions (the address cudaMalloc returns, whether it fails) are taken from the recording.

Known limitations (each reported per file when it applies):

* a run of `segment_free`s before a `segment_alloc` is either `empty_cache()` or the
  OOM-retry path of that malloc; it is told apart by the frames (`emptyCache`) when they
  were recorded, else by whether the model still finds a cached block first;
* CUDA-graph private pools (`segment_pool_id` other than (0, 0)) are not modelled;
* expandable segments: the snapshot records neither where a segment's address range
  starts nor its size (1 1/8 of the GPU's memory, `ExpandableSegment`); one segment per
  (stream, pool) is assumed, starting at the lowest page mapped at the start or mapped /
  unmapped later within one range below it, sized from `device_memory_bytes` (else 1 TiB).
  Best fit counts the unmapped tail, so the GPU's memory size matters for exactness.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.allocator.caching import AllocatorModel, AllocatorReport, Block, Driver, round_size
from memfit.allocator.conf import AllocConf, parse_alloc_conf
from memfit.allocator.snapshot.read import (
    _GROWS, _RELEASES, _SEGMENT_ACTIONS, _Entry, _entries, _final_segments, check_snapshot, conf_from_snapshot,
)
from memfit.allocator.snapshot.recorded import StartSearch, fresh_address, search_start
from memfit.allocator.snapshot.start import StartState, _seed, _va_bytes, start_state

__all__ = ["SnapshotReplay", "ReplaySide", "Divergence", "WhatIf", "replay_snapshot", "what_if"]


@dataclass(frozen=True)
class ReplaySide:
    """Figures of one side of the comparison (the recording, or memfit's model)."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    segment_allocs: int  #: cudaMalloc calls (`segment_alloc`) plus page mappings (`segment_map`)
    segment_frees: int  #: cudaFree calls plus page unmappings
    final_reserved_bytes: int
    final_allocated_bytes: int


@dataclass(frozen=True)
class Divergence:
    """The first point where the model did something else than the recording."""

    event_index: int  #: index in the device trace
    recorded: str
    modelled: str


@dataclass(frozen=True)
class SnapshotReplay:
    recorded: ReplaySide
    modelled: ReplaySide
    segment_sequence_equal: bool  #: same segment operations, same sizes, same order
    reserved_equal_after_every_event: bool
    first_divergence: Divergence | None
    address_mismatches: int  #: allocations the model placed at another address than the recording
    final_state_equal: bool  #: the model's final segments and blocks equal the snapshot's
    start: StartState
    conf: AllocConf
    num_entries: int
    report: AllocatorReport  #: the model's figures in the form `replay` returns them
    notes: tuple[str, ...] = ()
    #: how the start state was chosen among those the final segments allow (None: not searched)
    search: StartSearch | None = None
    #: reserved bytes after every trace entry, as recorded (the recording replayed at its own addresses)
    recorded_reserved_bytes: tuple[int, ...] = field(default=(), repr=False, compare=False)
    #: reserved bytes after every trace entry in memfit's model (entries of one allocator call share the value
    #: after it; past an entry where the model ran out of memory and stopped, none)
    modelled_reserved_bytes: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def observed_peak_reserved_bytes(self) -> int:
        return self.recorded.peak_reserved_bytes

    @property
    def observed_num_cudamalloc(self) -> int:
        return self.recorded.segment_allocs

    @property
    def exact(self) -> bool:
        """Same segment operations, same reserved memory after every entry, every block at the
        recorded address, and the same final segments and blocks as the snapshot."""
        return (self.segment_sequence_equal and self.reserved_equal_after_every_event
                and self.address_mismatches == 0 and self.final_state_equal
                and (self.search is None or self.search.consistent))


class _RecordedDriver(Driver):
    """The driver's decisions as the recording shows them, one allocator call at a time."""

    def __init__(self, fresh_from: int) -> None:
        super().__init__(None, fresh_from)
        self.queue: list[_Entry] = []  # the recorded segment operations of the current call
        self.fail_all = False  # the call ended in `oom`: every cudaMalloc / cuMemCreate failed

    def _releases_pending(self) -> bool:
        return bool(self.queue) and self.queue[0].action in _RELEASES

    def cuda_malloc(self, size: int, reserved: int) -> int | None:
        if self.fail_all or self._releases_pending():
            return None  # the recording freed cached segments before this cudaMalloc succeeded
        if self.queue and self.queue[0].action == "segment_alloc" and self.queue[0].size == size:
            return self.queue.pop(0).addr
        return self.fresh(size)

    def cuda_free(self, ptr: int, size: int) -> None:
        if self._releases_pending():
            self.queue.pop(0)

    unmap_pages = cuda_free

    def reserve_address_space(self, size: int, page: int) -> int:
        if self.queue and self.queue[0].action == "segment_map":
            return self.queue[0].addr
        return self.fresh(size)

    def map_pages(self, ptr: int, size: int, reserved: int) -> bool:
        if self.fail_all or self._releases_pending():
            return False
        if self.queue and self.queue[0].action == "segment_map":
            self.queue.pop(0)
        return True


def _describe(op: tuple[str, int, int] | None) -> str:
    if op is None:
        return "nothing"
    return f"{op[0]} {op[2]} B"


def _runs(entries: Sequence[_Entry]) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of consecutive segment entries."""
    out, i, n = [], 0, len(entries)
    while i < n:
        if entries[i].action in _SEGMENT_ACTIONS:
            j = i
            while j < n and entries[j].action in _SEGMENT_ACTIONS:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def replay_snapshot(snapshot: Mapping[str, Any], *, device: int = 0, conf: AllocConf | None = None,
                    device_memory_bytes: int | None = None) -> SnapshotReplay:
    """Replay a recorded device trace exactly and compare it with what the real allocator did.

    Args:
        snapshot: the dict `torch.cuda.memory._snapshot()` returns (see `load_snapshot`).
        device: which device's trace and segments.
        conf: the allocator settings; default: those recorded in the snapshot.
        device_memory_bytes: the GPU's total memory. Only expandable segments depend on it
            (their address space is 1 1/8 of it, `ExpandableSegment`; best fit counts the
            unmapped tail); the snapshot does not record it (default: 1 TiB of address space).
    """
    check_snapshot(snapshot)
    conf = conf if conf is not None else conf_from_snapshot(snapshot)
    entries = _entries(snapshot, device)
    va = _va_bytes(device_memory_bytes)
    st, rec, search = search_start(snapshot, entries, device=device, conf=conf,
                                   device_memory_bytes=device_memory_bytes, va=va)
    notes = list(conf.notes) + list(st.notes) + search.notes()
    if device_memory_bytes is None and (st.expandable or any(e.action == "segment_map" for e in entries)):
        notes.append("expandable segments: the GPU's memory size is not in the snapshot and sets the address "
                     "space best fit sees; give it (--gpu) for an exact replay")
    fresh_from = fresh_address(entries, st)  # addresses no recorded segment uses
    recorded = ReplaySide(rec.peak_reserved_bytes, rec.peak_allocated_bytes, rec.segment_allocs, rec.segment_frees,
                          rec.final_reserved_bytes, rec.final_allocated_bytes)
    rec_reserved, rec_ops = list(rec.reserved_after), list(rec.ops)
    run = _model_run(conf, st, entries, fresh_from, va, rec_reserved)
    if run.stopped_at is not None:
        rec_ops = [op for op in rec_ops if op[0] < run.stopped_at]
    seq_div = _first_sequence_divergence(run.ops, rec_ops, len(entries))
    candidates = [d for d in (seq_div, run.first_divergence) if d is not None]
    first_div = min(candidates, key=lambda d: d.event_index) if candidates else None
    if first_div is None and not run.reserved_equal:
        first_div = Divergence(len(entries), "reserved memory differs", "reserved memory differs")
    m = run.model
    modelled = ReplaySide(run.peak_reserved, run.peak_allocated, sum(o[0] in _GROWS for o in run.ops),
                          sum(o[0] in _RELEASES for o in run.ops), m.reserved, m.allocated)
    report = AllocatorReport(
        peak_allocated_bytes=run.peak_allocated, peak_reserved_bytes=run.peak_reserved,
        reserved_at_peak_allocated_bytes=run.reserved_at_peak_allocated,
        fragmentation_at_peak_bytes=run.peak_reserved - run.allocated_at_peak_reserved,
        num_segments_at_peak=run.segments_at_peak, num_cudamalloc=m.n_malloc, num_cudafree=m.n_free,
        num_alloc_retries=m.n_retries, final_allocated_bytes=m.allocated, final_reserved_bytes=m.reserved,
        num_events=len(entries), oom=None,
    )
    return SnapshotReplay(
        recorded=recorded, modelled=modelled,
        segment_sequence_equal=seq_div is None and run.stopped_at is None,
        reserved_equal_after_every_event=run.reserved_equal, first_divergence=first_div,
        address_mismatches=run.address_mismatches,
        final_state_equal=_layout(m.state()) == _layout(_final_segments(snapshot, device)),
        start=st, conf=conf, num_entries=len(entries), report=report, notes=tuple(notes), search=search,
        recorded_reserved_bytes=tuple(rec_reserved), modelled_reserved_bytes=tuple(run.reserved_after),
    )


@dataclass
class _ModelRun:
    model: AllocatorModel
    ops: list[tuple[str, int, int]]
    peak_reserved: int = 0
    peak_allocated: int = 0
    reserved_at_peak_allocated: int = 0
    allocated_at_peak_reserved: int = 0
    segments_at_peak: int = 0
    address_mismatches: int = 0
    reserved_equal: bool = True
    first_divergence: Divergence | None = None  #: the first block placed elsewhere, or an OOM mismatch
    stopped_at: int | None = None  #: the entry where the model ran out of memory and the replay stopped
    reserved_after: list[int] = field(default_factory=list)  #: reserved after every entry (after its call)

    def diverged(self, d: Divergence) -> None:
        if self.first_divergence is None:
            self.first_divergence = d


def _model_run(conf: AllocConf, st: StartState, entries: Sequence[_Entry], fresh_from: int, va: int | None,
               rec_reserved: Sequence[int]) -> _ModelRun:
    """memfit's model on the recorded calls: its own choices, the driver's as recorded.

    Each allocator call of the recording (a malloc with the segment operations it caused, a
    free, an `empty_cache()`, an `oom`) is one call of the model; reserved memory is compared
    after each.
    """
    drv = _RecordedDriver(fresh_from)
    ops: list[tuple[str, int, int]] = []

    def on_event(action: str, ptr: int, size: int, stream: int) -> None:
        if action in _SEGMENT_ACTIONS:
            ops.append((action, ptr, size))

    m = AllocatorModel(conf, drv, on_event=on_event, va_bytes=va)
    run = _ModelRun(m, ops, m.reserved, m.allocated, m.reserved, m.allocated, m.segments)
    live = _seed(m, st)
    run.peak_reserved, run.peak_allocated = m.reserved, m.allocated
    run_end = dict(_runs(entries))
    n, i = len(entries), 0
    while i < n:
        e = entries[i]
        call_end = i + 1
        alloc: _Entry | None = None
        ops_before = len(ops)
        if e.action in _SEGMENT_ACTIONS:
            j = run_end[i]
            seg_run = entries[i:j]
            nxt = entries[j] if j < n else None
            grows = any(x.action in _GROWS for x in seg_run)
            explicit_empty = any(x.empty_cache_frame for x in seg_run)
            if nxt is not None and nxt.action == "oom" and not explicit_empty:
                drv.queue = list(seg_run)  # the failed malloc's own release path
                _oom_call(m, nxt, drv, run)
                call_end = j + 1
            elif nxt is not None and nxt.action == "alloc" and grows:
                releases = [x for x in seg_run if x.action in _RELEASES]
                size = round_size(nxt.size, conf)
                if releases and (explicit_empty or m.find_free_block(m.pool_for(size), nxt.stream, size) is not None):
                    drv.queue = releases  # torch.cuda.empty_cache(), then the malloc
                    m.empty_cache()
                    drv.queue = [x for x in seg_run if x.action not in _RELEASES]
                else:
                    drv.queue = list(seg_run)  # the OOM-retry path: cudaMalloc failed until these were freed
                alloc, call_end = nxt, j + 1
            else:
                drv.queue = list(seg_run)  # torch.cuda.empty_cache()
                m.empty_cache()
                call_end = j
        elif e.action == "alloc":
            drv.queue = []
            alloc = e
        elif e.action == "oom":
            drv.queue = []
            _oom_call(m, e, drv, run)
        elif e.action == "free_requested":
            if i + 1 < n and entries[i + 1].action == "free_completed" and entries[i + 1].addr == e.addr:
                m.free(live.pop(e.addr))  # no other stream used it: free_block at once
                call_end = i + 2
            else:
                m.free_requested(live[e.addr])
        elif e.action == "free_completed":
            b = live.pop(e.addr)
            if not b.available():  # else synchronize_and_free_events returned it already
                m.free_completed(b)
        if alloc is not None:
            block, _ = m.malloc(alloc.size, alloc.stream)
            if block is None:  # the recorded driver failed it: the model released less than the recording
                run.diverged(Divergence(alloc.index, f"alloc {alloc.size} B", "out of memory (replay stopped)"))
                run.stopped_at, run.reserved_equal = alloc.index, False
                break
            live[alloc.addr] = block
            if block.ptr != alloc.addr:
                run.address_mismatches += 1
                recorded_ops = [_describe((x.action, x.addr, x.size)) for x in entries[i:call_end - 1]]
                model_ops = [_describe(op) for op in ops[ops_before:]]
                run.diverged(Divergence(
                    alloc.index, ", ".join(recorded_ops + [f"alloc {alloc.size} B at {alloc.addr:#x}"]),
                    ", ".join(model_ops + [f"alloc {alloc.size} B at {block.ptr:#x}"])))
        drv.queue, drv.fail_all = [], False
        run.reserved_after.extend([m.reserved] * (call_end - i))
        i = call_end
        if m.allocated > run.peak_allocated:
            run.peak_allocated, run.reserved_at_peak_allocated = m.allocated, m.reserved
        if m.reserved > run.peak_reserved:
            run.peak_reserved, run.allocated_at_peak_reserved, run.segments_at_peak = m.reserved, m.allocated, m.segments
        if m.reserved != rec_reserved[call_end - 1]:
            run.reserved_equal = False
    return run


def _first_sequence_divergence(model_ops: Sequence[tuple[str, int, int]],
                               rec_ops: Sequence[tuple[int, tuple[str, int, int]]], n: int) -> Divergence | None:
    """The first segment operation (kind and size) that differs, at the recorded entry's index."""
    for k in range(max(len(model_ops), len(rec_ops))):
        mo = model_ops[k] if k < len(model_ops) else None
        ro = rec_ops[k][1] if k < len(rec_ops) else None
        if mo is None or ro is None or (mo[0], mo[2]) != (ro[0], ro[2]):
            return Divergence(rec_ops[k][0] if k < len(rec_ops) else n, _describe(ro), _describe(mo))
    return None


def _oom_call(m: AllocatorModel, e: _Entry, drv: _RecordedDriver, run: _ModelRun) -> None:
    """One recorded `oom`: the model's malloc must fail too (every cudaMalloc fails)."""
    drv.fail_all = True
    block, _ = m.malloc(e.size, e.stream)
    drv.fail_all = False
    if block is not None:
        m.free(block)  # the recording got nothing here: undo it and go on
        run.diverged(Divergence(e.index, f"oom for {e.size} B", f"a cached block of {block.size} B at {block.ptr:#x}"))


def _layout(segments: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    out = []
    for s in segments:
        blocks = tuple((int(b["address"]), int(b["size"]), b["state"] != "inactive") for b in s.get("blocks") or [])
        out.append((int(s["address"]), int(s["total_size"]), bool(s.get("is_expandable")), blocks))
    return sorted(out)


# -- what other settings would have done ------------------------------------------------------------
@dataclass(frozen=True)
class WhatIf:
    """The same trace under other allocator settings, from a cache holding only the live blocks."""

    settings: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    segment_allocs: int  #: cudaMallocs / page mappings during the trace (not those placing the live blocks)
    final_reserved_bytes: int


def what_if(snapshot: Mapping[str, Any], settings: str | AllocConf | None, *, device: int = 0,
            device_memory_bytes: int | None = None, reserved_after: list[int] | None = None) -> WhatIf:
    """Replay the recorded calls under `settings` (None: those recorded).

    The cache's history before the recording is unknown, so each run starts with the
    blocks live at the first entry allocated in address order into an empty cache (under
    the settings being tried); `empty_cache()` calls are replayed, OOM-retry releases and
    `oom` entries are not (the device is taken as unlimited). Compare runs with each other,
    not with the recording. When `reserved_after` is a list, the reserved bytes after every
    entry are appended to it (the line the replay view draws).
    """
    base = conf_from_snapshot(snapshot)
    if settings is None:
        conf, label = base, "as recorded"
    elif isinstance(settings, AllocConf):
        conf, label = settings, "custom"
    else:
        over = parse_alloc_conf(settings)
        conf = AllocConf(
            max_split_size_bytes=over.max_split_size_bytes if "max_split_size_mb" in settings else base.max_split_size_bytes,
            max_non_split_rounding_bytes=over.max_non_split_rounding_bytes,
            roundup_power2_divisions=(over.roundup_power2_divisions if "roundup_power2_divisions" in settings
                                      else base.roundup_power2_divisions),
            expandable_segments=over.expandable_segments if "expandable_segments" in settings else base.expandable_segments,
            garbage_collection_threshold=base.garbage_collection_threshold,
        )
        label = settings
    entries = _entries(snapshot, device)
    st = start_state(snapshot, device=device, conf=base)
    m = AllocatorModel(conf, Driver(None), va_bytes=_va_bytes(device_memory_bytes))
    live: dict[int, Block] = {}
    stream_of = {s[0]: s[2] for s in st.segments}
    starts = sorted(stream_of)
    for addr, _size, state, requested in st.blocks:
        j = bisect_right(starts, addr) - 1
        stream = stream_of[starts[j]] if j >= 0 else 0
        b, _ = m.malloc(max(requested, 1), stream)
        assert b is not None
        if state == "pending":
            m.free_requested(b)
        live[addr] = b
    peak_res, peak_alloc, seeded_mallocs = m.reserved, m.allocated, m.n_malloc
    runs = {s: t for s, t in _runs(entries)}
    for e in entries:
        a = e.action
        if a == "alloc":
            b, _ = m.malloc(e.size, e.stream)
            assert b is not None
            live[e.addr] = b
        elif a == "free_requested":
            m.free_requested(live[e.addr])
        elif a == "free_completed":
            b = live.pop(e.addr)
            if b.pending:
                m.free_completed(b)
        elif e.index in runs:
            j = runs[e.index]
            run = entries[e.index:j]
            nxt = entries[j] if j < len(entries) else None
            grows = any(x.action in _GROWS for x in run)
            explicit = any(x.empty_cache_frame for x in run)
            if explicit or not (grows or (nxt is not None and nxt.action == "oom")):
                m.empty_cache()
        peak_res, peak_alloc = max(peak_res, m.reserved), max(peak_alloc, m.allocated)
        if reserved_after is not None:
            reserved_after.append(m.reserved)
    return WhatIf(label, peak_res, peak_alloc, m.n_malloc - seeded_mallocs, m.reserved)
