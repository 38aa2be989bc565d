"""A faithful Python model of PyTorch's CUDA caching allocator, replaying a trace.

Rules follow `DeviceCachingAllocator` in c10/cuda/CUDACachingAllocator.cpp (torch 2.x,
read at pytorch/pytorch main, 2025); each rule names the C++ function it mirrors:

* `round_size`: < 512 B -> 512 B; otherwise a multiple of 512 B, or the next
  power-of-two division when `roundup_power2_divisions` applies to that size.
* `get_pool`: rounded size <= 1 MiB (`kSmallSize`) -> small pool, else large pool.
* `get_allocation_size`: small -> 2 MiB segment (`kSmallBuffer`); < 10 MiB
  (`kMinLargeAlloc`) -> 20 MiB segment (`kLargeBuffer`); else rounded up to 2 MiB.
* `get_free_block`: best fit by (size, address) among cached free blocks of the pool;
  a request < max_split_size never takes a block >= max_split_size; a request
  >= max_split_size only takes a block < size + max_non_split_rounding (20 MiB).
* `should_split`: small pool (or expandable segments): remainder >= 512 B; large pool:
  request < max_split_size and remainder > 1 MiB.
* `free_block` / `try_merge_blocks`: a freed block merges with free neighbours.
* `malloc` miss path: `get_free_block` -> `garbage_collect_cached_blocks` (only with a
  memory fraction set) -> `alloc_block` (cudaMalloc) -> `release_available_cached_blocks`
  + `alloc_block` -> `release_cached_blocks` + `alloc_block` -> OOM.
* `emptyCache` -> `release_cached_blocks`: cudaFree every unsplit cached segment, unmap
  every fully free page of expandable segments.
* expandable segments (`ExpandableSegment`, `try_allocate_expandable_block`,
  `map_block`, `unmap_block`): one growing segment per pool whose pages are 2 MiB
  (small pool) or 20 MiB (large pool); a miss maps just enough pages after the lowest
  free address; pages are only unmapped by `release_cached_blocks`.

Stats mirror `torch.cuda.memory_allocated` (sum of rounded block sizes) and
`memory_reserved` (sum of segments / mapped pages).

Known limitations:

* One stream; no cross-stream `record_stream` events, no CUDA graph private pools.
* Addresses are synthetic (fresh, increasing): ties between equal-size free blocks are
  broken by creation order, whereas the driver may reuse lower addresses.
* `capacity_bytes` is a hard limit on reserved bytes; the real driver can also fail
  through its own fragmentation of physical memory, which is not modelled.
* Real traces (memfit.allocator.snapshot) cannot show allocations made before recording
  started.
* With expandable segments, `release_available_cached_blocks` is skipped (torch would
  assert on an expandable block there).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass, field

from memfit.allocator.conf import AllocConf
from memfit.errors import MemfitError
from memfit.trace import TraceEvent

__all__ = [
    "AllocatorReport", "OomEvent", "replay", "round_size",
    "get_allocation_size",
]

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 B
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: small allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20971520  # kLargeBuffer: 1..10 MiB allocations are packed in 20 MiB segments
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: from 10 MiB a segment is sized to the request
K_ROUND_LARGE = 2097152  # kRoundLarge: large segments are rounded up to 2 MiB
_SHIFT = 52  # sort key = size << 52 | address (addresses stay < 2**52)
_MASK = (1 << _SHIFT) - 1
_DEFAULT_VA_BYTES = 1 << 40  # expandable segment address space when no capacity is given


def _pow2_next_division(size: int, divisions: int) -> int:
    """`roundup_power2_next_division`."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)  # llvm::PowerOf2Floor
    step = floor >> (divisions.bit_length() - 1)  # >> (63 - countLeadingZeros(divisions))
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size_bytes: int, conf: AllocConf | None = None) -> int:
    """`round_size`: the block size PyTorch uses for a request of `size_bytes`."""
    if size_bytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = conf.divisions_for(size_bytes) if conf is not None else 0
    if divisions > 1 and size_bytes > K_MIN_BLOCK_SIZE * divisions:
        return _pow2_next_division(size_bytes, divisions)
    return K_MIN_BLOCK_SIZE * ((size_bytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size_bytes: int) -> int:
    """`get_allocation_size`: the segment cudaMalloc'd for a rounded request."""
    if size_bytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size_bytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size_bytes + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(frozen=True)
class OomEvent:
    """Where and how the replay ran out of memory (torch's OutOfMemoryError)."""

    event_index: int
    phase: str
    category: str
    module: str
    requested_bytes: int  #: the raw nbytes of the failing request
    tried_to_allocate_bytes: int  #: `format_size(alloc_size)` in the message: the segment size
    allocated_bytes: int  #: "is allocated by PyTorch" (after releasing cached blocks)
    reserved_bytes: int  #: allocated + "reserved by PyTorch but unallocated"
    capacity_bytes: int
    free_bytes: int  #: capacity - reserved


@dataclass(frozen=True)
class AllocatorReport:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_at_peak_allocated_bytes: int
    #: peak reserved minus the most allocated while reserved stood at that peak
    fragmentation_at_peak_bytes: int
    num_segments_at_peak: int
    num_cudamalloc: int  #: cudaMalloc calls (page-mapping calls with expandable segments)
    num_cudafree: int
    num_alloc_retries: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    num_events: int
    oom: OomEvent | None
    peak_reserved_by_phase: dict[str, int] = field(default_factory=dict)
    peak_allocated_by_phase: dict[str, int] = field(default_factory=dict)


class _Seg:
    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int) -> None:
        self.base, self.page = base, page


