"""CPU-testable out-of-memory: run real training on the CPU as if the GPU had `limit_bytes`.

    from memfit.testing import memory_budget
    with memory_budget(300 * 2**20, count=(model,)) as budget:
        trainer.train()            # raises torch.OutOfMemoryError past 300 MiB of live tensors
    print(budget.peak_bytes)

A TorchDispatchMode (like memfit.sim.tracker) sees every aten op below autograd. A storage
seen for the first time in an op's outputs is an allocation, rounded up to 512 bytes as
PyTorch's CUDA caching allocator rounds blocks; a `weakref.finalize` on the storage object
records its free. Tensors of the modules and optimizers passed as `count` (parameters,
buffers, gradients, optimizer state) are live from the start. When an allocation would take
the live bytes over the limit, the op's output is dropped and `torch.OutOfMemoryError` is
raised with the message PyTorch's CUDA caching allocator prints (`format_oom_message`), so
code that handles real CUDA OOMs handles these the same way.

Known limitations: memory is counted per storage (no caching-allocator blocks, no
fragmentation: "reserved" equals "allocated"); storages created outside the mode (e.g. by
`torch.tensor(list)` in a collator before the mode sees them) count from the first op that
returns them; kernel scratch space that never surfaces as an op output is invisible.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable

import torch

from memfit.allocator.caching import round_size  # the caching allocator's 512-byte rounding (re-exported)
from memfit.oom_text import format_oom_message
from memfit.sim._torch_adapter import TorchDispatchMode, WeakIdKeyDictionary

__all__ = ["memory_budget", "MemoryBudget", "round_size", "counted_bytes"]

def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    """Parameters, buffers and gradients of a module; state of an optimizer; tensors themselves."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_of(item)
    elif obj is not None:
        raise TypeError(f"memory_budget cannot count `{type(obj).__name__}`; pass modules, optimizers or tensors")


def counted_bytes(*objs: Any) -> int:
    """The bytes `memory_budget(..., count=objs)` counts as live from the start: each distinct storage of
    their tensors, rounded as the caching allocator rounds (`round_size`); meta tensors count nothing."""
    seen: dict[int, Any] = {}  # id -> storage (held, so that ids stay unique), as MemoryBudget._track
    for t in _tensors_of(list(objs)):
        storage = t.untyped_storage()
        if storage.device.type != "meta":
            seen.setdefault(id(storage), storage)
    return sum(round_size(s.nbytes()) for s in seen.values())


class MemoryBudget(TorchDispatchMode):
    """Live storage bytes of a CPU run against a limit; see the module docstring."""

    def __init__(self, limit_bytes: int, *, count: Iterable[Any] = (), device: int = 0) -> None:
        super().__init__()
        if int(limit_bytes) <= 0:
            from memfit.errors import MemfitError

            raise MemfitError(f"memory budget `{limit_bytes!r}` is not positive; give a size such as `800MiB`")
        self.limit_bytes = int(limit_bytes)
        self.device = device
        self.live_bytes = 0
        self.peak_bytes = 0
        self.oom_count = 0
        self.enabled = True
        self._seen = WeakIdKeyDictionary()
        self._counting_frees = True
        for t in _tensors_of(list(count)):
            self._track(t.untyped_storage())
        self.peak_bytes = self.live_bytes

    # -- accounting --------------------------------------------------------------------
    def _track(self, storage) -> None:
        if storage in self._seen or storage.device.type == "meta":
            return
        size = round_size(storage.nbytes())
        self._seen[storage] = size
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        if self._counting_frees:
            self.live_bytes -= size

    def count(self, *objs: Any) -> None:
        """Count more tensors as live now (e.g. an optimizer created before the mode)."""
        for t in _tensors_of(list(objs)):
            self._track(t.untyped_storage())

    def reset_peak(self) -> None:
        """Start a new peak from the live bytes now (as torch.cuda.reset_peak_memory_stats)."""
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def paused(self):
        """Allocations inside are not counted: host-side work such as a CPU copy of the optimizer state."""
        was, self.enabled = self.enabled, False
        try:
            yield self
        finally:
            self.enabled = was

    @property
    def free_bytes(self) -> int:
        return max(0, self.limit_bytes - self.live_bytes)

    def oom_message(self, tried_bytes: int) -> str:
        return format_oom_message(
            device=self.device, tried_to_allocate_bytes=tried_bytes, total_bytes=self.limit_bytes,
            free_bytes=self.free_bytes, process_used_bytes=self.live_bytes, allocated_bytes=self.live_bytes,
            reserved_unallocated_bytes=0,
        )

    # -- dispatch ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.enabled:
            return out
        new = []
        for t in _flat_tensors(out):
            storage = t.untyped_storage()
            if storage not in self._seen and storage.device.type != "meta" and all(s is not storage for s in new):
                new.append(storage)
        if not new:
            return out
        request = sum(round_size(s.nbytes()) for s in new)
        if self.live_bytes + request > self.limit_bytes:
            self.oom_count += 1
            largest = max(round_size(s.nbytes()) for s in new)
            del out, new
            raise torch.OutOfMemoryError(self.oom_message(largest))
        for s in new:
            self._track(s)
        return out

    def __exit__(self, *exc):
        return super().__exit__(*exc)


def _flat_tensors(out: Any):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _flat_tensors(item)


def memory_budget(limit_bytes: int | str, *, count: Iterable[Any] = (), device: int = 0) -> MemoryBudget:
    """A context manager that raises `torch.OutOfMemoryError` past `limit_bytes` of live tensors.

    `limit_bytes`: an int or a size such as ``"300MiB"``. `count`: modules, optimizers or
    tensors that already exist and count from the start. The returned object has
    `peak_bytes`, `live_bytes`, `reset_peak()` and `oom_count`.
    """
    if isinstance(limit_bytes, str):
        from memfit.units import parse_size

        limit_bytes = parse_size(limit_bytes, what="memory budget")
    return MemoryBudget(int(limit_bytes), count=count, device=device)
