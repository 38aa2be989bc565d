"""The memory timeline of an estimate: what was live, by category, and what the allocator reserved,
at sampled moments of the simulated run.

A view of what `memfit.estimate` computed, not a new model: allocated bytes are the trace's live
storages counted as `memfit.peaks` counts them (each rounded to 512, `inputs` with activations), so
the timeline's highest point is `MemoryReport.peak_allocated_bytes`; reserved bytes come from the
caching-allocator model (`memfit.allocator.caching.replay`, one replay) replaying the same trace with
the settings and capacity of the estimate's own replay (the GPU's memory left to PyTorch, or
without a GPU `required_bytes`), so their highest point is `peak_reserved_bytes` and a run that
runs out of memory stops where the estimate says it does.

The x axis is the event index of the trace (one allocation or free per event, in program order).
Runs of more events than `max_samples` are downsampled: each bucket of events keeps its highest
and lowest allocated moment and its highest reserved one, and the peak and the OOM are always
kept. The largest live storages are kept at the sample points only (`top_n` each).

Each live storage carries the shape and dtype of the tensor whose op created it (memfit.sim.tracker
records them at allocation); storages the simulation only knows the size of (evaluation buffers,
cuBLAS workspaces, DDP buckets, DeepSpeed's buffers) have none. A run that runs out of memory keeps
its failing request (`Timeline.oom_request`): drawn on top of what was allocated when it failed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.allocator.caching import AllocatorReport, replay
from memfit.allocator.conf import AllocConf, parse_alloc_conf
from memfit.errors import MemfitError
from memfit.peaks import _FOLD, BREAKDOWN_KEYS, rounded
from memfit.trace import TraceEvent

if TYPE_CHECKING:
    from memfit.estimator import MemoryReport

__all__ = ["LiveTensor", "Sample", "PhaseSpan", "Timeline", "timeline", "report_timeline", "DEFAULT_MAX_SAMPLES",
           "DEFAULT_TOP_N"]

#: Samples kept at most (a few thousand: the HTML view stays well under a few MB).
DEFAULT_MAX_SAMPLES = 3000
#: Largest live storages kept at each sample (what hovering a point lists).
DEFAULT_TOP_N = 8
#: Stacking order of the categories (bottom first): the report's breakdown keys, then what the
#: estimator adds (the cuBLAS workspaces); any other category follows in order of appearance.
CATEGORY_ORDER = BREAKDOWN_KEYS + ("workspaces",)


@dataclass(frozen=True)
class LiveTensor:
    """One live storage of the trace."""

    id: int  #: storage id in the trace
    size_bytes: int  #: as `memory_allocated()` counts it (rounded to 512)
    category: str
    module: str  #: module path active when it was allocated
    phase: str  #: phase in which it was allocated
    shape: tuple[int, ...] | None = None  #: None: the trace records storages, not tensors
    dtype: str | None = None


@dataclass(frozen=True)
class Sample:
    """The state after trace event `index`."""

    index: int
    phase: str
    step: int | None  #: optimizer step (1, 2, ...) of a training phase; None in the setup and the evaluation
    allocated_bytes: int
    reserved_bytes: int
    by_category: dict[str, int]  #: every category of the timeline, 0 where none is live
    top: tuple[LiveTensor, ...]  #: the largest live storages, largest first


@dataclass(frozen=True)
class PhaseSpan:
    """A run of consecutive events of one phase: trace events `start` to `end` (inclusive)."""

    phase: str
    step: int | None
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    samples: list[Sample]
    spans: list[PhaseSpan]
    categories: tuple[str, ...]  #: categories allocated anywhere in the trace, in stacking order
    num_events: int  #: events replayed (up to and including the failing request when the run runs out of memory)
    peak_index: int  #: event of the allocated peak (memfit.peaks: the first moment it is reached)
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    replay_capacity_bytes: int | None  #: memory available to PyTorch in the replay the reserved line comes from
    oom_index: int | None
    """Event whose request runs out of memory: the replay stops there, and the last sample is that moment
    (the request not granted); None when the run completes."""
    oom_request: LiveTensor | None = None
    """The request that fails at `oom_index` (its size rounded as memory_allocated() would count it), never
    allocated: the OOM point of a chart is the last sample's allocated bytes plus this."""
    conf: AllocConf | None = None  #: the allocator settings of the replay the reserved line comes from
    replay: AllocatorReport | None = None
    """That replay's own figures (memfit.allocator.caching.replay of the trace with `conf` at
    `replay_capacity_bytes`): the page's allocator what-ifs show them as the run's row without replaying again."""


