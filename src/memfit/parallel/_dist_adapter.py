"""The one module that touches private or unstable torch.distributed APIs.

- `torch.testing._internal.distributed.fake_pg.FakeStore` and the `"fake"` backend it registers: a
  process group whose collectives return at once, so one CPU process can stand for rank 0 of any
  world size (PyTorch's own tests run FSDP2 under FakeTensorMode this way).
- `torch.distributed.device_mesh.init_device_mesh`: made outside FakeTensorMode (it reads the ranks
  tensor with `tolist()`, which a fake tensor cannot answer).
- `torch.distributed.fsdp.fully_shard`, `MixedPrecisionPolicy`, `CPUOffloadPolicy` (public since 2.6).
- `torch.distributed._compute_bucket_assignment_by_size`: DDP's own C++ bucket assignment
  (torch/nn/parallel/distributed.py `_ddp_init_helper`), which runs on meta tensors.
- `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`: DDP's first bucket (1 MiB).
- `DTensor._local_tensor`: the rank's shard of a DTensor, read inside a dispatch mode.
- FSDP1 : `torch.distributed.fsdp.FullyShardedDataParallel`, `ShardingStrategy`,
  `CPUOffload`, `MixedPrecision`, `wrap.ModuleWrapPolicy` (public), and the storage resizes of its
  FlatParameters, `torch.distributed.fsdp._flat_param._alloc_storage` / `_free_storage` (private), and
  `_runtime_utils._catch_all_reshard` (private: its data-pointer test); accelerate's fp32 upcast of a unit's
  FlatParameter reaches `FlatParamHandle._orig_param_dtype` and `_use_sharded_views` (private).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from memfit.errors import MemfitError

__all__ = ["fake_process_group", "fully_shard", "mixed_precision_policy", "cpu_offload_policy",
           "ddp_bucket_assignment", "DDP_FIRST_BUCKET_BYTES", "local_tensor", "is_dtensor", "fsdp1_wrap",
           "fsdp1_flat_params", "fsdp1_upcast_flat_params", "fsdp1_storage_hooks", "fsdp_storage_hooks"]

DDP_FIRST_BUCKET_BYTES = int(dist._DEFAULT_FIRST_BUCKET_BYTES)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0, replicas: int = 1) -> Iterator[object]:
    """A fake default process group of `world_size` ranks and its CPU device mesh, torn down after: 1-D, or with
    `replicas` > 1 the 2-D (replicate, shard) mesh of hybrid sharding, `replicas` groups of world_size / replicas
    ranks that each shard the model (FSDP2 HSDP: `fully_shard(mesh=2-D)`; FSDP1 `HYBRID_SHARD` with `device_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise MemfitError("a torch.distributed process group is already initialized in this process; "
                          "memfit simulates ranks in a process of its own (run the estimate outside the job)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        if replicas > 1:
            yield init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
        else:
            yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def fully_shard(module: torch.nn.Module, **kwargs) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard as _fully_shard

    return _fully_shard(module, **kwargs)


def mixed_precision_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def cpu_offload_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=False)


def ddp_bucket_assignment(tensors: Sequence[torch.Tensor], limits_bytes: Sequence[int]) -> list[list[int]]:
    """DDP's bucket assignment (indices into `tensors`), as `_ddp_init_helper` calls it."""
    indices, _limits = dist._compute_bucket_assignment_by_size(list(tensors), list(limits_bytes),
                                                               [False] * len(tensors))
    return [list(b) for b in indices]


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's local shard of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if is_dtensor(t) else t


def _watched_storage(orig_alloc, orig_free, on_alloc, on_free):
    """FSDP's storage allocate / free functions wrapped: `on_alloc(tensor)` after an allocation that changed the
    storage's size, `on_free(tensor)` before a free of a non-empty storage (FSDP2 `alloc_storage(tensor)`, FSDP1
    `_alloc_storage(tensor, size)`: the extra arguments pass through)."""

    def alloc_storage(tensor, *args):
        was = tensor.untyped_storage().size()
        orig_alloc(tensor, *args)
        if was != tensor.untyped_storage().size():
            on_alloc(tensor)

    def free_storage(tensor):
        if tensor.untyped_storage().size() != 0:
            on_free(tensor)
        orig_free(tensor)

    return alloc_storage, free_storage


@contextlib.contextmanager
def fsdp_storage_hooks(on_alloc, on_free) -> Iterator[None]:
    """Call `on_alloc(tensor)` after and `on_free(tensor)` before FSDP2 resizes a tensor's storage.

    FSDP2 frees the unsharded parameters and all-gather outputs by `untyped_storage().resize_(0)` and
    makes them again by resizing back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    `free_storage` / `alloc_storage`, also imported by `_fsdp_param_group`): the storage object lives
    on, so a tracker that waits for it to be collected never sees those frees."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    orig_alloc, orig_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    alloc_storage, free_storage = _watched_storage(orig_alloc, orig_free, on_alloc, on_free)
    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = orig_alloc
        _fsdp_param.free_storage = orig_free


# -- FSDP1  --
def fsdp1_wrap(module: torch.nn.Module, *, block_classes: set[type] | None, sharding_strategy: str, mesh,
               use_orig_params: bool, cpu_offload: bool, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype | None, auto_wrap_policy=None) -> torch.nn.Module:
    """`FullyShardedDataParallel(module, ...)` as accelerate's `prepare_model` builds it for FSDP1 (device_id the
    device, `ModuleWrapPolicy` over the block classes for TRANSFORMER_BASED_WRAP, none for NO_WRAP; the mixed
    precision policy's buffer dtype is its param dtype: FullyShardedDataParallelPlugin.set_mixed_precision).
    `auto_wrap_policy`, when given, is FSDP1's policy callable instead (peft's `fsdp_auto_wrap_policy`)."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs = {}
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   buffer_dtype=param_dtype)
    if sharding_strategy.startswith(("HYBRID", "_HYBRID")):
        kwargs["device_mesh"] = mesh
    return FSDP(module, sharding_strategy=ShardingStrategy[sharding_strategy],
                auto_wrap_policy=auto_wrap_policy or (ModuleWrapPolicy(block_classes) if block_classes else None),
                cpu_offload=CPUOffload(offload_params=cpu_offload), use_orig_params=use_orig_params,
                device_id=torch.device("cpu"), sync_module_states=False, **kwargs)


def fsdp1_flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The FlatParameter of every FSDP1 unit (its `_handle.flat_param`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]


def fsdp1_upcast_flat_params(model: torch.nn.Module) -> int:
    """What accelerate 1.16 `Accelerator.prepare_model` does to an FSDP1 model under mixed precision (accelerate
    >= 0.30, "Add Upcasting for FSDP in Mixed Precision", #2674): every unit's trainable FlatParameter that is not
    fp32 becomes fp32 (`param.data = param.data.to(torch.float32)`, `module._handle._orig_param_dtype =
    torch.float32`), so the sharded master weights, their gradients and the optimizer's states are fp32 while the
    unit still computes in its MixedPrecision `param_dtype`. The original parameters are then re-viewed into the
    fp32 shard (`FlatParamHandle._use_sharded_views`, what the first forward's reshard does on a GPU) so that they
    no longer hold the low-precision shard. Returns the number of FlatParameters upcast."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count = 0
    for module in FSDP.fsdp_modules(model):
        handle = module._handle
        if handle is None:
            continue
        param = handle.flat_param
        if param.dtype != torch.float32 and param.device != torch.device("meta") and param.requires_grad:
            param.data = param.data.to(torch.float32)
            handle._orig_param_dtype = torch.float32
            if handle._use_orig_params:
                handle._use_sharded_views()
            count += 1
    return count


@contextlib.contextmanager
def fsdp1_storage_hooks(on_alloc, on_free) -> Iterator[None]:
    """FSDP1's storage resizes (torch/distributed/fsdp/_flat_param.py imports `_alloc_storage` / `_free_storage`
    from torch.distributed.utils: the padded unsharded FlatParameter, its low-precision shard), reported as
    `fsdp_storage_hooks` reports FSDP2's.

    Also FSDP1's three storage tests that read data pointers, which a FakeTensor does not have (all 0):
    `_data_ptr_allocated` (`data_ptr() > 0`) is answered by the storage's size (what `_alloc_storage` /
    `_free_storage` change), `_same_storage` (`data_ptr() ==`) and `_runtime_utils._catch_all_reshard`'s
    already-resharded test by the storages' identity (PyTorch keeps one Python object per live storage); the same
    answers a real tensor gets."""
    from torch.distributed.fsdp import _flat_param
    from torch.distributed.tensor import DTensor

    orig_alloc, orig_free = _flat_param._alloc_storage, _flat_param._free_storage
    orig_allocated, orig_same = _flat_param._data_ptr_allocated, _flat_param._same_storage

    def data_ptr_allocated(tensor):
        return tensor.untyped_storage().size() > 0

    def same_storage(a, b):
        a = a._local_tensor if isinstance(a, DTensor) else a
        b = b._local_tensor if isinstance(b, DTensor) else b
        return a.untyped_storage() is b.untyped_storage() or (
            a.untyped_storage().data_ptr() != 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())

    from torch.distributed.fsdp import _runtime_utils

    orig_catch_all = _runtime_utils._catch_all_reshard

    def catch_all_reshard(state):
        # `_catch_all_reshard`'s "already resharded" test compares `flat_param.data_ptr()` with its local shard's;
        # on fake tensors both are 0, so a unit whose post-backward hook never runs (a frozen one: peft's units of
        # base weights) would keep its unsharded FlatParameter; the test is answered by storage identity instead
        handle = state._handle
        if handle is None or (same_storage(handle.flat_param, handle.flat_param._local_shard)
                              and not handle._skipped_use_sharded_views):
            return
        _runtime_utils._reshard(state, handle, _runtime_utils._should_free_in_backward(state, handle))

    alloc_storage, free_storage = _watched_storage(orig_alloc, orig_free, on_alloc, on_free)
    _flat_param._alloc_storage, _flat_param._free_storage = alloc_storage, free_storage
    _flat_param._data_ptr_allocated, _flat_param._same_storage = data_ptr_allocated, same_storage
    _runtime_utils._catch_all_reshard = catch_all_reshard
    try:
        yield
    finally:
        _flat_param._alloc_storage, _flat_param._free_storage = orig_alloc, orig_free
        _flat_param._data_ptr_allocated, _flat_param._same_storage = orig_allocated, orig_same
        _runtime_utils._catch_all_reshard = orig_catch_all


def fsdp1_release_flat_grads(model: torch.nn.Module) -> None:
    """What FSDP1's root pre-forward does first (torch/distributed/fsdp/_runtime_utils.py `_root_pre_forward`:
    `_reset_flat_param_grad_info_if_needed(state._all_handles)`): with `use_orig_params`, a FlatParameter whose
    original parameters all have `grad is None` (after `zero_grad(set_to_none=True)`) drops its sharded
    gradient (`FlatParamHandle._reset_flat_param_grad_info_if_needed`)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for m in model.modules():
        if isinstance(m, FSDP) and m._handle is not None:
            m._handle._reset_flat_param_grad_info_if_needed()


def fsdp1_flat_grads_from_orig(model: torch.nn.Module, tracker) -> None:
    """After memfit's replay of a micro-step has given each original parameter a gradient of its own (bound to the
    replayed record of the FlatParameter's sharded gradient), make it FSDP1's layout again: the FlatParameter holds
    the sharded gradient and the original parameters' gradients are views of it (`FlatParamHandle.
    _use_sharded_grad_views`, as `prepare_gradient_for_optim` leaves them), so zero_grad frees nothing."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for m in model.modules():
        if not isinstance(m, FSDP) or m._handle is None:
            continue
        handle = m._handle
        fp = handle.flat_param
        rec = next((tracker.record_of(p.grad) for p in fp._params if p.grad is not None), None)
        if rec is None or fp.grad is not None:
            continue
        for p in fp._params:
            if p.grad is not None:
                tracker.forget(p.grad)
        tracker.paused = True
        fp.grad = torch.empty_like(fp)
        tracker.paused = False
        tracker.bind(fp.grad, rec)
        handle._use_sharded_grad_views()


# -- gradient accumulation without communication (FSDP accumulation) ------------------------------------
@contextlib.contextmanager
def fsdp_no_sync(model: torch.nn.Module, fsdp_version: int) -> Iterator[None]:
    """What accelerate 1.15 `Accelerator.no_sync` runs around a non-final micro-step: FSDP2
    `model.set_requires_gradient_sync(False)` (True again after), FSDP1 `FullyShardedDataParallel.no_sync()`."""
    if fsdp_version == 2:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def fsdp_unsharded_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP keeps between micro-steps under no-sync: FSDP2 each FSDPParam's
    `unsharded_accumulated_grad` or its unsharded parameter's `.grad` (_fsdp_param_group.py `post_backward`:
    `to_accumulated_grad_if_needed` when not `reduce_grads`); FSDP1 each FlatParameter's `.grad` (unsharded under
    `no_sync`: _runtime_utils.py `_post_backward_hook` returns before `_reduce_grad`)."""
    out: list[torch.Tensor] = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    for module in model.modules():
        if FSDPModule and isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    acc = fp.unsharded_accumulated_grad
                    if acc is not None:
                        out.append(acc)
                    elif hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None:
                        out.append(fp._unsharded_param.grad)
    if not out:
        out = [p.grad for p in fsdp1_flat_params(model) if p.grad is not None]
    return out
