"""Track every storage's lifetime, by category, as an ordered allocation trace.

A TorchDispatchMode sees each aten op below autograd; a storage seen for the first time
in an op's outputs is an allocation, and a `weakref.finalize` on the storage object
(PyTorch keeps one Python object per live storage) records its free. Works the same on
FakeTensors and real CPU tensors, which is how the simulator is checked for exactness.

Each storage also records the tensor that created it (shape, dtype) and where it was made: the module whose
forward was running (`module_scope`: global forward hooks keep a stack of qualified module names), else, in a
backward, the autograd node being executed (`MmBackward0`), unless the simulator names it itself (`module`).

Known limitations: storages created outside the mode (before it is entered) are only
seen if registered with `register`; allocations inside C++ kernels that never surface
as an op output (cuBLAS workspaces, kernel scratch) are invisible here and are added by
the CUDA emulation where they matter (SDPA backward workspaces, see sim/sdpa.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch

from memfit.sim import _torch_adapter as adapter
from memfit.trace import TraceEvent

__all__ = ["StorageTracker", "Record", "TrackedEvent"]


class Record:
    """One storage: mutable while the simulation runs, frozen into TraceEvents at the end."""

    __slots__ = ("id", "size_bytes", "category", "phase", "module", "layer", "alive", "expand_to", "shape", "dtype")

    def __init__(self, sid: int, size: int, category: str, phase: str, module: str, layer: object,
                 shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> None:
        self.id = sid
        self.size_bytes = size
        self.category = category
        self.phase = phase
        self.module = module
        self.layer = layer
        self.alive = True
        #: set by layer splicing: freeing this record frees these instead (None: itself)
        self.expand_to: list[Record] | None = None
        #: of the tensor whose op created the storage (None: a storage the simulation does not run)
        self.shape = shape
        self.dtype = dtype


class TrackedEvent(NamedTuple):
    """One event of the tracker's program-order log (frozen into a TraceEvent by `trace()`)."""

    action: str  #: "alloc" or "free"
    record: Record  #: the storage
    phase: str  #: the tracker's phase when it happened
    tag: object  #: layer tag of the code running then (None outside repeated layers; see sim/splice.py)


