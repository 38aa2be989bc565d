"""NCCL's own device buffers per rank: memory outside PyTorch's caching allocator.

NCCL allocates its communication buffers with cudaMalloc (or cuMem*) itself, so `nvidia-smi` shows
them and `torch.cuda.memory_reserved()` does not. Per communicator and channel, each connection to a
peer holds a buffer per protocol; the Simple protocol's is `NCCL_BUFFSIZE` (default 4 MiB:
NCCL docs, Environment Variables, "NCCL_BUFFSIZE ... Default 4194304"), the LL and LL128 ones are
smaller and left out. A ring has two peers per channel (send to the next rank, receive from the
previous); the number of channels NCCL picks depends on the topology: the estimate takes 16 within
a node (NVLink; `NCCL_MIN_NCHANNELS` / `NCCL_MAX_NCHANNELS` bound it) and 2 per node across nodes
(one NIC ring per direction), an estimate, not read from NCCL's tuner.

Known limitations: an estimate (+-50%); proxy, LL/LL128 buffers and NVLS/CollNet buffers are not
counted; one communicator per process group (FSDP2, DDP and DeepSpeed here use the default group
only; hybrid sharding adds its shard and replicate groups: `hybrid_group_nccl_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from memfit.errors import MemfitError
from memfit.units import MiB

__all__ = ["nccl_buffer_bytes", "hybrid_group_nccl_bytes", "NCCL_BUFFSIZE_DEFAULT_BYTES"]

NCCL_BUFFSIZE_DEFAULT_BYTES = 4 * MiB  # NCCL docs: NCCL_BUFFSIZE default 4194304
_CHANNELS_INTRA_NODE = 16  # estimate for NVLink machines (see module docstring)
_CHANNELS_INTER_NODE = 2   # estimate per node-crossing ring
_PEERS_PER_RING = 2


def _buffsize(env: Mapping[str, str]) -> int:
    if env.get("NCCL_BUFFSIZE"):
        try:
            return int(env["NCCL_BUFFSIZE"])
        except ValueError as err:
            raise MemfitError(f"NCCL_BUFFSIZE `{env['NCCL_BUFFSIZE']}` is not a number of bytes") from err
    return NCCL_BUFFSIZE_DEFAULT_BYTES


def hybrid_group_nccl_bytes(gpus_per_node: int, nodes: int, env: Mapping[str, str] | None = None) -> int:
    """The two communicators hybrid sharding adds on each rank : the shard group within the
    node (intra-node channels) and the replicate group of one rank per node (inter-node channels only); the same
    per-channel estimate as `nccl_buffer_bytes`.

    Args:
        gpus_per_node: ranks of a shard group.
        nodes: ranks of a replicate group.
        env: the environment (default os.environ).
    """
    env = os.environ if env is None else env
    size = _buffsize(env)
    cap = int(env["NCCL_MAX_NCHANNELS"]) if env.get("NCCL_MAX_NCHANNELS", "").isdigit() else None
    total = 0
    for ranks, channels in ((gpus_per_node, _CHANNELS_INTRA_NODE), (nodes, _CHANNELS_INTER_NODE)):
        if ranks > 1:
            total += (min(channels, cap) if cap is not None else channels) * _PEERS_PER_RING * size
    return total


def nccl_buffer_bytes(world_size: int, nodes: int = 1, env: Mapping[str, str] | None = None) -> int:
    """NCCL buffer bytes on each rank of a job of `world_size` ranks over `nodes` nodes (0 for one rank).

    Args:
        world_size: ranks in all.
        nodes: nodes.
        env: the environment, for `NCCL_BUFFSIZE` and `NCCL_MAX_NCHANNELS` (default os.environ).
    """
    if world_size <= 1:
        return 0
    env = os.environ if env is None else env
    size = _buffsize(env)
    channels = _CHANNELS_INTRA_NODE if nodes == 1 else _CHANNELS_INTRA_NODE + _CHANNELS_INTER_NODE
    if env.get("NCCL_MAX_NCHANNELS", "").isdigit():
        channels = min(channels, int(env["NCCL_MAX_NCHANNELS"]))
    return channels * _PEERS_PER_RING * size
