"""A faithful Python model of PyTorch's CUDA caching allocator, replaying a trace.

Rules follow `DeviceCachingAllocator` in c10/cuda/CUDACachingAllocator.cpp (torch 2.x,
read at pytorch/pytorch main, 2025); each rule names the C++ function it mirrors:

* `round_size`: < 512 B -> 512 B; otherwise a multiple of 512 B, or the next
  power-of-two division when `roundup_power2_divisions` applies to that size.
* `get_pool`: rounded size <= 1 MiB (`kSmallSize`) -> small pool, else large pool.
* `get_allocation_size`: small -> 2 MiB segment (`kSmallBuffer`); < 10 MiB
  (`kMinLargeAlloc`) -> 20 MiB segment (`kLargeBuffer`); else rounded up to 2 MiB.
* `BlockPool` / `BlockComparatorSize`: free blocks are ordered by (stream, size,
  address); a block is only reused on the stream it was allocated on.
* `get_free_block`: `lower_bound` of (stream, size, 0): the smallest adequate block of the
  stream, the lowest address among equal sizes; a request < max_split_size never takes a
  block >= max_split_size; a request >= max_split_size only takes a block
  < size + max_non_split_rounding (20 MiB, `kLargeBuffer`).
* `should_split`: small pool (or expandable segments): remainder >= 512 B; large pool:
  request < max_split_size and remainder > 1 MiB. The allocation takes the start of the
  free block, the remainder stays cached after it (`alloc_found_block`).
* `free` / `free_block` / `try_merge_blocks`: `free` lowers `allocated` at once (the trace's
  `free_requested`); a block used on other streams (`record_stream`) returns to the pool
  only when its events complete (`free_completed`, `process_events`), and merges with free
  neighbours then. Blocks waiting for events never merge.
* `malloc` miss path: `get_free_block` -> `garbage_collect_cached_blocks` (only with a
  memory fraction set) -> `alloc_block` (cudaMalloc) -> `release_available_cached_blocks`
  + `alloc_block` -> `release_cached_blocks` + `alloc_block` -> OOM.
* `emptyCache` -> `release_cached_blocks`: `synchronize_and_free_events`, then
  `release_blocks` of the large pool, then the small pool: cudaFree every unsplit cached
  block in (stream, size, address) order, unmap every fully free page of expandable
  segments.
* expandable segments (`ExpandableSegment`, `find_expandable_block`,
  `try_allocate_expandable_block`, `map_block`, `unmap_block`): one growing segment per
  (stream, pool) whose pages are 2 MiB (small pool) or 20 MiB (large pool); a miss maps
  just enough pages after the lowest free address; pages are only unmapped by
  `release_cached_blocks`.

What the CUDA driver decides (whether cudaMalloc / cuMemCreate succeeds and at which
address it returns memory) is a `Driver`: by default a capacity check and fresh,
increasing addresses; `memfit.allocator.snapshot` replaces it with the addresses a real
trace recorded, which is what makes best-fit ties (broken by address) exact.

Stats mirror `torch.cuda.memory_allocated` (sum of block sizes, lowered at `free`) and
`memory_reserved` (sum of segments / mapped pages).

Known limitations:

* No CUDA graph private pools.
* `capacity_bytes` is a hard limit on reserved bytes; the real driver can also fail
  through its own fragmentation of physical memory, which is not modelled.
* With expandable segments, `release_available_cached_blocks` is skipped (torch would
  assert on an expandable block there).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from memfit.allocator.conf import AllocConf
from memfit.allocator.constants import (  # noqa: F401  (re-exported: the model's rules use them)
    K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE,
)
from memfit.errors import MemfitError
from memfit.trace import TraceEvent

__all__ = [
    "AllocatorReport", "OomEvent", "replay", "round_size", "get_allocation_size", "AllocatorModel", "Driver", "Block",
    "LayoutConflict",
]
# the snapshot helpers (read, replay, export) live in memfit.allocator.snapshot

_DEFAULT_VA_BYTES = 1 << 40  # expandable segment address space when no capacity is given
_FIRST_PTR = 1 << 32  # first synthetic address the default driver hands out


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


class LayoutConflict(MemfitError):
    """A recorded entry the seeded layout cannot hold (`malloc_at` and the other `*_at` calls).

    `ptr` is the recorded address. On a genuine snapshot this means the reconstructed
    state before the recording is not the real one (`memfit.allocator.snapshot.recorded`
    searches the alternatives); otherwise the trace and the segments disagree.
    """

    def __init__(self, message: str, ptr: int) -> None:
        super().__init__(message)
        self.ptr = ptr


class Driver:
    """What the CUDA driver decides: cudaMalloc success and addresses, page mapping.

    The default is a device of `capacity_bytes` (None: unlimited) that hands out fresh,
    increasing addresses. `AllocatorModel` calls it; subclasses replay a recording.
    """

    def __init__(self, capacity_bytes: int | None = None, first_ptr: int = _FIRST_PTR) -> None:
        self.capacity = capacity_bytes
        self.next_ptr = first_ptr

    def fresh(self, size: int) -> int:
        ptr = self.next_ptr
        self.next_ptr += size
        return ptr

    def cuda_malloc(self, size: int, reserved: int) -> int | None:
        """The address of a new `size`-byte segment, or None (cudaErrorMemoryAllocation)."""
        if self.capacity is not None and reserved + size > self.capacity:
            return None
        return self.fresh(size)

    def cuda_free(self, ptr: int, size: int) -> None:
        """A segment was returned with cudaFree."""

    def reserve_address_space(self, size: int, page: int) -> int:
        """`cuMemAddressReserve`: the base of a new expandable segment's address range."""
        return self.fresh(size)

    def map_pages(self, ptr: int, size: int, reserved: int) -> bool:
        """`cuMemCreate` of `size` bytes of pages at `ptr`; False is CUDA_ERROR_OUT_OF_MEMORY."""
        return self.capacity is None or reserved + size <= self.capacity

    def unmap_pages(self, ptr: int, size: int) -> None:
        """`cuMemUnmap` + `cuMemRelease` of the pages at `ptr`."""


