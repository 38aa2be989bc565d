"""A memory snapshot read safely: the pickle, the allocator settings it records, its trace entries.

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
* `oom`: `malloc` ran out of memory; `addr` (torch >= 2.6: `device_free`) = free device bytes,
  `size` = the rounded request.
* `snapshot`, `user_defined`: no allocator state change.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.allocator.conf import ROUNDUP_INTERVALS, AllocConf, parse_alloc_conf
from memfit.errors import MemfitError

__all__ = ["load_snapshot", "loads_snapshot", "check_snapshot", "conf_from_snapshot", "DeviceSummary",
           "device_summaries", "default_device"]

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
    if isinstance(obj, list) and obj and all(isinstance(s, dict) and "total_size" in s for s in obj):
        raise MemfitError(
            f"`{name}` is a list of {len(obj)} segments (`torch.cuda.memory_snapshot()`), which holds no trace of "
            "allocator calls to replay; record one with `torch.cuda.memory._record_memory_history()` and "
            "`torch.cuda.memory._dump_snapshot(path)`")
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
            addr = int(e.get("addr", e.get("device_free", 0)) or 0)
            size, stream = int(e.get("size", 0)), int(e.get("stream", 0) or 0)
        except (TypeError, ValueError):
            raise MemfitError(f"device trace entry {i} `{e!r:.80}` has a non-integer addr/size/stream") from None
        ec = action in _RELEASES and any(
            "emptyCache" in str(f.get("name", "")) for f in (e.get("frames") or []) if isinstance(f, Mapping))
        out.append(_Entry(i, action, addr, size, stream, ec))
    return out


def _final_segments(snapshot: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    """The snapshot's `segments` of `device` (the state when it was taken)."""
    out = []
    for s in snapshot.get("segments") or []:
        if not isinstance(s, Mapping):
            raise MemfitError(f"segment `{s!r:.80}` is not a dict; the snapshot is damaged")
        if int(s.get("device", 0)) == device:
            out.append(s)
    return out


# -- the devices a snapshot holds ------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSummary:
    """One device of a snapshot, from the file alone (no replay)."""

    device: int
    entries: int  #: trace entries recorded
    segments: int  #: segments at the end
    final_reserved_bytes: int  #: reserved at the end (the final segments)
    peak_reserved_bytes: int  #: the most reserved during the trace (the final segments with the trace undone)
    oom_entry: int | None  #: index of the first `oom` entry
    oom_requested_bytes: int | None  #: what that malloc asked for (rounded)
    oom_free_bytes: int | None  #: free device memory it saw


def device_summaries(snapshot: Mapping[str, Any]) -> list[DeviceSummary]:
    """Every device with trace entries or segments, in index order."""
    traces = snapshot.get("device_traces") or []
    devices = {i for i, t in enumerate(traces) if t} | {int(s.get("device", 0)) for s in _final_segments_all(snapshot)}
    out = []
    for d in sorted(devices):
        entries = _entries(snapshot, d) if d < len(traces) else []
        segs = _final_segments(snapshot, d)
        final = sum(int(s.get("total_size", 0)) for s in segs)
        level = final - sum(e.size if e.action in _GROWS else -e.size for e in entries if e.action in _SEGMENT_ACTIONS)
        peak = level
        for e in entries:
            if e.action in _SEGMENT_ACTIONS:
                level += e.size if e.action in _GROWS else -e.size
                peak = max(peak, level)
        oom = next((e for e in entries if e.action == "oom"), None)
        out.append(DeviceSummary(d, len(entries), len(segs), final, peak, oom.index if oom else None,
                                 oom.size if oom else None, oom.addr if oom else None))
    return out


def default_device(summaries: list[DeviceSummary]) -> int:
    """The device to replay when none is given: the one that ran out of memory, else the first with a trace."""
    for s in summaries:
        if s.oom_entry is not None:
            return s.device
    return next((s.device for s in summaries if s.entries), 0)


def _final_segments_all(snapshot: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [s for s in snapshot.get("segments") or [] if isinstance(s, Mapping)]
