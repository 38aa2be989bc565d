"""Multi-process runs: every rank takes the same memory decisions, and no rank waits for a failed one.

`agree(obj)` gives every rank rank 0's object (the plan `memfit.fit` applies);
`agree_max(n)` gives every rank the largest value (the number of chunks a micro-batch is
split into after a recovery), exchanged at each optimizer-step boundary. Without
`torch.distributed` initialised both return their argument.

DDP (`torch.nn.parallel.DistributedDataParallel`) all-reduces gradients from hooks inside
the last backward of an accumulation window and broadcasts buffers at the start of every
forward. A rank that runs out of memory there and recovers (more, smaller forwards and
backwards) would call those collectives a different number of times than the others, and
they would wait forever. Under `memfit.fit` every micro-step of a DDP model therefore runs
under `DDP.no_sync()` with buffer broadcasting off (no collective inside a micro-step);
after the window, `check_peers` exchanges one flag (a rank that failed for good tells the
others, which stop with an error instead of waiting; memfit.fitting.optimizer_step votes likewise
after every optimizer step), `average_gradients` all-reduces the gradients in 25 MiB
buckets (DDP's default bucket size, torch/nn/parallel/distributed.py `bucket_cap_mb`) and divides them by the world size, as DDP does, and rank 0's buffers are
broadcast. Cost: the gradient all-reduce no longer overlaps the last backward.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_distributed", "agree", "agree_max", "agree_flags", "PeerFailed", "is_ddp", "take_over_buffer_sync",
           "check_peers", "average_gradients", "BUCKET_BYTES"]

#: Gradient bucket size of the all-reduce after a window (DDP's default `bucket_cap_mb=25`).
BUCKET_BYTES = 25 * 2**20


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (`broadcast_object_list`)."""
    if not is_distributed():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_max(value: int) -> int:
    """The largest `value` over all ranks (`all_reduce` with MAX; on the GPU for NCCL)."""
    return agree_flags([value])[0]


def agree_flags(values: list[int]) -> list[int]:
    """Element-wise largest of `values` over all ranks (one small `all_reduce` with MAX)."""
    if not is_distributed():
        return [int(v) for v in values]
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def _device():
    import torch
    import torch.distributed as dist

    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def is_ddp(model: Any) -> bool:
    """Is `model` wrapped in DistributedDataParallel within an initialised multi-process group?"""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel) and is_distributed()


def take_over_buffer_sync(model: Any) -> None:
    """Stop DDP's buffer broadcast at every forward (memfit broadcasts after each window instead)."""
    model.broadcast_buffers = False  # DDP's constructor argument, read before every forward


class PeerFailed(RuntimeError):
    """Another rank stopped with an error in this accumulation window."""


def check_peers(*, failed: bool) -> None:
    """One flag per rank at the end of every accumulation window (DDP under memfit.fit).

    A rank that fails for good calls it with `failed=True` before raising; the others raise
    PeerFailed instead of waiting for it in their next collective.
    """
    if agree_max(int(failed)) and not failed:
        raise PeerFailed("memfit: another process of this run stopped with an error in this accumulation window "
                         "(see its log); this process stops too instead of waiting for it")


def average_gradients(model: Any) -> None:
    """All-reduce (mean) the gradients of `model` in buckets, then broadcast rank 0's buffers."""
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    world = dist.get_world_size()
    # a parameter without a gradient on this rank but with one elsewhere gets zeros, as in DDP
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_device())
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    grads = []
    for p, any_rank in zip(params, has.tolist()):
        if any_rank:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    bucket: list[Any] = []
    size = 0
    for g in grads + [None]:
        if g is not None and (not bucket or (g.dtype == bucket[0].dtype and g.device == bucket[0].device
                                             and size + g.numel() * g.element_size() <= BUCKET_BYTES)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            del flat
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)
    for buf in model.module.buffers():
        dist.broadcast(buf, src=0)