class _Seg:
    """`ExpandableSegment`: a reserved address range mapped in pages."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int) -> None:
        self.base, self.page, self.size = base, page, size


class Block:
    """`Block`: a piece of a segment, allocated, free (cached) or waiting for stream events."""

    __slots__ = ("size", "ptr", "stream", "pool", "allocated", "pending", "prev", "next",
                 "mapped", "seg", "gc_base", "requested")

    def __init__(self, size: int, ptr: int, stream: int, pool: _Pool, seg: _Seg | None = None) -> None:
        self.size, self.ptr, self.stream, self.pool, self.seg = size, ptr, stream, pool, seg
        self.allocated = False
        self.pending = False  #: freed by the program, waiting for events on other streams
        self.prev: Block | None = None
        self.next: Block | None = None
        self.mapped = True
        self.gc_base = 0
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def available(self) -> bool:
        """Neither allocated nor waiting for events (`try_merge_blocks`' test)."""
        return not self.allocated and not self.pending


def _key(b: Block) -> int:
    # BlockComparatorSize: (stream, size, address) as one integer
    return (b.stream << 128) | (b.size << 64) | b.ptr


def _addr_key(b: Block) -> int:
    # BlockComparatorAddress: (stream, address)
    return (b.stream << 64) | b.ptr


class _Pool:
    """`BlockPool`: free blocks sorted by (stream, size, address), unmapped ones by (stream, address)."""

    __slots__ = ("small", "keys", "blocks", "unmapped", "unmapped_blocks", "gc_calls", "free_at")

    def __init__(self, small: bool, free_at: dict[int, Block]) -> None:
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}
        self.unmapped: list[int] = []
        self.unmapped_blocks: dict[int, Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count
        self.free_at = free_at  # the model's address -> cached (or unmapped) block index

    def insert(self, b: Block) -> None:  # insert_into_blocks
        b.gc_base = self.gc_calls
        key = (b.stream << 128) | (b.size << 64) | b.ptr  # _key, inline: the replay's most frequent call
        insort(self.keys, key)
        self.blocks[key] = b
        self.free_at[b.ptr] = b

    def remove(self, b: Block) -> None:
        key = (b.stream << 128) | (b.size << 64) | b.ptr  # _key
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]
        if self.free_at.get(b.ptr) is b:
            del self.free_at[b.ptr]

    def insert_unmapped(self, b: Block) -> None:
        key = _addr_key(b)
        insort(self.unmapped, key)
        self.unmapped_blocks[key] = b
        self.free_at[b.ptr] = b

    def remove_unmapped(self, b: Block) -> None:
        key = _addr_key(b)
        del self.unmapped[bisect_left(self.unmapped, key)]
        del self.unmapped_blocks[key]
        if self.free_at.get(b.ptr) is b:
            del self.free_at[b.ptr]


