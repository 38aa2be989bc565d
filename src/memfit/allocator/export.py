"""memfit's simulated run as a `torch.cuda.memory._snapshot()`, for PyTorch's memory viewer.

The trace is replayed through memfit's allocator model (memfit.allocator) with every
`record_trace` point of c10/cuda/CUDACachingAllocator.cpp reported, and written in the
format `torch.cuda.memory._dump_snapshot` writes (`_memory_snapshot_pickled` in
torch/csrc/cuda/Module.cpp): `segments` (each with its `blocks`), `device_traces` (one list
of `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`,
`segment_map`, `segment_unmap`, `oom` entries; `oom` carries `device_free` instead of
`addr`) and `allocator_settings`. Each entry's `frames` name the phase, the module and the
memory category of the storage, so pytorch.org/memory_viz and `torch.cuda._memory_viz`
show the predicted run the way they show a recorded one.

Addresses are the model's (fresh, increasing segment addresses from 4 GiB); one stream.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memfit.allocator.conf import ROUNDUP_INTERVALS, AllocConf
from memfit.allocator.caching import AllocatorModel, Block, Driver
from memfit.errors import MemfitError
from memfit.trace import TraceEvent

__all__ = ["export_snapshot", "write_snapshot", "write_run_snapshot", "check_snapshot_path"]


def _frames(ev: TraceEvent) -> list[dict[str, Any]]:
    # innermost first, as torch writes them; the viewers print `basename(filename):line:name`,
    # so this stack reads `phase:0:forward` / `module:0:<module>` / `category:0:activations`
    return [
        {"name": ev.category, "filename": "category", "line": 0},
        {"name": ev.module or "(no module)", "filename": "module", "line": 0},
        {"name": ev.phase, "filename": "phase", "line": 0},
    ]


def _settings(conf: AllocConf) -> dict[str, Any]:
    """`allocator_settings` as `_memory_snapshot_pickled` writes it (max_split_size: int64(SIZE_MAX) = -1)."""
    divs = conf.roundup_power2_divisions
    return {
        "PYTORCH_CUDA_ALLOC_CONF": "",
        "max_split_size": conf.max_split_size_bytes if conf.max_split_size_bytes is not None else -1,
        "garbage_collection_threshold": conf.garbage_collection_threshold or 0.0,
        "expandable_segments": conf.expandable_segments,
        "roundup_power2_divisions": {str(1 << k): int(divs[k]) for k in range(ROUNDUP_INTERVALS)},  # type: ignore[index]
    }


def export_snapshot(
    events: Iterable[TraceEvent], *, conf: AllocConf = AllocConf(), capacity_bytes: int | None = None,
) -> dict[str, Any]:
    """The snapshot dict of replaying `events` through the allocator model.

    Args:
        events: memfit's trace (`MemoryReport.trace`).
        conf: the allocator settings.
        capacity_bytes: what the cache may reserve; the trace stops at an OOM (an `oom` entry).
    """
    entries: list[dict[str, Any]] = []
    current: list[dict[str, Any]] = []
    clock = [0]

    def on_event(action: str, ptr: int, size: int, stream: int) -> None:
        clock[0] += 1
        entry = {"action": action, "addr": ptr, "size": size, "stream": stream,
                 "time_us": clock[0], "frames": current}
        if action == "oom":
            entry["device_free"] = entry.pop("addr")
        entries.append(entry)

    m = AllocatorModel(conf, Driver(capacity_bytes), on_event=on_event)
    live: dict[int, Block] = {}
    alloc_frames: dict[int, list[dict[str, Any]]] = {}
    seg_frames: dict[int, list[dict[str, Any]]] = {}
    for ev in events:
        current = _frames(ev)
        start = len(entries)
        if ev.action == "alloc":
            if ev.size_bytes == 0:
                continue  # CUDACachingAllocator::allocate skips malloc for 0 bytes
            if ev.id in live:
                raise MemfitError(f"trace allocates id `{ev.id}` twice; every alloc needs a fresh id")
            block, _ = m.malloc(ev.size_bytes)
            if block is None:
                break
            live[ev.id] = block
            alloc_frames[block.ptr] = current
        elif ev.action == "free":
            b = live.pop(ev.id, None)
            if b is not None:
                m.free(b)
        elif ev.action == "empty_cache":
            m.empty_cache()
        else:
            raise MemfitError(f"trace action `{ev.action}` is unknown; use `alloc`, `free` or `empty_cache`")
        for e in entries[start:]:
            if e["action"] in ("segment_alloc", "segment_map"):
                seg_frames[e["addr"]] = current
    segments = m.state()
    for s in segments:
        s["frames"] = seg_frames.get(s["address"], [])
        for b in s["blocks"]:
            b["frames"] = alloc_frames.get(b["address"], []) if b["state"] != "inactive" else []
    return {"segments": segments, "device_traces": [entries], "allocator_settings": _settings(conf)}


def check_snapshot_path(path: str | Path) -> Path:
    """A clear error unless a snapshot can be written at `path`."""
    p = Path(path)
    if p.is_dir():
        raise MemfitError(f"snapshot path `{p}` is a directory; give a file name such as `{p}/memfit-snapshot.pickle`")
    if not p.parent.exists():
        raise MemfitError(f"the directory of snapshot path `{p}` does not exist; create `{p.parent}` first")
    return p


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Write `snapshot` where `torch.cuda.memory._dump_snapshot` would (a pickle of plain data)."""
    p = check_snapshot_path(path)
    try:
        with open(p, "wb") as fh:
            pickle.dump(snapshot, fh, protocol=4)
    except OSError as err:
        raise MemfitError(f"cannot write snapshot `{p}` ({err.strerror}); choose a writable path") from err
    return p


def write_run_snapshot(events: Iterable[TraceEvent], path: str | Path, *, alloc_conf: str | None = None) -> Path:
    """`memfit estimate --snapshot`: export `events` under the settings `estimate` used.

    `alloc_conf` as `estimate` takes it: PYTORCH_CUDA_ALLOC_CONF text, None for the environment's.
    """
    import os

    from memfit.allocator.conf import alloc_conf_from_env, parse_alloc_conf

    conf = parse_alloc_conf(alloc_conf) if alloc_conf is not None else alloc_conf_from_env(os.environ)
    return write_snapshot(export_snapshot(events, conf=conf), path)
