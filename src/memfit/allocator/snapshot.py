"""Replay a real CUDA allocator trace (`torch.cuda.memory._snapshot()`) exactly.

With `torch.cuda.memory._record_memory_history()` on, PyTorch records every call into the
caching allocator (`record_trace` in c10/cuda/CUDACachingAllocator.cpp, `TraceEntry` in
CUDACachingAllocator.h). What each entry holds, from the C++ that records it:

* `alloc`: `alloc_found_block` — `addr` = the block's address, `size` = the requested
  bytes (`orig_size`), `stream`.
* `free_requested`: `free` — the program dropped the tensor; `allocated` drops now.
* `free_completed`: `free_block` — the block is back in the pool (at once on one stream;
  later, from `process_events` / `synchronize_and_free_events`, when it was used on other
  streams with `record_stream`).
* `segment_alloc` / `segment_free`: `alloc_block` (cudaMalloc) / `release_block` (cudaFree),
  `size` = the segment's bytes. `segment_map` / `segment_unmap`: `map_block` /
  `unmap_block` of expandable-segment pages.
* `oom`: `malloc` ran out of memory; `addr` = free device bytes, `size` = the rounded request.
* `snapshot`, `user_defined`: no allocator state change.

The trace is a ring buffer (`TraceEntryRingBuffer`, `max_entries`): recording often
starts, or its oldest entries were overwritten, after memory was allocated. The state at
the first recorded entry is reconstructed from the final `segments` (with their blocks)
by undoing the trace backwards; blocks that were allocated before the recording and freed
in it get `round_size(requested)` bytes (plus the tail a large-pool block keeps when the
remainder was too small to split: every cached large-pool block is > 1 MiB, see
`should_split`). The model is seeded with that state (real addresses, sizes, streams)
and the device trace is replayed through it; the CUDA driver's own decisions (the address
cudaMalloc returns, whether it fails) are taken from the recording.

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

import io
import pickle
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.allocator.conf import ROUNDUP_INTERVALS, AllocConf, parse_alloc_conf
from memfit.allocator.caching import _DEFAULT_VA_BYTES as _DEFAULT_VA
from memfit.allocator.caching import (
    K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE, AllocatorModel, AllocatorReport, Block, Driver, round_size,
)
from memfit.errors import MemfitError
from memfit.trace import TraceEvent

__all__ = [
    "SnapshotReplay", "ReplaySide", "Divergence", "WhatIf", "StartState",
    "load_snapshot", "conf_from_snapshot", "start_state", "replay_snapshot", "what_if",
    "events_from_torch_snapshot", "replay_torch_snapshot",
]

_SEGMENT_ACTIONS = frozenset(("segment_alloc", "segment_free", "segment_map", "segment_unmap"))
_RELEASES = frozenset(("segment_free", "segment_unmap"))
_GROWS = frozenset(("segment_alloc", "segment_map"))
_IGNORED_ACTIONS = frozenset(("snapshot", "user_defined"))
_KNOWN_ACTIONS = _SEGMENT_ACTIONS | _IGNORED_ACTIONS | {"alloc", "free_requested", "free_completed", "oom"}


# -- loading --------------------------------------------------------------------------------------
class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain data only: every global (class, function) is refused.

    A pickle runs code only through globals (`GLOBAL` / `STACK_GLOBAL` then `REDUCE`,
    `BUILD`, `INST`, `OBJ`, `NEWOBJ` all need a class or callable from `find_class`), and
    persistent ids; refusing both leaves dicts, lists, tuples, strings, numbers and bools.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise _GlobalRefused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _GlobalRefused(f"persistent id {pid!r}")


class _GlobalRefused(pickle.UnpicklingError):
    pass


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Read a `torch.cuda.memory._dump_snapshot()` pickle without running any code in it."""
    p = Path(path)
    if not p.exists():
        raise MemfitError(f"snapshot file `{p}` does not exist; pass the .pickle written by "
                          "`torch.cuda.memory._dump_snapshot(path)`")
    if p.is_dir():
        raise MemfitError(f"`{p}` is a directory; pass the snapshot .pickle file inside it")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise MemfitError(f"cannot read snapshot `{p}` ({err.strerror}); check its permissions") from err
    return loads_snapshot(data, name=str(p))


