"""Reduce an allocation trace to peaks: overall, per phase, and the breakdown at each peak.

Pure functions over `list[TraceEvent]`. Sizes are counted the way
`torch.cuda.memory_allocated()` counts them: each request rounded up to a multiple of
512 bytes (`round_size` in c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize = 512);
`round_to=1` gives raw tensor bytes (what the exactness tests compare).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from memfit.allocator.constants import K_MIN_BLOCK_SIZE
from memfit.trace import TraceEvent

__all__ = ["Peak", "TracePeaks", "peaks", "BREAKDOWN_KEYS", "rounded"]

#: Categories shown to users; `inputs` (the batch) is counted with activations.
BREAKDOWN_KEYS = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "eval_outputs")
_FOLD = {"inputs": "activations"}

_MIN_BLOCK = K_MIN_BLOCK_SIZE


def rounded(size_bytes: int, round_to: int = _MIN_BLOCK) -> int:
    if round_to <= 1:
        return size_bytes
    if size_bytes < round_to:
        return round_to
    return -(-size_bytes // round_to) * round_to


@dataclass(frozen=True)
class Peak:
    bytes: int
    event_index: int
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TracePeaks:
    overall: Peak
    phase_of_peak: str
    by_phase: dict[str, Peak]
    final_live_bytes: int


def peaks(trace: Iterable[TraceEvent], *, round_to: int = _MIN_BLOCK) -> TracePeaks:
    live: dict[int, tuple[int, str]] = {}
    by_cat = dict.fromkeys(BREAKDOWN_KEYS, 0)
    total = 0
    best = Peak(0, -1, dict(by_cat))
    best_phase = "setup"
    phase_best: dict[str, Peak] = {}
    phase_max: dict[str, int] = {}
    for i, ev in enumerate(trace):
        if ev.action == "alloc":
            size = rounded(ev.size_bytes, round_to)
            cat = _FOLD.get(ev.category, ev.category)
            if cat not in by_cat:
                by_cat[cat] = 0
            live[ev.id] = (size, cat)
            total += size
            by_cat[cat] += size
            if total > phase_max.get(ev.phase, -1):
                phase_max[ev.phase] = total
                phase_best[ev.phase] = Peak(total, i, dict(by_cat))
            if total > best.bytes:
                best = Peak(total, i, dict(by_cat))
                best_phase = ev.phase
        elif ev.action == "free":
            entry = live.pop(ev.id, None)
            if entry is not None:
                total -= entry[0]
                by_cat[entry[1]] -= entry[0]
    return TracePeaks(best, best_phase, phase_best, total)
