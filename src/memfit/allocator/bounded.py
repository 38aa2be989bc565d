"""Reserved memory as a GPU's caching allocator reaches it: bounded by the GPU, the smallest
capacity a run needs, and the steady state of a long run.

Why a replay without a cap is not what a run needs: PyTorch's caching allocator returns a
cached segment to the driver only under memory pressure. `DeviceCachingAllocator::malloc`
(c10/cuda/CUDACachingAllocator.cpp) first looks for a cached free block (`get_free_block`);
only when `cudaMalloc` of a new segment fails does it free cached blocks
(`release_available_cached_blocks`, then `release_cached_blocks`) and retry; `free` never
calls `cudaFree`. A trace that keeps asking for blocks larger than every cached one
therefore grows reserved memory without bound when memory is unlimited. The evaluation loop
does exactly this: `EvalLoopContainer.add` / `nested_concat` (transformers/trainer_pt_utils.py)
concatenates each batch's logits to the buffer kept on the device, so step k allocates a
buffer of k batches (a new >= 10 MiB segment of its own, `get_allocation_size`) while the
buffer of k-1 batches, freed after the copy, stays cached and is too small for step k+1:
reserved memory grows as the sum 1 + 2 + ... + k of the buffer sizes (quadratically), while
on a real card the free-and-retry path hands those segments back and reserved stays below
the card. So every reserved figure here comes from a replay with a capacity:

* `smallest_capacity`: the smallest memory available to PyTorch (a multiple of
  `RESOLUTION_BYTES`) at which the replay completes, by a galloping then bisecting search
  over `capacity_bytes` (at most `MAX_SEARCH_REPLAYS` replays), to 2 MiB or 1/256 of the
  capacity, whichever is larger;
* `steady_state`: the training step's part of the trace repeated (at most
  `MAX_STEADY_STEPS` optimizer steps) until each step's peak reserved stops changing;
* `bounded_reserved`: both, as `memfit.estimate` reports them.

Known limitations: the search assumes that a run which completes at some capacity also
completes at every larger one; the allocator does not guarantee it (more capacity means
fewer releases and another layout), so the result is "completes at `required_bytes`, fails
at `failed_bytes`", each verified by a replay. The steady state repeats training steps only;
the evaluation is replayed after two optimizer steps, as the simulated trace has it.
"""

from __future__ import annotations

import gc
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from memfit.allocator.conf import AllocConf
from memfit.allocator.caching import AllocatorReport, OomEvent, replay
from memfit.trace import TraceEvent
from memfit.units import MiB

__all__ = [
    "RESOLUTION_BYTES", "MAX_SEARCH_REPLAYS", "MAX_STEADY_STEPS", "CapacitySearch", "SteadyState",
    "BoundedReserved", "smallest_capacity", "steady_state", "steady_trace", "bounded_reserved",
]

#: Every segment the allocator maps is a multiple of 2 MiB (`kSmallBuffer` = 2 MiB, `kLargeBuffer`
#: = 20 MiB, larger ones rounded to `kRoundLarge` = 2 MiB in `get_allocation_size`; expandable
#: segments map 2 MiB / 20 MiB pages), so reserved memory is always a multiple of 2 MiB and a
#: capacity C behaves exactly as C rounded down to 2 MiB: a search in 2 MiB steps is exact.
RESOLUTION_BYTES = 2 * MiB
#: ... or 1/256 of the capacity searched, whichever is larger (see `_tolerance`): finer than the
#: +-150 MiB to which memory outside PyTorch is known (memfit.gpus.outside_pytorch), and 2-3 replays fewer.
RELATIVE_RESOLUTION = 256
#: Bound on the replays of one capacity search; a replay of a spliced trace takes 3-60 ms.
MAX_SEARCH_REPLAYS = 40
#: Bound on the optimizer steps the steady state replays.
MAX_STEADY_STEPS = 20
#: Steps replayed first; the search goes on to MAX_STEADY_STEPS only when these have not settled.
_FIRST_STEADY_STEPS = 6
#: Consecutive steps with the same peak reserved that count as settled.
_SETTLED_STEPS = 3
#: First gallop step of the search above the lower bound: 1/32 of it (fragmentation of a
#: training run is typically a few percent of its peak).
_FIRST_STEP_FRACTION = 32
#: First gallop step when searching the long run above a capacity at which two steps complete:
#: later steps fragment a little more (tens of MiB in the bundled models), rarely much more.
_NEAR_STEP_BYTES = 8 * MiB