#: one segment operation: ("segment_alloc" | "segment_free" | "segment_map" | "segment_unmap", address, bytes)
SegmentOp = tuple[str, int, int]


class AllocatorModel:
    """`DeviceCachingAllocator` for one device, driven by malloc / free / empty_cache calls.

    Args:
        conf: the allocator settings (`PYTORCH_CUDA_ALLOC_CONF`).
        driver: what the CUDA driver does (default: unlimited device, fresh addresses).
        allowed_bytes: `set_per_process_memory_fraction` * total memory, or None (no fraction set).
        va_bytes: address space of one expandable segment (torch: 1 1/8 of the device memory).
        on_event: called as `record_trace` is, with (action, address, bytes, stream) of every
            `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`,
            `segment_map`, `segment_unmap` and `oom`, in order (torch's `TraceEntry`).
    """

    def __init__(
        self, conf: AllocConf = AllocConf(), driver: Driver | None = None, *, allowed_bytes: int | None = None,
        va_bytes: int | None = None, on_event: Callable[[str, int, int, int], None] | None = None,
    ) -> None:
        self.conf = conf
        self.driver = driver if driver is not None else Driver()
        self.allowed = allowed_bytes
        self.max_split = conf.max_split_size_effective
        self.unlimited_split = conf.max_split_size_bytes is None
        self.free_at: dict[int, Block] = {}
        self.small, self.large = _Pool(True, self.free_at), _Pool(False, self.free_at)
        self.reserved = self.allocated = self.segments = 0
        self.n_malloc = self.n_free = self.n_retries = 0
        self.pending: dict[int, Block] = {}  # blocks waiting for stream events, by address
        self.live: dict[int, Block] = {}  # allocated blocks, by address
        self.gc_on = allowed_bytes is not None and bool(conf.garbage_collection_threshold)
        cap = self.driver.capacity
        self.va_bytes = va_bytes or (cap + cap // 8 if cap else _DEFAULT_VA_BYTES)
        self.on_event = on_event
        #: requested bytes -> (round_size, its pool, get_allocation_size): pure functions of the size and the
        #: (fixed) settings, and a trace repeats few sizes many times
        self._sizes: dict[int, tuple[int, _Pool, int]] = {}

    def _log(self, action: str, ptr: int, size: int, stream: int) -> None:
        if self.on_event is not None:
            self.on_event(action, ptr, size, stream)

    def pool_for(self, size: int) -> _Pool:
        return self.small if size <= K_SMALL_SIZE else self.large  # get_pool

    # -- malloc -----------------------------------------------------------------
    def malloc(self, orig: int, stream: int = 0) -> tuple[Block | None, int]:
        """`malloc`: the block for `orig` requested bytes on `stream` (None: OOM) and the segment size."""
        sized = self._sizes.get(orig)
        if sized is None:
            size = round_size(orig, self.conf)
            sized = self._sizes[orig] = (size, self.pool_for(size), get_allocation_size(size))
        size, pool, alloc_size = sized
        block = self.get_free_block(pool, stream, size)
        if block is None:
            if self.gc_on:
                self.garbage_collect()
            block = (
                self.alloc_block(pool, stream, size, alloc_size)
                or (self.release_available_cached_blocks(pool, stream, size)
                    and self.alloc_block(pool, stream, size, alloc_size))
                or (self.release_cached_blocks() and self.alloc_block(pool, stream, size, alloc_size, retry=True))
            ) or None
            if block is None:
                cap = self.driver.capacity
                self._log("oom", max(cap - self.reserved, 0) if cap is not None else 0, size, stream)
                return None, alloc_size
        return self.alloc_found_block(block, size, orig), alloc_size

    def find_free_block(self, pool: _Pool, stream: int, size: int) -> int | None:
        """The index in `pool.keys` `get_free_block` would take, without taking it."""
        keys = pool.keys
        i = bisect_left(keys, (stream << 128) | (size << 64))
        if i == len(keys):
            return None
        b = pool.blocks[keys[i]]
        if b.stream != stream:
            return None
        if b.seg is not None:
            if self.conf.expandable_segments:
                # best fit counts the unmapped tail an expandable block can grow into
                def exp_size(x: Block) -> int:
                    return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
                while b.seg is not None and i + 1 < len(keys):
                    nb = pool.blocks[keys[i + 1]]
                    if nb.stream != stream or exp_size(nb) >= exp_size(b):
                        break
                    i, b = i + 1, nb
            else:  # expandable segments turned off: only non-expandable blocks qualify
                i += 1
                while i < len(keys) and pool.blocks[keys[i]].seg is not None and pool.blocks[keys[i]].stream == stream:
                    i += 1
                if i == len(keys) or pool.blocks[keys[i]].stream != stream:
                    return None
                b = pool.blocks[keys[i]]
        if size < self.max_split and b.size >= self.max_split:
            return None  # do not return an oversized block for a smaller request
        if size >= self.max_split and b.size >= size + self.conf.max_non_split_rounding_bytes:
            return None  # oversized blocks may be rounded up only within a limit
        return i

    def get_free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        if self.gc_on:
            pool.gc_calls += 1
        i = self.find_free_block(pool, stream, size)
        if i is None:
            return None
        key = pool.keys.pop(i)  # pool.remove(b), its key's index known
        b = pool.blocks.pop(key)
        if pool.free_at.get(b.ptr) is b:
            del pool.free_at[b.ptr]
        return b

    def should_split(self, b: Block, size: int) -> bool:
        remaining = b.size - size
        if b.pool.small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split and remaining > K_SMALL_SIZE

    def alloc_found_block(self, b: Block, size: int, orig: int) -> Block:
        if self.should_split(b, size):
            new = Block(size, b.ptr, b.stream, b.pool, b.seg)
            new.prev, new.next = b.prev, b
            if b.prev is not None:
                b.prev.next = new
            b.prev = new
            b.ptr += size
            b.size -= size
            b.pool.insert(b)
            b = new
        b.allocated = True
        b.requested = orig
        self.allocated += b.size
        self.live[b.ptr] = b
        if self.on_event is not None:
            self.on_event("alloc", b.ptr, orig, b.stream)
        return b

    def alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int, retry: bool = False) -> Block | None:
        if retry:
            self.n_retries += 1
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self.conf.expandable_segments:
            return self.try_allocate_expandable_block(pool, stream, size)
        ptr = self.driver.cuda_malloc(alloc_size, self.reserved)
        if ptr is None:
            return None  # cudaMalloc -> cudaErrorMemoryAllocation
        b = Block(alloc_size, ptr, stream, pool)
        self.reserved += alloc_size
        self.segments += 1
        self.n_malloc += 1
        self._log("segment_alloc", ptr, alloc_size, stream)
        return b

    # -- expandable segments ------------------------------------------------------
    def new_expandable_segment(self, pool: _Pool, stream: int, base: int | None = None) -> Block:
        """A fresh `ExpandableSegment` (one unmapped block spanning its address space)."""
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        n_pages = -(-self.va_bytes // page)
        if base is None:
            base = self.driver.reserve_address_space(n_pages * page, page)
        seg = _Seg(base, page, n_pages * page)
        b = Block(n_pages * page, seg.base, stream, pool, seg)
        b.mapped = False
        pool.insert_unmapped(b)
        self.segments += 1
        return b

    def find_expandable_block(self, pool: _Pool, stream: int, size: int) -> Block:
        def allocatable(x: Block | None) -> bool:
            return x is not None and x.available()

        i = bisect_left(pool.unmapped, stream << 64)
        while i < len(pool.unmapped):
            c = pool.unmapped_blocks[pool.unmapped[i]]
            if c.stream != stream:
                break
            if allocatable(c.prev):
                c = c.prev  # type: ignore[assignment]
            total, x = 0, c
            while total < size and allocatable(x):
                total += x.size  # type: ignore[union-attr]
                x = x.next  # type: ignore[union-attr]
            if total >= size:
                return c
            i += 1
        return self.new_expandable_segment(pool, stream)

    def map_block(self, b: Block, size: int) -> bool:
        seg = b.seg
        assert seg is not None
        begin = (b.ptr - seg.base) // seg.page
        end = -(-(b.ptr + size - seg.base) // seg.page)
        mapped = (end - begin) * seg.page
        if mapped == 0 or not self.driver.map_pages(b.ptr, mapped, self.reserved):
            return False  # cuMemCreate -> CUDA_ERROR_OUT_OF_MEMORY
        pool = b.pool
        pool.remove_unmapped(b)
        b.mapped = True
        mapped_ptr = b.ptr
        if mapped < b.size:
            rest = Block(b.size - mapped, b.ptr + mapped, b.stream, pool, seg)
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
        self._log("segment_map", mapped_ptr, mapped, b.stream)
        return True

    def try_allocate_expandable_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        c = self.find_expandable_block(pool, stream, size)
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

    def unmap_block(self, b: Block) -> None:
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
            bf = Block(before, b.ptr, b.stream, pool, seg)
            bf.prev, bf.next = b.prev, b
            if b.prev is not None:
                b.prev.next = bf
            b.prev = bf
            pool.insert(bf)
        if after > 0:
            af = Block(after, start + length, b.stream, pool, seg)
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
        self.driver.unmap_pages(start, length)
        self._log("segment_unmap", start, length, b.stream)

    # -- free / merge / release ----------------------------------------------------
    def try_merge(self, dst: Block, src: Block | None) -> None:
        if src is None or not src.available() or src.mapped != dst.mapped:
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

    def free_requested(self, b: Block) -> None:
        """`free` of a block used on other streams: `allocated` drops, the block waits for events."""
        b.allocated = False
        b.pending = True
        self.allocated -= b.size
        del self.live[b.ptr]
        self.pending[b.ptr] = b
        self._log("free_requested", b.ptr, b.requested, b.stream)

    def free_completed(self, b: Block) -> None:
        """`free_block`: the block returns to its pool and merges with free neighbours."""
        if b.allocated:
            self.allocated -= b.size
            b.allocated = False
            del self.live[b.ptr]
            self._log("free_requested", b.ptr, b.requested, b.stream)
        if b.pending:
            b.pending = False
            del self.pending[b.ptr]
        self._log("free_completed", b.ptr, b.requested, b.stream)
        self.try_merge(b, b.prev)
        self.try_merge(b, b.next)
        b.pool.insert(b)

    def free(self, b: Block) -> None:  # free -> free_block (no other stream used the block)
        b.allocated = False
        self.allocated -= b.size
        del self.live[b.ptr]
        if self.on_event is not None:
            self.on_event("free_requested", b.ptr, b.requested, b.stream)
            self.on_event("free_completed", b.ptr, b.requested, b.stream)
        # try_merge's own first test, inline: most neighbours are allocated or absent
        p, n = b.prev, b.next
        if p is not None and not p.allocated and not p.pending:
            self.try_merge(b, p)
        if n is not None and not n.allocated and not n.pending:
            self.try_merge(b, n)
        b.pool.insert(b)

    def release_block(self, b: Block) -> None:
        b.pool.remove(b)
        self.reserved -= b.size
        self.segments -= 1
        self.n_free += 1
        self.driver.cuda_free(b.ptr, b.size)
        self._log("segment_free", b.ptr, b.size, b.stream)

    def release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        if self.unlimited_split or self.conf.expandable_segments:
            return False
        key_size = max(size, self.max_split)
        keys = pool.keys
        i = bisect_left(keys, (stream << 128) | (key_size << 64))
        if i < len(keys) and pool.blocks[keys[i]].stream == stream:
            b = pool.blocks[keys[i]]
            if not b.is_split():
                self.release_block(b)
            return True
        if i == 0:
            return False
        released, i = 0, i - 1  # no single block suffices: free oversize blocks, largest first
        while released < key_size and i >= 0:
            b = pool.blocks[keys[i]]
            if b.size < self.max_split or b.stream != stream or b.is_split():
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

    def synchronize_and_free_events(self) -> None:
        for b in list(self.pending.values()):
            self.free_completed(b)

    def release_cached_blocks(self) -> bool:
        self.synchronize_and_free_events()
        self.release_blocks(self.large)
        self.release_blocks(self.small)
        return True

    def empty_cache(self) -> None:  # emptyCache
        self.release_cached_blocks()

    def garbage_collect(self) -> None:  # garbage_collect_cached_blocks
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)  # type: ignore[operator]
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = [pool.gc_calls - b.gc_base for b in pool.blocks.values() if not b.is_split()]
        total_age, count = sum(ages), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold, freed = total_age / count, False
            for key in list(pool.keys):
                b = pool.blocks[key]
                age = pool.gc_calls - b.gc_base
                if not b.is_split() and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self.release_block(b)

    # -- a recorded layout: state seeding and allocation at given addresses -------------
    def add_segment(self, ptr: int, size: int, stream: int, small: bool,
                    blocks: Iterable[tuple[int, int, str, int]] = ()) -> list[Block]:
        """Seed a cudaMalloc'd segment that exists already.

        Args:
            ptr: its address; size: its bytes; stream: the stream it belongs to.
            small: whether it is a small-pool segment.
            blocks: (address, bytes, state, requested bytes) of its allocated or pending
                blocks, state `allocated` or `pending`; the gaps between them are cached.
        """
        pool = self.small if small else self.large
        out: list[Block] = []
        cursor, prev = ptr, None

        def link(b: Block) -> None:
            nonlocal prev
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b

        free_blocks = []
        for bptr, bsize, state, requested in sorted(blocks):
            if bptr < cursor or bptr + bsize > ptr + size:
                raise MemfitError(
                    f"block at `{bptr:#x}` ({bsize} B) does not fit segment `{ptr:#x}` ({size} B) "
                    "after the blocks before it; the snapshot's segments are inconsistent")
            if bptr > cursor:
                gap = Block(bptr - cursor, cursor, stream, pool)
                link(gap)
                free_blocks.append(gap)
            b = Block(bsize, bptr, stream, pool)
            b.requested = requested
            if state == "allocated":
                b.allocated = True
                self.allocated += bsize
                self.live[bptr] = b
            else:
                b.pending = True
                self.pending[bptr] = b
            link(b)
            out.append(b)
            cursor = bptr + bsize
        if cursor < ptr + size:
            gap = Block(ptr + size - cursor, cursor, stream, pool)
            link(gap)
            free_blocks.append(gap)
        for b in free_blocks:
            pool.insert(b)
        self.reserved += size
        self.segments += 1
        return out

    def add_expandable_segment(self, base: int, stream: int, small: bool,
                               ranges: Iterable[tuple[int, int, list[tuple[int, int, str, int]]]]) -> list[Block]:
        """Seed an expandable segment at `base` with its mapped `ranges` (address, bytes, blocks)."""
        pool = self.small if small else self.large
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        n_pages = -(-self.va_bytes // page)
        seg = _Seg(base, page, n_pages * page)
        out: list[Block] = []
        chain: list[Block] = []
        cursor = base
        for rptr, rsize, blocks in sorted(ranges):
            if rptr < cursor or (rptr - base) % page or rsize % page:
                raise MemfitError(f"expandable range at `{rptr:#x}` ({rsize} B) is not page-aligned "
                                  f"after `{cursor:#x}`; the snapshot's segments are inconsistent")
            if rptr > cursor:
                un = Block(rptr - cursor, cursor, stream, pool, seg)
                un.mapped = False
                chain.append(un)
            pos = rptr
            for bptr, bsize, state, requested in sorted(blocks):
                if bptr > pos:
                    chain.append(Block(bptr - pos, pos, stream, pool, seg))
                b = Block(bsize, bptr, stream, pool, seg)
                b.requested = requested
                if state == "allocated":
                    b.allocated = True
                    self.allocated += bsize
                    self.live[bptr] = b
                else:
                    b.pending = True
                    self.pending[bptr] = b
                chain.append(b)
                out.append(b)
                pos = bptr + bsize
            if pos < rptr + rsize:
                chain.append(Block(rptr + rsize - pos, pos, stream, pool, seg))
            self.reserved += rsize
            cursor = rptr + rsize
        if cursor < base + seg.size:
            un = Block(base + seg.size - cursor, cursor, stream, pool, seg)
            un.mapped = False
            chain.append(un)
        for a, b in zip(chain, chain[1:]):
            a.next, b.prev = b, a
        for b in chain:
            if not b.mapped:
                pool.insert_unmapped(b)
            elif b.available():
                pool.insert(b)
        self.segments += 1
        return out

    def malloc_at(self, orig: int, stream: int, ptr: int) -> Block:
        """Allocate `orig` bytes at the recorded address `ptr` (the start of a cached block)."""
        size = round_size(orig, self.conf)
        b = self.free_at.get(ptr)
        if b is None or not b.mapped or b.stream != stream or b.size < size or b.pool is not self.pool_for(size):
            raise LayoutConflict(
                f"the recording allocates {orig} B at `{ptr:#x}` where the reconstructed state has no cached "
                "block of that size on that stream; the snapshot's trace and segments disagree", ptr)
        b.pool.remove(b)
        return self.alloc_found_block(b, size, orig)

    def carve_at(self, orig: int, stream: int, ptr: int) -> Block | None:
        """`malloc_at` where no cached block starts at `ptr`: split the cached block that holds
        [ptr, ptr + size) there and allocate from its upper part (None: no cached block holds it).

        Only for replaying a recording whose state before it could not be reconstructed
        exactly: the real allocator never splits a block at an address it did not choose.
        """
        size = round_size(orig, self.conf)
        pool = self.pool_for(size)
        for b in list(pool.blocks.values()):
            if b.stream == stream and b.mapped and b.ptr < ptr and ptr + size <= b.ptr + b.size:
                pool.remove(b)
                upper = Block(b.ptr + b.size - ptr, ptr, stream, pool, b.seg)
                upper.prev, upper.next = b, b.next
                if b.next is not None:
                    b.next.prev = upper
                b.next = upper
                b.size = ptr - b.ptr
                pool.insert(b)
                return self.alloc_found_block(upper, size, orig)
        return None

    def segment_alloc_at(self, ptr: int, size: int, stream: int) -> None:
        """A recorded cudaMalloc: a new, entirely cached segment (the next alloc takes from it)."""
        b = Block(size, ptr, stream, self.small if size == K_SMALL_BUFFER else self.large)
        b.pool.insert(b)
        self.reserved += size
        self.segments += 1
        self.n_malloc += 1

    def segment_free_at(self, ptr: int, size: int) -> None:
        """A recorded cudaFree of the cached, unsplit segment at `ptr`."""
        b = self.free_at.get(ptr)
        if b is None or not b.mapped or b.size != size or b.is_split() or b.seg is not None:
            raise LayoutConflict(f"the recording frees segment `{ptr:#x}` ({size} B) that the reconstructed state "
                                 "does not hold as one cached block; the snapshot's trace and segments disagree", ptr)
        self.release_block(b)

    def segment_map_at(self, ptr: int, size: int) -> None:
        """A recorded `segment_map` of `size` bytes at the start of the unmapped block at `ptr`."""
        b = self.free_at.get(ptr)
        if b is None or b.mapped or b.seg is None or not self.map_block(b, size):
            raise LayoutConflict(f"the recording maps `{ptr:#x}` ({size} B) where the reconstructed state has no "
                                 "unmapped expandable block; the snapshot's trace and segments disagree", ptr)

    def segment_unmap_at(self, ptr: int, size: int) -> None:
        """A recorded `segment_unmap`: the pages [ptr, ptr + size) of a cached expandable block."""
        for pool in (self.large, self.small):
            for b in list(pool.blocks.values()):
                if b.seg is not None and b.ptr <= ptr < b.ptr + b.size:
                    seg = b.seg
                    begin = -(-(b.ptr - seg.base) // seg.page)
                    end = (b.ptr + b.size - seg.base) // seg.page
                    if seg.base + begin * seg.page != ptr or (end - begin) * seg.page != size:
                        break
                    self.unmap_block(b)
                    if b.prev is None and b.next is None:
                        pool.remove_unmapped(b)  # release_expandable_segment
                        self.segments -= 1
                    return
        raise LayoutConflict(f"the recording unmaps `{ptr:#x}` ({size} B) outside any cached expandable block; "
                             "the snapshot's trace and segments disagree", ptr)

    def state(self) -> list[dict[str, Any]]:
        """The segments now, as `torch.cuda.memory._snapshot()['segments']` lists them (`snapshot`)."""
        starts = list(self.live.values()) + list(self.pending.values())
        for pool in (self.small, self.large):
            starts += list(pool.blocks.values()) + list(pool.unmapped_blocks.values())
        heads: dict[int, Block] = {}
        for s in starts:
            x = s
            while x.prev is not None:
                x = x.prev
            heads[id(x)] = x
        out = []
        for head in heads.values():
            x: Block | None = head
            while x is not None:
                if not x.mapped:  # expandable: one segment per contiguous mapped range
                    x = x.next
                    continue
                first, blocks = x, []
                while x is not None and x.mapped:
                    state = ("active_allocated" if x.allocated else
                             "active_pending_free" if x.pending else "inactive")
                    blocks.append({"address": x.ptr, "size": x.size, "requested_size": x.requested,
                                   "state": state, "frames": []})
                    x = x.next
                active = [bl for bl in blocks if bl["state"] != "inactive"]
                out.append({
                    "device": 0, "address": first.ptr, "total_size": sum(bl["size"] for bl in blocks),
                    "stream": first.stream, "segment_type": "small" if first.pool.small else "large",
                    "segment_pool_id": (0, 0), "is_expandable": first.seg is not None,
                    "allocated_size": sum(bl["size"] for bl in blocks if bl["state"] == "active_allocated"),
                    "active_size": sum(bl["size"] for bl in active),
                    "requested_size": sum(bl["requested_size"] for bl in active),
                    "blocks": blocks, "frames": [],
                })
        return sorted(out, key=lambda s: s["address"])


def replay(
    events: Iterable[TraceEvent],
    *,
    conf: AllocConf = AllocConf(),
    capacity_bytes: int | None = None,
    allowed_bytes: int | None = None,
    reserved_after: list[int] | None = None,
) -> AllocatorReport:
    """Replay a trace through the caching-allocator model.

    `capacity_bytes`: what PyTorch's cache may reserve on the device (total memory minus
    CUDA context and other non-PyTorch memory); None means unlimited. `allowed_bytes`:
    the cap from `torch.cuda.set_per_process_memory_fraction` (also what enables
    `garbage_collection_threshold`, as in PyTorch). The replay stops at the first OOM.
    `reserved_after`: a list that gets `memory_reserved()` after each event replayed, and after
    the failing request of an OOM the cache as the failure leaves it (memfit.report.timeline's
    reserved line comes from the very replay its report does).
    """
    m = AllocatorModel(conf, Driver(capacity_bytes), allowed_bytes=allowed_bytes)
    live: dict[int, Block] = {}
    zero_ids: set[int] = set()
    peak_alloc = peak_res = res_at_peak_alloc = alloc_at_peak_res = segs_at_peak = 0
    by_phase_res: dict[str, int] = {}
    by_phase_alloc: dict[str, int] = {}
    oom: OomEvent | None = None
    n = 0
    malloc, free, live_pop = m.malloc, m.free, live.pop  # bound once: the loop runs once per event
    series = reserved_after.append if reserved_after is not None else None
    for n, ev in enumerate(events, 1):
        action = ev.action
        if action == "alloc":
            eid = ev.id
            if eid in live or (zero_ids and eid in zero_ids):
                raise MemfitError(f"trace allocates id `{eid}` twice; every alloc needs a fresh id")
            if ev.size_bytes == 0:  # CUDACachingAllocator::allocate skips malloc for 0 bytes
                zero_ids.add(eid)
                if series is not None:
                    series(m.reserved)
                continue
            block, alloc_size = malloc(ev.size_bytes)
            if block is None:
                cap = capacity_bytes if capacity_bytes is not None else (allowed_bytes or 0)
                oom = OomEvent(n - 1, ev.phase, ev.category, ev.module, ev.size_bytes, alloc_size,
                               m.allocated, m.reserved, cap, max(cap - m.reserved, 0))
                if series is not None:
                    series(m.reserved)
                break
            live[eid] = block
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
            b = live_pop(ev.id, None)
            if b is None:
                if ev.id in zero_ids:
                    zero_ids.discard(ev.id)
                    if series is not None:
                        series(m.reserved)
                    continue
                raise MemfitError(f"trace frees id `{ev.id}` that is not allocated; free each alloc once")
            free(b)
            r = m.reserved
        elif action == "empty_cache":
            m.release_cached_blocks()
            r = m.reserved
        else:
            raise MemfitError(f"trace action `{action}` is unknown; use `alloc`, `free` or `empty_cache`")
        if by_phase_res.get(ev.phase, -1) < r:
            by_phase_res[ev.phase] = r
        if series is not None:
            series(r)
    return AllocatorReport(
        peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_res,
        reserved_at_peak_allocated_bytes=res_at_peak_alloc,
        fragmentation_at_peak_bytes=peak_res - alloc_at_peak_res,
        num_segments_at_peak=segs_at_peak, num_cudamalloc=m.n_malloc, num_cudafree=m.n_free,
        num_alloc_retries=m.n_retries, final_allocated_bytes=m.allocated,
        final_reserved_bytes=m.reserved, num_events=n, oom=oom,
        peak_reserved_by_phase=by_phase_res, peak_allocated_by_phase=by_phase_alloc,
    )