class _Block:
    __slots__ = ("size", "ptr", "pool", "allocated", "prev", "next", "mapped", "seg", "gc_base")

    def __init__(self, size: int, ptr: int, pool: _Pool, seg: _Seg | None = None) -> None:
        self.size, self.ptr, self.pool, self.seg = size, ptr, pool, seg
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.mapped = True
        self.gc_base = 0


class _Pool:
    """`BlockPool`: free blocks sorted by (size, address), unmapped ones by address."""

    __slots__ = ("small", "keys", "blocks", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped: list[int] = []  # sorted addresses
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, b: _Block) -> None:  # insert_into_blocks
        b.gc_base = self.gc_calls
        key = (b.size << _SHIFT) | b.ptr
        insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.size << _SHIFT) | b.ptr
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def insert_unmapped(self, b: _Block) -> None:
        insort(self.unmapped, b.ptr)
        self.blocks[-b.ptr - 1] = b

    def remove_unmapped(self, b: _Block) -> None:
        del self.unmapped[bisect_left(self.unmapped, b.ptr)]
        del self.blocks[-b.ptr - 1]


class _Model:
    def __init__(self, conf: AllocConf, capacity: int | None, allowed: int | None) -> None:
        self.conf = conf
        self.capacity = capacity
        self.allowed = allowed  # set_per_process_memory_fraction * total, or None
        self.max_split = conf.max_split_size_effective
        self.small, self.large = _Pool(True), _Pool(False)
        self.reserved = self.allocated = self.segments = 0
        self.n_malloc = self.n_free = self.n_retries = 0
        self.next_ptr = 1 << 32
        self.gc_on = allowed is not None and bool(conf.garbage_collection_threshold)
        self.va_bytes = capacity + capacity // 8 if capacity else _DEFAULT_VA_BYTES

    # -- malloc -----------------------------------------------------------------
    def malloc(self, orig: int) -> tuple[_Block | None, int]:
        size = round_size(orig, self.conf)
        pool = self.small if size <= K_SMALL_SIZE else self.large  # get_pool
        alloc_size = get_allocation_size(size)
        block = self.get_free_block(pool, size)
        if block is None:
            if self.gc_on:
                self.garbage_collect()
            block = (
                self.alloc_block(pool, size, alloc_size)
                or (self.release_available_cached_blocks(pool, size) and self.alloc_block(pool, size, alloc_size))
                or (self.release_cached_blocks() and self.alloc_block(pool, size, alloc_size, retry=True))
            ) or None
            if block is None:
                return None, alloc_size
        return self.alloc_found_block(block, size), alloc_size

    def get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.gc_on:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        b = pool.blocks[keys[i]]
        if b.seg is not None:  # best fit counts the unmapped tail an expandable block can grow into
            def exp_size(x: _Block) -> int:
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            while b.seg is not None and i + 1 < len(keys):
                nb = pool.blocks[keys[i + 1]]
                if exp_size(nb) >= exp_size(b):
                    break
                i, b = i + 1, nb
        if size < self.max_split and b.size >= self.max_split:
            return None  # do not return an oversized block for a smaller request
        if size >= self.max_split and b.size >= size + self.conf.max_non_split_rounding_bytes:
            return None  # oversized blocks may be rounded up only within a limit
        del keys[i]
        del pool.blocks[(b.size << _SHIFT) | b.ptr]
        return b

    def should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.pool.small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split and remaining > K_SMALL_SIZE

    def alloc_found_block(self, b: _Block, size: int) -> _Block:
        if self.should_split(b, size):
            new = _Block(size, b.ptr, b.pool, b.seg)
            new.prev, new.next = b.prev, b
            if b.prev is not None:
                b.prev.next = new
            b.prev = new
            b.ptr += size
            b.size -= size
            b.pool.insert(b)
            b = new
        b.allocated = True
        self.allocated += b.size
        return b

    def alloc_block(self, pool: _Pool, size: int, alloc_size: int, retry: bool = False) -> _Block | None:
        if retry:
            self.n_retries += 1
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self.conf.expandable_segments:
            return self.try_allocate_expandable_block(pool, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None  # cudaMalloc -> cudaErrorMemoryAllocation
        b = _Block(alloc_size, self.next_ptr, pool)
        self.next_ptr += alloc_size
        self.reserved += alloc_size
        self.segments += 1
        self.n_malloc += 1
        return b

    # -- expandable segments ------------------------------------------------------
    def find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def allocatable(x: _Block | None) -> bool:
            return x is not None and not x.allocated

        for ptr in pool.unmapped:
            c = pool.blocks[-ptr - 1]
            if allocatable(c.prev):
                c = c.prev  # type: ignore[assignment]
            total, x = 0, c
            while total < size and allocatable(x):
                total += x.size  # type: ignore[union-attr]
                x = x.next  # type: ignore[union-attr]
            if total >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        n_pages = -(-self.va_bytes // page)
        seg = _Seg(self.next_ptr, page)
        self.next_ptr += n_pages * page
        b = _Block(n_pages * page, seg.base, pool, seg)
        b.mapped = False
        pool.insert_unmapped(b)
        self.segments += 1
        return b

    def map_block(self, b: _Block, size: int) -> bool:
        seg = b.seg
        assert seg is not None
        begin = (b.ptr - seg.base) // seg.page
        end = -(-(b.ptr + size - seg.base) // seg.page)
        mapped = (end - begin) * seg.page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate -> CUDA_ERROR_OUT_OF_MEMORY
        pool = b.pool
        pool.remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.size - mapped, b.ptr + mapped, pool, seg)
            rest.mapped = False
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            pool.insert_unmapped(rest)
            b.size = mapped
        self.try_merge(b, b.prev)
        self.try_merge(b, b.next)
        pool.insert(b)
        self.reserved += mapped
        self.n_malloc += 1
        return True

    def try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        c = self.find_expandable_block(pool, size)
        if not c.mapped and not self.map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None
            if not self.map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def unmap_block(self, b: _Block) -> None:
        seg = b.seg
        assert seg is not None
        begin = -(-(b.ptr - seg.base) // seg.page)
        end = (b.ptr + b.size - seg.base) // seg.page
        if begin >= end:
            return
        pool = b.pool
        pool.remove(b)
        start, length = seg.base + begin * seg.page, (end - begin) * seg.page
        before, after = start - b.ptr, b.size - (start - b.ptr) - length
        if before > 0:
            bf = _Block(before, b.ptr, pool, seg)
            bf.prev, bf.next = b.prev, b
            if b.prev is not None:
                b.prev.next = bf
            b.prev = bf
            pool.insert(bf)
        if after > 0:
            af = _Block(after, start + length, pool, seg)
            af.prev, af.next = b, b.next
            if b.next is not None:
                b.next.prev = af
            b.next = af
            pool.insert(af)
        b.ptr, b.size, b.mapped = start, length, False
        self.try_merge(b, b.prev)
        self.try_merge(b, b.next)
        pool.insert_unmapped(b)
        self.reserved -= length
        self.n_free += 1

    # -- free / merge / release ----------------------------------------------------
    def try_merge(self, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            src.pool.remove(src)
        else:
            src.pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def free(self, b: _Block) -> None:  # free -> free_block
        b.allocated = False
        self.allocated -= b.size
        self.try_merge(b, b.prev)
        self.try_merge(b, b.next)
        b.pool.insert(b)

    def release_block(self, b: _Block) -> None:
        b.pool.remove(b)
        self.reserved -= b.size
        self.segments -= 1
        self.n_free += 1

    def release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        if self.conf.max_split_size_bytes is None or self.conf.expandable_segments:
            return False
        key_size = max(size, self.max_split)
        keys = pool.keys
        i = bisect_left(keys, key_size << _SHIFT)
        if i < len(keys):
            b = pool.blocks[keys[i]]
            if b.prev is None and b.next is None:
                self.release_block(b)
            return True
        if i == 0:
            return False
        released, i = 0, i - 1  # no single block suffices: free oversize blocks, largest first
        while released < key_size and i >= 0:
            b = pool.blocks[keys[i]]
            if b.size < self.max_split or b.prev is not None or b.next is not None:
                break
            released += b.size
            self.release_block(b)
            i -= 1
        return released >= key_size

    def release_blocks(self, pool: _Pool) -> None:
        to_unmap = []
        for key in list(pool.keys):
            b = pool.blocks[key]
            if b.seg is not None:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self.release_block(b)
        for b in to_unmap:
            self.unmap_block(b)
            if b.prev is None and b.next is None and not b.mapped:
                pool.remove_unmapped(b)  # release_expandable_segment
                self.segments -= 1

    def release_cached_blocks(self) -> bool:
        self.release_blocks(self.large)
        self.release_blocks(self.small)
        return True

    def garbage_collect(self) -> None:  # garbage_collect_cached_blocks
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)  # type: ignore[operator]
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = [pool.gc_calls - b.gc_base for b in pool.blocks.values()
                if b.mapped and b.prev is None and b.next is None]
        total_age, count = sum(ages), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold, freed = total_age / count, False
            for key in list(pool.keys):
                b = pool.blocks[key]
                age = pool.gc_calls - b.gc_base
                if b.prev is None and b.next is None and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self.release_block(b)


def replay(
    events: Iterable[TraceEvent],
    *,
    conf: AllocConf = AllocConf(),
    capacity_bytes: int | None = None,
    allowed_bytes: int | None = None,
) -> AllocatorReport:
    """Replay a trace through the caching-allocator model.

    `capacity_bytes`: what PyTorch's cache may reserve on the device (total memory minus
    CUDA context and other non-PyTorch memory); None means unlimited. `allowed_bytes`:
    the cap from `torch.cuda.set_per_process_memory_fraction` (also what enables
    `garbage_collection_threshold`, as in PyTorch). The replay stops at the first OOM.
    """
    m = _Model(conf, capacity_bytes, allowed_bytes)
    live: dict[int, _Block] = {}
    zero_ids: set[int] = set()
    peak_alloc = peak_res = res_at_peak_alloc = alloc_at_peak_res = segs_at_peak = 0
    by_phase_res: dict[str, int] = {}
    by_phase_alloc: dict[str, int] = {}
    oom: OomEvent | None = None
    n = 0
    for n, ev in enumerate(events, 1):
        action = ev.action
        if action == "alloc":
            if ev.id in live or ev.id in zero_ids:
                raise MemfitError(f"trace allocates id `{ev.id}` twice; every alloc needs a fresh id")
            if ev.size_bytes == 0:  # CUDACachingAllocator::allocate skips malloc for 0 bytes
                zero_ids.add(ev.id)
                continue
            block, alloc_size = m.malloc(ev.size_bytes)
            if block is None:
                cap = capacity_bytes if capacity_bytes is not None else (allowed_bytes or 0)
                oom = OomEvent(n - 1, ev.phase, ev.category, ev.module, ev.size_bytes, alloc_size,
                               m.allocated, m.reserved, cap, max(cap - m.reserved, 0))
                break
            live[ev.id] = block
            a, r = m.allocated, m.reserved
            if a > peak_alloc:
                peak_alloc, res_at_peak_alloc = a, r
            if r > peak_res:
                peak_res, alloc_at_peak_res, segs_at_peak = r, a, m.segments
            elif r == peak_res and a > alloc_at_peak_res:
                alloc_at_peak_res = a
            if by_phase_alloc.get(ev.phase, -1) < a:
                by_phase_alloc[ev.phase] = a
        elif action == "free":
            b = live.pop(ev.id, None)
            if b is None:
                if ev.id in zero_ids:
                    zero_ids.discard(ev.id)
                    continue
                raise MemfitError(f"trace frees id `{ev.id}` that is not allocated; free each alloc once")
            m.free(b)
        elif action == "empty_cache":
            m.release_cached_blocks()
        else:
            raise MemfitError(f"trace action `{action}` is unknown; use `alloc`, `free` or `empty_cache`")
        if by_phase_res.get(ev.phase, -1) < m.reserved:
            by_phase_res[ev.phase] = m.reserved
    return AllocatorReport(
        peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_res,
        reserved_at_peak_allocated_bytes=res_at_peak_alloc,
        fragmentation_at_peak_bytes=peak_res - alloc_at_peak_res,
        num_segments_at_peak=segs_at_peak, num_cudamalloc=m.n_malloc, num_cudafree=m.n_free,
        num_alloc_retries=m.n_retries, final_allocated_bytes=m.allocated,
        final_reserved_bytes=m.reserved, num_events=n, oom=oom,
        peak_reserved_by_phase=by_phase_res, peak_allocated_by_phase=by_phase_alloc,
    )