def loads_snapshot(data: bytes, *, name: str = "snapshot") -> dict[str, Any]:
    """`load_snapshot` of bytes already read."""
    try:
        obj = _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except _GlobalRefused as err:
        raise MemfitError(
            f"`{name}` refers to the Python object `{err}`: a memory snapshot holds only plain data, so it was "
            "refused unread (a pickle can run code); pass a file written by `torch.cuda.memory._dump_snapshot`"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, UnicodeDecodeError, OverflowError) as err:
        raise MemfitError(
            f"`{name}` is not a readable pickle ({type(err).__name__}: {err}); pass the file written by "
            "`torch.cuda.memory._dump_snapshot(path)`"
        ) from None
    check_snapshot(obj, name=name)
    return obj


def check_snapshot(obj: Any, *, name: str = "snapshot") -> None:
    """A clear error unless `obj` has the shape of `torch.cuda.memory._snapshot()`."""
    if not isinstance(obj, dict) or "segments" not in obj or "device_traces" not in obj:
        what = f"a dict with keys {sorted(map(str, obj))[:6]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise MemfitError(
            f"`{name}` is {what}, not a memory snapshot (it needs `segments` and `device_traces`); record one "
            "with `torch.cuda.memory._record_memory_history()` and `torch.cuda.memory._dump_snapshot(path)`"
        )
    if not isinstance(obj["segments"], list) or not isinstance(obj["device_traces"], list):
        raise MemfitError(f"`{name}`: `segments` and `device_traces` must be lists, as torch writes them")


# -- settings -------------------------------------------------------------------------------------
def _divisions(raw: Any) -> int | tuple[int, ...]:
    """`roundup_power2_divisions` as the snapshot stores it: an int, 16 ints, or {interval MiB: divisions}."""
    if raw is None:
        return 0
    if isinstance(raw, int):
        return raw
    if isinstance(raw, Mapping):  # torch >= 2.6: {"1": d, "2": d, ..., "32768": d}, keys in MiB
        divs = [0] * ROUNDUP_INTERVALS
        for k, v in raw.items():
            mb = int(k)
            if mb <= 0 or mb & (mb - 1):
                raise MemfitError(f"allocator_settings roundup_power2_divisions key `{k}` is not a power of two in MiB")
            divs[min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)] = int(v)
        return tuple(divs)
    if isinstance(raw, (list, tuple)):
        return tuple(int(v) for v in raw)
    raise MemfitError(f"allocator_settings roundup_power2_divisions `{raw!r}` is neither an int, a list nor a dict")


def conf_from_snapshot(snapshot: Mapping[str, Any]) -> AllocConf:
    """The allocator settings the recording ran with (`SnapshotInfo::config_metadata`).

    Snapshots before torch 2.4 carry no `allocator_settings`; the defaults are assumed.
    `max_split_size` is `size_t` SIZE_MAX when unset, which Python sees as -1 (or 2**64-1).
    """
    settings = snapshot.get("allocator_settings")
    if not settings:
        return AllocConf(notes=("the snapshot has no allocator_settings (torch < 2.4): default settings assumed",))
    if not isinstance(settings, Mapping):
        raise MemfitError(f"allocator_settings `{settings!r}` is not a dict; the snapshot is damaged")
    mss = settings.get("max_split_size")
    mss_bytes = None if mss is None or int(mss) < 0 or int(mss) >= (1 << 63) - 1 else int(mss)
    gct = settings.get("garbage_collection_threshold")
    raw = settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    from_env = parse_alloc_conf(raw) if isinstance(raw, str) and raw.strip() else AllocConf()
    return AllocConf(
        max_split_size_bytes=mss_bytes,
        max_non_split_rounding_bytes=from_env.max_non_split_rounding_bytes,
        roundup_power2_divisions=_divisions(settings.get("roundup_power2_divisions")),
        expandable_segments=bool(settings.get("expandable_segments", False)),
        garbage_collection_threshold=float(gct) if gct else None,
        backend=from_env.backend,
        notes=from_env.notes,
    )