_TRAIN = ("forward", "backward", "optimizer")


def _spans(trace: Sequence[TraceEvent], n: int) -> list[PhaseSpan]:
    """Consecutive runs of one phase; training phases numbered by the optimizer step they belong to
    (a step ends with its run of `optimizer` events, as memfit.sim.engine writes them)."""
    out: list[PhaseSpan] = []
    step = 1
    for i in range(n):
        ph = trace[i].phase
        if out and out[-1].phase == ph:
            continue
        if out:
            prev = out[-1]
            out[-1] = PhaseSpan(prev.phase, prev.step, prev.start, i - 1)
            if prev.phase == "optimizer":
                step += 1
        out.append(PhaseSpan(ph, step if ph in _TRAIN else None, i, i))
    if out:
        last = out[-1]
        out[-1] = PhaseSpan(last.phase, last.step, last.start, n - 1)
    return out


def _replay(trace: Sequence[TraceEvent], conf: AllocConf, capacity_bytes: int | None
            ) -> tuple[list[int], list[int], int | None, AllocatorReport]:
    """Allocated (as memfit.peaks counts it) and reserved (the allocator model) after each event, as
    `memfit.allocator.caching.replay` replays the trace, up to and including the failing request, if any (its
    index is the third value; at it, the state when the request fails), and that replay's report."""
    reserved: list[int] = []
    rep = replay(trace, conf=conf, capacity_bytes=capacity_bytes, reserved_after=reserved)
    n = len(reserved)
    oom_index = rep.oom.event_index if rep.oom is not None else None
    sizes: dict[int, int] = {}
    total = 0
    allocated: list[int] = []
    append = allocated.append
    for i in range(n):
        ev = trace[i]
        action = ev.action
        if action == "alloc":
            if i != oom_index:  # the failing request: never allocated
                size = rounded(ev.size_bytes)
                sizes[ev.id] = size
                total += size
        elif action == "free":
            total -= sizes.pop(ev.id, 0)
        append(total)
    return allocated, reserved, oom_index, rep


def _argmax(values: list[int], lo: int, hi: int) -> int:
    best = lo
    for i in range(lo + 1, hi):
        if values[i] > values[best]:
            best = i
    return best


def _argmin(values: list[int], lo: int, hi: int) -> int:
    best = lo
    for i in range(lo + 1, hi):
        if values[i] < values[best]:
            best = i
    return best


