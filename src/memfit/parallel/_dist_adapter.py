"""The one module that touches private or unstable torch.distributed APIs (issue 14).

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from memfit.errors import MemfitError

__all__ = ["fake_process_group", "fully_shard", "mixed_precision_policy", "cpu_offload_policy",
           "ddp_bucket_assignment", "DDP_FIRST_BUCKET_BYTES", "local_tensor", "is_dtensor"]

DDP_FIRST_BUCKET_BYTES = int(dist._DEFAULT_FIRST_BUCKET_BYTES)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[object]:
    """A fake default process group of `world_size` ranks and its 1-D CPU device mesh; torn down after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise MemfitError("a torch.distributed process group is already initialized in this process; "
                          "memfit simulates ranks in a process of its own (run the estimate outside the job)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
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


@contextlib.contextmanager
def fsdp_storage_hooks(on_alloc, on_free) -> Iterator[None]:
    """Call `on_alloc(tensor)` after and `on_free(tensor)` before FSDP2 resizes a tensor's storage.

    FSDP2 frees the unsharded parameters and all-gather outputs by `untyped_storage().resize_(0)` and
    makes them again by resizing back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    `free_storage` / `alloc_storage`, also imported by `_fsdp_param_group`): the storage object lives
    on, so a tracker that waits for it to be collected never sees those frees."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    orig_alloc, orig_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor):
        was = tensor.untyped_storage().size()
        orig_alloc(tensor)
        if was != tensor.untyped_storage().size():
            on_alloc(tensor)

    def free_storage(tensor):
        if tensor.untyped_storage().size() != 0:
            on_free(tensor)
        orig_free(tensor)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = orig_alloc
        _fsdp_param.free_storage = orig_free
