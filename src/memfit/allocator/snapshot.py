"""Replay a real CUDA allocator trace (`torch.cuda.memory._snapshot()`) through memfit's model.

With `torch.cuda.memory._record_memory_history()` on, PyTorch records every allocation,
free and segment operation; `events_from_torch_snapshot` turns the device trace into
memfit TraceEvents and `replay_torch_snapshot` compares the model's reserved memory with
the segments the real allocator created (bench/gpu_truth.py).

Known limitations: allocations made before recording started are invisible, and an
`empty_cache()` directly followed by a cudaMalloc is indistinguishable from the OOM-retry
path in the trace; both are treated as the retry path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.allocator.conf import AllocConf, parse_alloc_conf
from memfit.allocator.caching import AllocatorReport, replay
from memfit.errors import MemfitError
from memfit.trace import TraceEvent

__all__ = ["SnapshotReplay", "events_from_torch_snapshot", "replay_torch_snapshot"]


def events_from_torch_snapshot(snapshot: Mapping[str, Any], *, device: int = 0) -> list[TraceEvent]:
    """TraceEvents from `torch.cuda.memory._snapshot()` taken with `_record_memory_history`.

    Uses the `device_traces` entries (`TraceEntry` in CUDACachingAllocator.h): `alloc`
    (size = requested bytes) opens an id, `free_completed` closes it (the memory returns
    to the cache then, after any cross-stream events), and a run of `segment_free` /
    `segment_unmap` not followed by `segment_alloc` / `segment_map` is an `empty_cache`.
    Frees of blocks allocated before recording started are dropped.
    """
    traces = snapshot.get("device_traces")
    if not traces or device >= len(traces):
        raise MemfitError(
            f"snapshot has no trace for device `{device}`; record it with "
            "`torch.cuda.memory._record_memory_history()` before `torch.cuda.memory._snapshot()`"
        )
    live: dict[int, int] = {}
    out: list[TraceEvent] = []
    pending_release = False
    for entry in traces[device]:
        action = entry.get("action")
        if action in ("segment_free", "segment_unmap"):
            pending_release = True
            continue
        if action in ("segment_alloc", "segment_map"):
            pending_release = False  # part of a malloc's retry / GC path
            continue
        if action not in ("alloc", "free_completed"):
            continue  # free_requested, snapshot, oom, user_defined
        if pending_release:
            out.append(TraceEvent("empty_cache", -1, 0))
            pending_release = False
        addr = int(entry["addr"])
        if action == "alloc":
            live[addr] = len(out)
            out.append(TraceEvent("alloc", len(out), int(entry["size"])))
        elif addr in live:
            out.append(TraceEvent("free", live.pop(addr), int(entry.get("size", 0))))
    if pending_release:
        out.append(TraceEvent("empty_cache", -1, 0))
    return out


@dataclass(frozen=True)
class SnapshotReplay:
    report: AllocatorReport
    observed_peak_reserved_bytes: int  #: from segment_alloc/free/map/unmap entries
    observed_num_cudamalloc: int
    conf: AllocConf


def _conf_from_snapshot(snapshot: Mapping[str, Any]) -> AllocConf:
    settings = snapshot.get("allocator_settings") or {}
    raw = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if raw:
        return parse_alloc_conf(raw)
    mss = settings.get("max_split_size")
    divs = settings.get("roundup_power2_divisions")
    return AllocConf(
        max_split_size_bytes=int(mss) if mss and int(mss) < (1 << 63) - 1 else None,
        expandable_segments=bool(settings.get("expandable_segments", False)),
        garbage_collection_threshold=settings.get("garbage_collection_threshold") or None,
        roundup_power2_divisions=tuple(divs) if isinstance(divs, (list, tuple)) and len(divs) == 16 else 0,
    )


def replay_torch_snapshot(
    snapshot: Mapping[str, Any], *, conf: AllocConf | None = None,
    capacity_bytes: int | None = None, device: int = 0,
) -> SnapshotReplay:
    """Replay a recorded GPU trace and return the model's report next to what was observed."""
    conf = conf if conf is not None else _conf_from_snapshot(snapshot)
    report = replay(events_from_torch_snapshot(snapshot, device=device), conf=conf,
                    capacity_bytes=capacity_bytes)
    delta = peak = n_malloc = 0
    for entry in snapshot["device_traces"][device]:
        action = entry.get("action")
        if action in ("segment_alloc", "segment_map"):
            delta += int(entry["size"])
            n_malloc += 1
            peak = max(peak, delta)
        elif action in ("segment_free", "segment_unmap"):
            delta -= int(entry["size"])
    # the recording may start with segments already reserved: anchor on the final state
    final = sum(int(s.get("total_size", 0)) for s in snapshot.get("segments", [])
                if s.get("device", device) == device)
    baseline = max(final - delta, 0)
    return SnapshotReplay(report, baseline + peak, n_malloc, conf)