# -- the trace ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Entry:
    index: int
    action: str
    addr: int
    size: int
    stream: int
    empty_cache_frame: bool  #: a frame names emptyCache (a release run from torch.cuda.empty_cache)


def _entries(snapshot: Mapping[str, Any], device: int) -> list[_Entry]:
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or device >= len(traces) or not isinstance(traces[device], list):
        n = len(traces) if isinstance(traces, list) else 0
        raise MemfitError(
            f"snapshot has no trace for device `{device}` ({n} device traces); record it with "
            "`torch.cuda.memory._record_memory_history()` before `torch.cuda.memory._snapshot()`"
        )
    out = []
    for i, e in enumerate(traces[device]):
        if not isinstance(e, Mapping) or not isinstance(e.get("action"), str):
            raise MemfitError(f"device trace entry {i} `{e!r:.80}` has no `action`; the snapshot is damaged")
        action = e["action"]
        try:
            addr, size, stream = int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0) or 0)
        except (TypeError, ValueError):
            raise MemfitError(f"device trace entry {i} `{e!r:.80}` has a non-integer addr/size/stream") from None
        ec = action in _RELEASES and any(
            "emptyCache" in str(f.get("name", "")) for f in (e.get("frames") or []) if isinstance(f, Mapping))
        out.append(_Entry(i, action, addr, size, stream, ec))
    return out


# -- the state at the start of the recording --------------------------------------------------------
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


