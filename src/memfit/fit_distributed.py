"""Multi-process runs: every rank takes the same memory decisions.

`agree(obj)` gives every rank rank 0's object (the plan `memfit.fit` applies);
`agree_max(n)` gives every rank the largest value (the number of chunks a micro-batch is
split into after a recovery), exchanged at each optimizer-step boundary. Without
`torch.distributed` initialised both return their argument.

Known limitation: an out-of-memory error on one rank while the others are inside a
collective (DDP's gradient all-reduce) is not resolved here; those ranks wait for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_distributed", "agree", "agree_max"]


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
    if not is_distributed():
        return value
    import torch
    import torch.distributed as dist

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