def _up(x: int) -> int:
    return -(-x // RESOLUTION_BYTES) * RESOLUTION_BYTES


def _down(x: int) -> int:
    return x // RESOLUTION_BYTES * RESOLUTION_BYTES


def _tolerance(capacity: int) -> int:
    """How close the search brings `required_bytes` to the largest failing capacity: 2 MiB, or
    1/256 of the capacity when that is more (a 48 GiB run: 192 MiB; an 8 GiB one: 32 MiB)."""
    return max(RESOLUTION_BYTES, _down(capacity // RELATIVE_RESOLUTION))


def _tight(capacity: int, r: AllocatorReport, conf: AllocConf) -> tuple[int, AllocatorReport]:
    """A replay that completes at `capacity` completes identically at its own peak reserved P <= capacity:
    every cudaMalloc it made kept reserved <= P, and every one that failed (reserved + size > capacity)
    fails at P too, so the same blocks are freed and retried. Not with expandable segments, whose
    address-space reservation depends on the capacity (memfit.allocator `va_bytes`)."""
    if conf.expandable_segments:
        return capacity, r
    return max(RESOLUTION_BYTES, _up(r.peak_reserved_bytes)), r


@dataclass(frozen=True)
class CapacitySearch:
    """The smallest capacity at which a replay completes."""

    required_bytes: int  #: completes at this capacity (verified by a replay)
    failed_bytes: int
    """The largest capacity seen to run out of memory (or a proven lower bound): the smallest
    capacity that completes is in (failed_bytes, required_bytes]."""
    replays: int
    report: AllocatorReport  #: the replay at `required_bytes`

    @property
    def exact(self) -> bool:
        """True when the search reached its resolution (`_tolerance`) within the bound on replays."""
        return self.required_bytes - self.failed_bytes <= _tolerance(self.required_bytes)


def smallest_capacity(
    events: Sequence[TraceEvent],
    *,
    conf: AllocConf = AllocConf(),
    lower_bytes: int = 0,
    failed_bytes: int | None = None,
    uncapped: AllocatorReport | None = None,
    max_replays: int = MAX_SEARCH_REPLAYS,
    first_step_bytes: int | None = None,
) -> CapacitySearch:
    """Smallest `capacity_bytes` (a multiple of RESOLUTION_BYTES) at which `replay(events)` does not OOM.

    Args:
        events: the trace (a sequence: it is replayed several times).
        conf: allocator settings.
        lower_bytes: a proven lower bound: every capacity below it fails (the trace's peak of
            live bytes, each rounded to 512, is one: reserved >= allocated >= that).
        failed_bytes: a capacity already seen to fail (the GPU's, after a capped replay).
        uncapped: the replay without a cap, when already done; capacity at its peak reserved
            behaves exactly like no cap, so it is where the search stops going up (without it the
            search gallops up without a ceiling).
        max_replays: bound on the replays; when reached, the best verified capacity is returned
            (`exact` is then False).
        first_step_bytes: the first step above the failing capacity (default 1/32 of it); small when
            the answer is known to be close (the steady state of a run whose two steps fit).
    """
    replays = 0
    lo = max(_up(lower_bytes) - RESOLUTION_BYTES, 0)
    if failed_bytes is not None:
        lo = max(lo, _down(failed_bytes))
    # from the peak reserved without a cap upwards, a capacity behaves exactly as no cap
    top = None if uncapped is None else max(_up(uncapped.peak_reserved_bytes), lo + RESOLUTION_BYTES)
    hi, hi_report = None, None
    step = max(RESOLUTION_BYTES, _up(first_step_bytes or lo // _FIRST_STEP_FRACTION))
    while hi is None and replays < max_replays:  # gallop up from the lower bound
        probe = lo + step if top is None or lo >= top else min(lo + step, top)
        r = replay(events, conf=conf, capacity_bytes=probe)
        replays += 1
        if r.oom is None:
            hi, hi_report = _tight(probe, r, conf)
        else:
            # next: at least what the failed request needed on top of what was left after freeing the
            # cache (a guess, verified by the next replay: a larger capacity changes the layout)
            lo, step = probe, max(step * 4, _up(r.oom.reserved_bytes + r.oom.tried_to_allocate_bytes) - probe)
    if hi is None:  # not found within the bound (never seen): the run as it goes without a cap
        if uncapped is None:
            uncapped = replay(events, conf=conf)
            replays += 1
        return CapacitySearch(_up(uncapped.peak_reserved_bytes), lo, replays, uncapped)
    while hi - lo > _tolerance(hi) and replays < max_replays:  # bisect
        mid = lo + (hi - lo) // RESOLUTION_BYTES // 2 * RESOLUTION_BYTES
        r = replay(events, conf=conf, capacity_bytes=mid)
        replays += 1
        if r.oom is None:
            hi, hi_report = _tight(mid, r, conf)
        else:
            lo = mid
    assert hi_report is not None
    return CapacitySearch(hi, lo, replays, hi_report)


# -- steady state ------------------------------------------------------------------------------
_TRAIN = ("forward", "backward", "optimizer")
_SEP = "|"  # phase label of a repeated step: "<step>|<phase>"


def _step_bounds(trace: Sequence[TraceEvent]) -> tuple[int, int, int] | None:
    """(start of step 1, start of step 2, end of step 2): the events of the first two optimizer steps.

    A step ends with its run of `optimizer` events (memfit.sim.engine writes the micro-steps,
    then the optimizer step, for each of the two optimizer steps it simulates)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, ev in enumerate(trace):
        if ev.phase == "optimizer":
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(trace)))
    if len(runs) < 2:
        return None
    first = next(i for i, ev in enumerate(trace) if ev.phase in _TRAIN)
    a, b = runs[0][1], runs[1][1]
    if any(ev.phase not in _TRAIN for ev in trace[first:b]):
        return None
    return first, a, b


class _LongRun:
    """The trace of many optimizer steps, built step by step as it is asked for (see steady_trace)."""

    def __init__(self, trace: Sequence[TraceEvent]) -> None:
        bounds = _step_bounds(trace)
        self.ok = bounds is not None
        if bounds is None:
            return
        first, a, b = bounds
        self.events: list[TraceEvent] = list(trace[:first])
        for k, lo, hi in ((1, first, a), (2, a, b)):
            self.events += [_relabel(ev, ev.id, k) for ev in trace[lo:hi]]
        self.ends = [first, a, b]  # ends[k]: the events through optimizer step k
        self.unit = trace[a:b]
        self.inside = {ev.id for ev in self.unit if ev.action == "alloc"}
        freed = {ev.id for ev in self.unit if ev.action == "free"}
        survivors: dict[int, deque[int]] = defaultdict(deque)
        for ev in self.unit:
            if ev.action == "alloc" and ev.id not in freed:
                survivors[ev.size_bytes].append(ev.id)
        # an id step 2 frees but an earlier step allocated -> the step-2 survivor that plays its role
        self.pair: dict[int, int] = {}
        for ev in self.unit:
            if ev.action == "free" and ev.id not in self.inside and survivors[ev.size_bytes]:
                self.pair[ev.id] = survivors[ev.size_bytes].popleft()
        self.next_id = max((ev.id for ev in trace), default=0) + 1
        self.prev = {i: i for i in self.inside}  # ids of the last step built

    def _build(self) -> None:
        """Append one more repetition of step 2."""
        k = len(self.ends)
        cur: dict[int, int] = {}
        out: list[TraceEvent] = []
        label = {ph: f"{k}{_SEP}{ph}" for ph in _TRAIN}
        nid = self.next_id
        for ev in self.unit:
            action, i = ev.action, ev.id
            if action == "alloc":
                cur[i] = nid
                new_id = nid
                nid += 1
            elif action == "free":
                if i in cur:
                    new_id = cur[i]
                elif i in self.pair:
                    new_id = self.prev[self.pair[i]]
                else:
                    continue  # freed in step 2 with nothing in its role since: nothing to free
            else:
                new_id = i
            out.append(TraceEvent(action, new_id, ev.size_bytes, ev.category, label[ev.phase], ev.module))
        self.next_id = nid
        self.prev = cur
        self.events += out
        self.ends.append(len(self.events))

    def upto(self, steps: int) -> list[TraceEvent]:
        """The events through optimizer step `steps`."""
        while len(self.ends) <= steps:
            self._build()
        return self.events[: self.ends[steps]]

    def iter_upto(self, steps: int) -> Iterator[TraceEvent]:
        """The same, built only as far as it is read (a replay that stops at an OOM reads no further)."""
        done = 0
        for k in range(steps + 1):
            if k >= len(self.ends):
                self._build()
            yield from self.events[done: self.ends[k]]
            done = self.ends[k]


def _relabel(ev: TraceEvent, new_id: int, step: int) -> TraceEvent:
    return TraceEvent(ev.action, new_id, ev.size_bytes, ev.category, f"{step}{_SEP}{ev.phase}", ev.module)


def _step_of(trace: Sequence[TraceEvent], index: int) -> int | None:
    """The optimizer step (1 or 2) of trace[index]; None in the setup or the evaluation."""
    bounds = _step_bounds(trace)
    if bounds is None:
        return None
    first, a, b = bounds
    return None if index < first or index >= b else (1 if index < a else 2)


def steady_trace(trace: Sequence[TraceEvent], steps: int) -> list[TraceEvent] | None:
    """The trace of `steps` optimizer steps: setup and the two simulated steps, then the second one repeated.

    Events of optimizer step k get the phase label `"k|<phase>"` (setup keeps `setup`); the
    evaluation is left out. A storage allocated in the repeated step and freed only in a later
    one (the optimizer's step counter, replaced at every step) is freed by the next repetition,
    paired by size with what the second step frees of the first one's. None when the trace
    does not have two optimizer steps.
    """
    run = _LongRun(trace)
    return run.upto(steps) if run.ok else None


@dataclass(frozen=True)
class SteadyState:
    """Reserved memory over many optimizer steps."""

    reserved_bytes: int  #: peak reserved over all replayed steps (`max_memory_reserved()` after them)
    two_step_reserved_bytes: int  #: peak reserved over the two simulated optimizer steps (training only)
    settled_after_steps: int | None
    """The optimizer step from which every later step reaches the same peak reserved (at least
    `_SETTLED_STEPS` steps in a row); None when still changing after `steps_replayed` steps."""
    steps_replayed: int
    step_reserved_bytes: tuple[int, ...]  #: peak reserved within each optimizer step, from step 1
    capacity_bytes: int | None  #: memory available to PyTorch in this replay (None: unlimited)
    oom_step: int | None = None  #: the optimizer step that runs out of memory, if one does (0: the setup)
    oom: OomEvent | None = None  #: that OOM, with the phase of the step (forward/backward/optimizer)

    def to_json(self) -> dict:
        return {
            "reserved_bytes": self.reserved_bytes, "two_step_reserved_bytes": self.two_step_reserved_bytes,
            "settled_after_steps": self.settled_after_steps, "steps_replayed": self.steps_replayed,
            "step_reserved_bytes": list(self.step_reserved_bytes), "capacity_bytes": self.capacity_bytes,
            "oom_step": self.oom_step,
        }


def _settled(per_step: Sequence[int]) -> int | None:
    n = len(per_step)
    k = n - 1
    while k > 0 and per_step[k - 1] == per_step[-1]:
        k -= 1
    return k + 1 if n - k >= _SETTLED_STEPS else None


def _steady_once(run: _LongRun, steps: int, conf: AllocConf, capacity: int | None) -> SteadyState:
    return _steady_from(replay(run.iter_upto(steps), conf=conf, capacity_bytes=capacity), steps, capacity)


def _steady_from(r: AllocatorReport, steps: int, capacity: int | None) -> SteadyState:
    """The steady state read from a replay of `_LongRun.upto(steps)`."""
    per_step = [0] * steps
    setup = 0
    for label, res in r.peak_reserved_by_phase.items():
        step, sep, _phase = label.partition(_SEP)
        if sep:
            per_step[int(step) - 1] = max(per_step[int(step) - 1], res)
        else:
            setup = max(setup, res)
    oom_step = oom = None
    if r.oom is not None:
        step, sep, phase = r.oom.phase.partition(_SEP)
        oom_step, oom = (int(step), replace(r.oom, phase=phase)) if sep else (0, r.oom)
        per_step = per_step[:oom_step]
    return SteadyState(
        reserved_bytes=max([setup] + per_step), two_step_reserved_bytes=max([setup] + per_step[:2]),
        settled_after_steps=None if oom is not None else _settled(per_step), steps_replayed=len(per_step),
        step_reserved_bytes=tuple(per_step), capacity_bytes=capacity, oom_step=oom_step, oom=oom,
    )


def _steady(run: _LongRun, conf: AllocConf, capacity: int | None, max_steps: int) -> SteadyState | None:
    if not run.ok:
        return None
    steps = min(_FIRST_STEADY_STEPS, max_steps)
    st = _steady_once(run, steps, conf, capacity)
    if st.oom is None and st.settled_after_steps is None and max_steps > steps:
        st = _steady_once(run, max_steps, conf, capacity)
    return st


def steady_state(
    trace: Sequence[TraceEvent],
    *,
    conf: AllocConf = AllocConf(),
    capacity_bytes: int | None = None,
    max_steps: int = MAX_STEADY_STEPS,
) -> SteadyState | None:
    """Replay the training step until each step's peak reserved stops changing (at most `max_steps` steps).

    First `_FIRST_STEADY_STEPS` steps are replayed; when they have not settled, `max_steps`.
    None when the trace does not have two optimizer steps (an evaluation-only trace).

    Args:
        trace: a simulated trace with two optimizer steps (memfit.sim.engine).
        conf: allocator settings.
        capacity_bytes: memory available to PyTorch (free-and-retry and OOM modelled); None: unlimited.
        max_steps: bound on the optimizer steps replayed.
    """
    return _steady(_LongRun(trace), conf, capacity_bytes, max_steps)


# -- what memfit.estimate reports ----------------------------------------------------------------
@dataclass(frozen=True)
class BoundedReserved:
    """The allocator figures of one trace, every one of them bounded by a capacity."""

    report: AllocatorReport
    """The replay the reserved figures come from: at `capacity_bytes` (stopped at an OOM), or,
    without a capacity, at `required_bytes`."""
    capacity_bytes: int | None
    oom: OomEvent | None  #: the first OOM at `capacity_bytes`: in the trace, or in a later optimizer step
    oom_step: int | None  #: the optimizer step of that OOM (None: in the setup or the evaluation)
    required_bytes: int | None
    """Smallest capacity at which the trace and `MAX_STEADY_STEPS` training steps complete; None
    when `capacity_bytes` was given and is enough (then not searched)."""
    required_exact: bool  #: `required_bytes - RESOLUTION_BYTES` was seen to fail
    uncapped: AllocatorReport  #: the replay without any cap (cached blocks never released)
    steady: SteadyState | None  #: at `capacity_bytes`, or without one at `required_bytes`


def bounded_reserved(
    trace: Sequence[TraceEvent],
    *,
    conf: AllocConf = AllocConf(),
    capacity_bytes: int | None = None,
    lower_bytes: int = 0,
    search: bool = True,
    steady: bool = True,
) -> BoundedReserved:
    """The reserved figures of `trace` on a device with `capacity_bytes` available to PyTorch.

    With a capacity: the capped replay (free-and-retry, OOM), the steady state at that
    capacity, and, when either runs out of memory and `search` is set, the smallest capacity
    at which both complete. Without one: that smallest capacity, the replay and the steady
    state at it.

    Args:
        trace: the simulated trace.
        conf: allocator settings.
        capacity_bytes: memory available to PyTorch's allocator (the GPU's total minus memory
            outside PyTorch); None: no GPU given.
        lower_bytes: proven lower bound of the capacity the trace needs (its peak live bytes).
        search: search the smallest capacity when the run does not complete (else `required_bytes` is None).
        steady: replay the steady state too.
    """
    paused = gc.isenabled()
    gc.disable()  # the replays make ~10**5 short-lived objects; with torch and transformers imported, each
    try:  # collection scans ~4*10**5 objects: measured 0.38 s instead of 0.17 s for the seed case
        return _bounded(trace, conf, capacity_bytes, lower_bytes, search, steady)
    finally:
        if paused:
            gc.enable()


def _capped(trace: Sequence[TraceEvent], conf: AllocConf, capacity_bytes: int, uncapped: AllocatorReport
            ) -> AllocatorReport:
    """`replay(trace, conf=conf, capacity_bytes=capacity_bytes)`, taken from the uncapped replay when they must agree.

    The capacity changes a replay only through the driver: a cudaMalloc (`Driver.cuda_malloc`) fails when the
    reserved bytes plus the new segment would exceed it, and expandable segments size their address space by it
    (`AllocatorModel.va_bytes`). Without expandable segments, when the uncapped replay never reserved more than
    the capacity, every cudaMalloc of the capped replay succeeds as it did there, so the two run the same
    sequence of calls and give the same report (tests/allocator/test_reserved.py compares them). One replay of
    three saved per estimate (0.15 s of a seed-case estimate).
    """
    if not conf.expandable_segments and uncapped.oom is None and uncapped.peak_reserved_bytes <= capacity_bytes:
        return uncapped
    return replay(trace, conf=conf, capacity_bytes=capacity_bytes)


def _bounded(trace: Sequence[TraceEvent], conf: AllocConf, capacity_bytes: int | None, lower_bytes: int,
             search: bool, steady: bool) -> BoundedReserved:
    uncapped = replay(trace, conf=conf)
    run = _LongRun(trace)
    main = st = oom = oom_step = None
    need_trace, need_steady, failed = True, False, None
    if capacity_bytes is not None:
        main = _capped(trace, conf, capacity_bytes, uncapped)
        st = _steady(run, conf, capacity_bytes, MAX_STEADY_STEPS) if steady else None
        oom = main.oom
        if oom is not None:
            oom_step = _step_of(trace, oom.event_index)
        elif st is not None and st.oom is not None:
            oom, oom_step = st.oom, st.oom_step or None
        if oom is None or not search:
            return BoundedReserved(main, capacity_bytes, oom, oom_step, None, False, uncapped, st)
        need_trace = main.oom is not None
        need_steady = not need_trace  # the trace completes, a later step does not
        failed = capacity_bytes
    required, exact, at_required, st_required = 0, False, None, None
    if need_trace:
        s = smallest_capacity(trace, conf=conf, lower_bytes=lower_bytes, failed_bytes=failed, uncapped=uncapped)
        required, exact, at_required = s.required_bytes, s.exact, s.report
        if steady:
            st_required = _steady(run, conf, required, MAX_STEADY_STEPS)
            if st_required is not None and st_required.oom is not None:
                need_steady, failed = True, required
    if need_steady:  # later steps need more than the simulated ones: search the long run itself
        s2 = smallest_capacity(run.upto(MAX_STEADY_STEPS), conf=conf, failed_bytes=failed,
                               first_step_bytes=_NEAR_STEP_BYTES)
        required, exact = max(required, s2.required_bytes), s2.exact
        st_required = _steady_from(s2.report, MAX_STEADY_STEPS, s2.required_bytes)
        if main is None:
            at_required = replay(trace, conf=conf, capacity_bytes=required)
    if main is None:
        assert at_required is not None
        main, st = at_required, st_required
    return BoundedReserved(main, capacity_bytes, oom, oom_step, required, exact, uncapped, st)