def _final_segments(snapshot: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    out = []
    for s in snapshot.get("segments") or []:
        if not isinstance(s, Mapping):
            raise MemfitError(f"segment `{s!r:.80}` is not a dict; the snapshot is damaged")
        if int(s.get("device", 0)) == device:
            out.append(s)
    return out


def start_state(snapshot: Mapping[str, Any], *, device: int = 0, conf: AllocConf | None = None,
                device_memory_bytes: int | None = None) -> StartState:
    """Undo the device trace from the final `segments` back to its first entry.

    Args:
        snapshot: the snapshot dict.
        device: which device.
        conf: the allocator settings (default: the recorded ones); they set block sizes.
        device_memory_bytes: the GPU's memory, which sets an expandable segment's address range.
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
    inferred = ambiguous = 0
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
            b[0] = rounded
            ambiguous += 1
    if ambiguous:
        notes.append(f"{ambiguous} blocks allocated before the recording and freed in it were given their rounded "
                     "request size; a > 1 MiB gap after them is assumed cached")
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
        inferred_sizes=inferred, notes=tuple(notes),
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


# -- the replay -----------------------------------------------------------------------------------
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
                and self.address_mismatches == 0 and self.final_state_equal)


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
    st = start_state(snapshot, device=device, conf=conf, device_memory_bytes=device_memory_bytes)
    notes = list(conf.notes) + list(st.notes)
    va = _va_bytes(device_memory_bytes)
    if device_memory_bytes is None and (st.expandable or any(e.action == "segment_map" for e in entries)):
        notes.append("expandable segments: the GPU's memory size is not in the snapshot and sets the address "
                     "space best fit sees; give it (--gpu) for an exact replay")
    max_addr = max([e.addr for e in entries if e.action != "oom"] + [s[0] + s[1] for s in st.segments] + [1 << 32])
    fresh_from = (max_addr + (1 << 40)) & ~((1 << 21) - 1)  # addresses no recorded segment uses
    recorded, rec_reserved, rec_ops = _recorded_run(conf, st, entries, fresh_from, va)
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
        start=st, conf=conf, num_entries=len(entries), report=report, notes=tuple(notes),
    )


def _recorded_run(conf: AllocConf, st: StartState, entries: Sequence[_Entry], fresh_from: int, va: int | None,
                  ) -> tuple[ReplaySide, list[int], list[tuple[int, tuple[str, int, int]]]]:
    """The recording replayed at its own addresses: its figures, reserved after every entry, its segment ops.

    Blocks are placed where the trace says; only `should_split` (how big each block is) is
    the model's, which is what gives the recorded `allocated` (the trace has requested sizes).
    """
    rec = AllocatorModel(conf, Driver(None, fresh_from), va_bytes=va)
    live = _seed(rec, st)
    reserved: list[int] = []
    peak_alloc, peak_res = rec.allocated, rec.reserved
    ops: list[tuple[int, tuple[str, int, int]]] = []
    for e in entries:
        a = e.action
        if a == "alloc":
            live[e.addr] = rec.malloc_at(e.size, e.stream, e.addr)
            peak_alloc = max(peak_alloc, rec.allocated)
        elif a == "free_requested":
            rec.free_requested(live[e.addr])
        elif a == "free_completed":
            rec.free_completed(live.pop(e.addr))
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
        if a in _SEGMENT_ACTIONS:
            ops.append((e.index, (a, e.addr, e.size)))
        peak_res = max(peak_res, rec.reserved)
        reserved.append(rec.reserved)
    side = ReplaySide(peak_res, peak_alloc, sum(op[1][0] in _GROWS for op in ops),
                      sum(op[1][0] in _RELEASES for op in ops), rec.reserved, rec.allocated)
    return side, reserved, ops


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


def _va_bytes(device_memory_bytes: int | None) -> int | None:
    # ExpandableSegment: address space for totalGlobalMem + totalGlobalMem / 8
    return device_memory_bytes + device_memory_bytes // 8 if device_memory_bytes else None


def _small_after(entries: Sequence[_Entry], index: int, conf: AllocConf) -> bool:
    for e in entries[index + 1:]:
        if e.action == "alloc":
            return round_size(e.size, conf) <= K_SMALL_SIZE
        if e.action == "oom":
            return e.size <= K_SMALL_SIZE
    return False


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
            device_memory_bytes: int | None = None) -> WhatIf:
    """Replay the recorded calls under `settings` (None: those recorded).

    The cache's history before the recording is unknown, so each run starts with the
    blocks live at the first entry allocated in address order into an empty cache (under
    the settings being tried); `empty_cache()` calls are replayed, OOM-retry releases and
    `oom` entries are not (the device is taken as unlimited). Compare runs with each other,
    not with the recording.
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
    return WhatIf(label, peak_res, peak_alloc, m.n_malloc - seeded_mallocs, m.reserved)


# -- the older, single-stream TraceEvent view (kept for callers of memfit.allocator) -----------------
def events_from_torch_snapshot(snapshot: Mapping[str, Any], *, device: int = 0) -> list[TraceEvent]:
    """TraceEvents from `torch.cuda.memory._snapshot()` taken with `_record_memory_history`.

    Uses the `device_traces` entries: `alloc` (size = requested bytes) opens an id,
    `free_completed` closes it, and a run of `segment_free` / `segment_unmap` not followed by
    `segment_alloc` / `segment_map` is an `empty_cache`. Streams are dropped and frees of
    blocks allocated before recording started are dropped: for an exact replay use
    `replay_snapshot`.
    """
    live: dict[int, int] = {}
    out: list[TraceEvent] = []
    pending_release = False
    for entry in _entries(snapshot, device):
        action = entry.action
        if action in _RELEASES:
            pending_release = True
            continue
        if action in _GROWS:
            pending_release = False  # part of a malloc's retry / GC path
            continue
        if action not in ("alloc", "free_completed"):
            continue  # free_requested, snapshot, oom, user_defined
        if pending_release:
            out.append(TraceEvent("empty_cache", -1, 0))
            pending_release = False
        if action == "alloc":
            live[entry.addr] = len(out)
            out.append(TraceEvent("alloc", len(out), entry.size))
        elif entry.addr in live:
            out.append(TraceEvent("free", live.pop(entry.addr), entry.size))
    if pending_release:
        out.append(TraceEvent("empty_cache", -1, 0))
    return out


def replay_torch_snapshot(
    snapshot: Mapping[str, Any], *, conf: AllocConf | None = None,
    capacity_bytes: int | None = None, device: int = 0,
) -> SnapshotReplay:
    """`replay_snapshot` (the exact replay); `capacity_bytes` is not used by it (the driver is recorded)."""
    del capacity_bytes
    return replay_snapshot(snapshot, device=device, conf=conf)