def _sample_points(allocated: list[int], reserved: list[int], max_samples: int, keep: Sequence[int]) -> list[int]:
    n = len(allocated)
    if n <= max_samples:
        return list(range(n))
    buckets = max(1, (max_samples - len(keep) - 2) // 3)
    points = {0, n - 1, *keep}
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if hi > lo:
            points.update((_argmax(allocated, lo, hi), _argmin(allocated, lo, hi), _argmax(reserved, lo, hi)))
    return sorted(points)


def _category(ev: TraceEvent) -> str:
    return _FOLD.get(ev.category, ev.category)


def _live_tensor(ev: TraceEvent) -> LiveTensor:
    return LiveTensor(ev.id, rounded(ev.size_bytes), _category(ev), ev.module, ev.phase,
                      None if ev.shape is None else tuple(ev.shape), ev.dtype)


def timeline(
    trace: Sequence[TraceEvent],
    *,
    conf: AllocConf = AllocConf(),
    capacity_bytes: int | None = None,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    top_n: int = DEFAULT_TOP_N,
) -> Timeline:
    """The timeline of `trace` (`MemoryReport.trace`), reserved memory replayed at `capacity_bytes`.

    Args:
        trace: the estimate's trace.
        conf: the allocator settings of the estimate's replay.
        capacity_bytes: memory available to PyTorch in that replay (None: unlimited).
        max_samples: samples kept at most (at least 16).
        top_n: largest live storages kept at each sample.
    """
    if max_samples < 16:
        raise MemfitError(f"max_samples `{max_samples}` is too few to draw a timeline; give at least 16")
    allocated, reserved, oom_index, rep = _replay(trace, conf, capacity_bytes)
    n = len(allocated)
    if n == 0:
        raise MemfitError("the trace is empty: nothing to draw")
    peak_index = _argmax(allocated, 0, n)
    peak_reserved_index = _argmax(reserved, 0, n)
    keep = (peak_index, peak_reserved_index) + (() if oom_index is None else (oom_index,))
    points = _sample_points(allocated, reserved, max_samples, keep)
    spans = _spans(trace, n)

    seen: dict[str, None] = {}
    for ev in trace[:n]:
        if ev.action == "alloc":
            seen.setdefault(_category(ev), None)
    categories = tuple(c for c in CATEGORY_ORDER if c in seen) + tuple(c for c in seen if c not in CATEGORY_ORDER)

    by_cat = dict.fromkeys(categories, 0)
    live: dict[int, tuple[int, str, TraceEvent]] = {}  # id -> (rounded size, category, its alloc event)
    made: dict[int, LiveTensor] = {}  # the LiveTensor of each storage a sample lists, made once
    order: list[tuple[int, int]] = []  # (size, -id) of the live storages, ascending: the largest at the end
    span_at = 0
    samples: list[Sample] = []
    want = iter(points)
    next_point = next(want, None)
    fold = _FOLD
    for i in range(n):
        ev = trace[i]
        action = ev.action
        if i == oom_index:
            pass  # the failing request: never allocated
        elif action == "alloc":
            size = rounded(ev.size_bytes)
            category = fold.get(ev.category, ev.category)
            live[ev.id] = (size, category, ev)
            by_cat[category] += size
            bisect.insort(order, (size, -ev.id))
        elif action == "free":
            x = live.pop(ev.id, None)
            if x is not None:
                by_cat[x[1]] -= x[0]
                del order[bisect.bisect_left(order, (x[0], -ev.id))]
                made.pop(ev.id, None)  # an id may come back for a later storage
        if i != next_point:
            continue
        while spans[span_at].end < i:
            span_at += 1
        top = []
        for key in order[-1:-top_n - 1:-1] if top_n > 0 else ():
            t = made.get(-key[1])
            if t is None:
                t = made[-key[1]] = _live_tensor(live[-key[1]][2])
            top.append(t)
        samples.append(Sample(i, spans[span_at].phase, spans[span_at].step, allocated[i], reserved[i],
                              dict(by_cat), tuple(top)))
        next_point = next(want, None)
    request = None if oom_index is None else _live_tensor(trace[oom_index])
    return Timeline(samples, spans, categories, n, peak_index,
                    allocated[peak_index], reserved[peak_reserved_index], capacity_bytes, oom_index, request,
                    conf, rep)


def report_timeline(report: "MemoryReport", *, max_samples: int | None = None, top_n: int = DEFAULT_TOP_N
                    ) -> Timeline:
    """The timeline of `report`: its trace replayed as the estimate replayed it (at `capacity_bytes`, or
    without a GPU at `required_bytes`)."""
    if not report.trace:
        raise MemfitError(f"the report of `{report.model}` has no trace (read from memfit's cache): estimate with "
                          "cache=False (memfit estimate --no-cache) to draw its timeline")
    conf = report.replay_conf
    if conf is None:  # a report built by hand: the settings its text names
        conf = parse_alloc_conf(report.alloc_conf)
    capacity = report.capacity_bytes if report.capacity_bytes is not None else report.required_bytes
    return timeline(report.trace, conf=conf, capacity_bytes=capacity,
                    max_samples=max_samples or DEFAULT_MAX_SAMPLES, top_n=top_n)