class StorageTracker(adapter.TorchDispatchMode):
    """Records alloc/free events of storages produced by aten ops."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Record] = []
        #: every alloc / free in program order
        self.events: list[TrackedEvent] = []
        self._ids = adapter.WeakIdKeyDictionary()
        self._finalizers: dict[int, weakref.finalize] = {}
        self.phase = "setup"
        self.default_category = "temporaries"
        self.module = ""
        self.layer: object = None  #: layer tag set by the simulator (for splicing repeated layers)
        self.tag_fn = lambda: None  #: returns the layer tag of the code running now
        self.paused = False
        #: qualified names of the modules whose forward is running, innermost last (`module_scope`)
        self.module_stack: list[str] = []

    # -- recording -----------------------------------------------------------------------
    def _new(self, storage, category: str | None = None, tensor: torch.Tensor | None = None) -> Record:
        tag = self.tag_fn()
        stack = self.module_stack
        rec = Record(len(self.records), storage.nbytes(), category or self.default_category, self.phase,
                     self.module or (stack[-1] if stack else "") or adapter.current_autograd_node_name(), tag,
                     None if tensor is None else tuple(tensor.shape), None if tensor is None else tensor.dtype)
        self.records.append(rec)
        self._ids[storage] = rec
        self.events.append(TrackedEvent("alloc", rec, self.phase, tag))
        self._finalizers[id(storage)] = weakref.finalize(storage, self._free, rec)
        return rec

    def synthetic_alloc(self, size_bytes: int, category: str) -> Record:
        """An allocation the simulation does not run but knows the size of (e.g. eval buffers)."""
        rec = Record(len(self.records), int(size_bytes), category, self.phase, self.module, None)
        self.records.append(rec)
        self.events.append(TrackedEvent("alloc", rec, self.phase, None))
        return rec

    def new_record_like(self, orig: Record, module: str) -> Record:
        """A copy of `orig` (layer splicing), not yet in the event list."""
        rec = Record(len(self.records), orig.size_bytes, orig.category, orig.phase, module, orig.layer, orig.shape,
                     orig.dtype)
        self.records.append(rec)
        return rec

    def ignore(self, tensor: torch.Tensor) -> None:
        """Treat `tensor`'s storage as known and never report it (stand-in weights of a spliced run)."""
        storage = tensor.untyped_storage()
        if storage not in self._ids:
            rec = Record(-1, 0, "host", self.phase, "", None)
            rec.alive = False
            self._ids[storage] = rec

    def bind(self, tensor: torch.Tensor, rec: Record) -> None:
        """`tensor`'s storage is the one `rec` describes (its free will be reported as rec's)."""
        storage = tensor.untyped_storage()
        self._ids[storage] = rec
        self._finalizers[id(storage)] = weakref.finalize(storage, self._free, rec)

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop reporting `tensor`'s storage (it is known, but its free is no longer an event)."""
        storage = tensor.untyped_storage()
        fin = self._finalizers.pop(id(storage), None)
        if fin is not None:
            fin.detach()
        self._ids.pop(storage, None)
        self.ignore(tensor)

    def synthetic_free(self, rec: Record) -> None:
        self._free(rec)

    def _free(self, rec: Record) -> None:
        if not rec.alive:
            return
        rec.alive = False
        if rec.expand_to is not None:
            tag = self.tag_fn()
            for other in rec.expand_to:
                if other.alive:
                    other.alive = False
                    self.events.append(TrackedEvent("free", other, self.phase, tag))
            return
        self.events.append(TrackedEvent("free", rec, self.phase, self.tag_fn()))

    def register(self, tensor: torch.Tensor, category: str) -> Record:
        """Record `tensor`'s storage as allocated now (e.g. weights moved to the GPU)."""
        storage = tensor.untyped_storage()
        rec = self._ids.get(storage)
        if rec is None:
            rec = self._new(storage, category, tensor)
        else:
            rec.category = category
        return rec

    def record_of(self, tensor: torch.Tensor) -> Record | None:
        return self._ids.get(tensor.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if isinstance(out, torch.Tensor):
            self._see(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._see(t)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._see(u)
        return out

    def _see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage not in self._ids:
            self._new(storage, None, t)

    @contextlib.contextmanager
    def module_scope(self, *models: torch.nn.Module | None) -> Iterator[None]:
        """While the block runs, a storage allocated inside a module's forward (a checkpointed block's recompute
        too) is attributed to that module: its qualified name in the first of `models` that holds it, with the
        wrappers' own path segments (FSDP1, checkpoint wrappers) left out; a root module by its class name. Modules
        of none of them leave the attribution to the enclosing one."""
        names: dict[int, str] = {}
        for model in models:
            if model is None:
                continue
            for name, mod in model.named_modules():
                path = ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)
                names.setdefault(id(mod), path or type(mod).__name__)  # the root: its class (its loss, its head)
        stack = self.module_stack

        def pre(module, args):
            stack.append(names.get(id(module)) or (stack[-1] if stack else ""))

        def post(module, args, output):
            if stack:
                stack.pop()

        handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                   torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            stack.clear()

    # -- results -------------------------------------------------------------------------
    def live_records(self) -> list[Record]:
        return [r for r in self.records if r.alive]

    def trace(self) -> list[TraceEvent]:
        names = _DTYPE_NAMES
        return [TraceEvent(a, r.id, r.size_bytes, r.category, phase, r.module, r.shape,
                           None if r.dtype is None else names.get(r.dtype) or _dtype_name(r.dtype))
                for a, r, phase, _ in self.events]


#: path segments the wrappers add to a module's qualified name (torch.distributed.fsdp FullyShardedDataParallel,
#: torch.distributed.algorithms._checkpoint.checkpoint_wrapper, peft's LoRA layers keep theirs: `base_layer`)
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

#: `torch.float16` -> "float16", filled as dtypes are met (TraceEvent.dtype)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name
