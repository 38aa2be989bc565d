"""Communication of one optimizer step per rank, and the step time it adds.

Volumes. A collective over a payload of S bytes (the unsharded tensors) on n ranks moves, per rank,
`bus_factor x S` bytes over its link: 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a
reduce-scatter (the ring algorithms' traffic; NVIDIA/nccl-tests doc/PERFORMANCE.md, "Bus bandwidth":
busBw = algBw x 2(n-1)/n for AllReduce, x (n-1)/n for AllGather and ReduceScatter). Per strategy and
optimizer step of `a` micro-steps:

* DDP: one all-reduce of the gradients, at the last micro-step: the Trainer runs the other micro-steps
  under accelerate's `no_sync` (transformers trainer.py `_inner_training_loop`, `sync_context`).
* FSDP2: per micro-step an all-gather of the parameters in the forward and, with `reshard_after_forward`,
  again in the backward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `pre_forward`,
  `pre_backward` -> `unshard`), and a reduce-scatter of the gradients: the plan sets accelerate's
  `sync_each_batch` (memfit.planner.launch), so the Trainer does not run the other micro-steps under
  `no_sync` (transformers trainer.py: `sync_each_batch` -> `nullcontext`), whose
  `set_requires_gradient_sync(False)` would keep unsharded gradients between micro-steps
  (accelerate/accelerator.py `no_sync`), memory memfit.parallel.fsdp does not simulate.
  With CPU offload each all-gather first copies the rank's shard to the GPU and each reduce-scatter copies
  the gradient shard back (`CPUOffloadPolicy`), and the optimizer steps on the CPU.
* ZeRO-1: one reduce-scatter of the gradients per step, at the accumulation boundary; ZeRO-2 and ZeRO-3
  reduce every micro-step (deepspeed/runtime/engine.py `allreduce_gradients`: "ZeRO stage >= 2
  communicates during non gradient accumulation boundaries as well"). ZeRO-1/2 all-gather the updated
  parameters after the step (stage_1_and_2.py `step` -> `all_gather_dp_groups`); ZeRO-3 all-gathers the
  parameters in the forward and in the backward every micro-step (partitioned_param_coordinator.py
  `fetch_sub_module`). `offload_optimizer`: the gradient partition goes to the host every micro-step the
  gradients are reduced and the updated parameter partition comes back after the step; `offload_param`
  (stage 3): each all-gather first copies the rank's partition from the host.

Hybrid sharding across nodes (g GPUs per node, m nodes, n = g m; `hybrid=True`):

* FSDP2 HSDP (a 2-D mesh (replicate m, shard g)): the parameter all-gathers and the gradient reduce-scatter run
  on the shard group, within the node (g ranks, payload P resp. S), and the reduce-scatter's output, the rank's
  S/g gradient shard, is all-reduced over the replicate group, one rank per node (m ranks): torch
  distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce` (`reduce_scatter_tensor` on
  `reduce_scatter_group`, then `all_reduce` on `all_reduce_group` for HSDP). Per rank per micro-step:
  2 (g-1)/g P + (g-1)/g S over the node's links and 2 (m-1)/m S/g over the network, where the g replicate groups
  of a node share its network bandwidth (`concurrent` = g).
* ZeRO++ hpZ (`zero_hpz_partition_size` = g, stage 3): the forward all-gathers the primary partition over all n
  ranks, the backward gathers the secondary partition within the node (g ranks): ZeRO++ (Wang et al. 2023,
  arXiv:2306.10209, section 3.2: "hpZ ... eliminates the cross-node all-gather during backward"); DeepSpeed
  partition_parameters.py `_partition_param_sec` / `all_gather_coalesced(forward=False)` on the
  `zero_param_process_group`. The gradient reduce-scatter stays over all n ranks.

Times. A volume over the rank's link: within a node the GPU's NVLink or PCIe figure, across nodes the
smaller of that and the node's network bandwidth (NCCL's rings cross each node boundary once per ring,
one ring per NIC, so a rank's bus bandwidth is bounded by its node's share of the network), times
`NCCL_EFFICIENCY`; host copies over PCIe times `HOST_COPY_EFFICIENCY`; figures from
memfit.gpus.interconnect.

Assumptions (not measurements):

* `NCCL_EFFICIENCY` = 0.65 of the link's peak: an 8 x A100 NVLink machine's nccl-tests sendrecv reaches
  195 GB/s of 300 GB/s per direction (li-plus/playground cuda/nccl.md), about 0.65.
* `HOST_COPY_EFFICIENCY` = 0.8 of PCIe x16 for pinned host copies.
* `HOST_OPTIMIZER_GBPS` = 20 GB/s: a CPU optimizer step (DeepSpeedCPUAdam, or torch's AdamW on FSDP2's
  CPU shards) streams the same bytes per parameter as on the GPU (memfit.planner.throughput) at this rate
  per rank.
* Overlap with compute: a collective marked as overlapped hides behind the compute of its micro-step,
  all of it (the forward and backward all-gathers are prefetched: FSDP2's implicit prefetching, ZeRO-3's
  `overlap_comm`) or its backward only (2/3 of it, 4N of the 6N training FLOPs: the gradient reductions
  of DDP's buckets, FSDP2's reduce-scatter, ZeRO-2/3's with `overlap_comm`); what exceeds the window is
  exposed. The other collectives (ZeRO-1/2's parameter all-gather after the step, ZeRO's reductions
  without `overlap_comm`) and every host copy are exposed in full. Latency (tens of microseconds per
  collective) is left out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memfit.gpus.interconnect import Interconnect

__all__ = ["Collective", "StepTime", "bus_factor", "collectives", "gpu_link_bytes_per_s", "host_link_bytes_per_s",
           "comm_step_time", "COLLECTIVE_LATENCY_S", "NCCL_EFFICIENCY", "HOST_COPY_EFFICIENCY", "HOST_OPTIMIZER_GBPS", "BACKWARD_FRACTION"]

NCCL_EFFICIENCY = 0.65  # assumption, module docstring
HOST_COPY_EFFICIENCY = 0.8  # assumption, module docstring
HOST_OPTIMIZER_GBPS = 20.0  # assumption, module docstring
COLLECTIVE_LATENCY_S = 15e-6  # assumption from one measurement, module docstring
BACKWARD_FRACTION = 2 / 3  # the backward's share of a micro-step's compute (4N of 6N FLOPs, Kaplan et al. 2020)

_OPS = ("all_reduce", "all_gather", "reduce_scatter", "host_to_device", "device_to_host")


def bus_factor(op: str, world_size: int) -> float:
    """Bytes a rank moves per payload byte (module docstring); host copies move their payload once."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("host_to_device", "device_to_host"):
        return 1.0
    raise ValueError(f"unknown collective {op}")


@dataclass(frozen=True)
class Collective:
    """One kind of transfer of a step: what, how big, how often, and whether compute hides it."""

    name: str
    op: str  #: one of all_reduce, all_gather, reduce_scatter, host_to_device, device_to_host
    payload_bytes: int  #: S: the unsharded payload (for a host copy: the rank's shard)
    bytes_per_call: int  #: what the rank moves per call: bus_factor(op, n) x S
    every_micro_step: bool  #: True: each micro-step; False: once per optimizer step
    overlap: float  #: fraction of its micro-step's compute it may hide behind (0: exposed)
    launches: int = 1  #: collective calls per occurrence (buckets, FSDP groups); each costs COLLECTIVE_LATENCY_S
    #: `world`: all ranks (bounded by the network across nodes); `node`: the ranks of one node (its NVLink / PCIe);
    #: `across_nodes`: one rank per node, over the network (hybrid sharding, module docstring)
    scope: str = "world"
    concurrent: int = 1  #: groups of the same node that share its network at once (`across_nodes`)

    @property
    def on_host_link(self) -> bool:
        return self.op in ("host_to_device", "device_to_host")

    def calls_per_step(self, accumulation: int) -> int:
        return accumulation if self.every_micro_step else 1

    def to_json(self, accumulation: int) -> dict:
        return {**asdict(self), "calls_per_step": self.calls_per_step(accumulation),
                "bytes_per_step": self.bytes_per_call * self.calls_per_step(accumulation)}


def _c(name: str, op: str, payload: int, n: int, every: bool, overlap: float, launches: int = 1,
       scope: str = "world", concurrent: int = 1) -> Collective:
    return Collective(name, op, int(payload), int(round(bus_factor(op, n) * payload)), every, overlap,
                      max(1, int(launches)), scope, concurrent)


def _buckets(payload_bytes: int, bucket_bytes: int) -> int:
    return max(1, -(-payload_bytes // max(1, bucket_bytes)))


def collectives(*, strategy: str, world_size: int, param_bytes: int, grad_bytes: int,
                reshard_after_forward: bool = True, cpu_offload: bool = False, offload_optimizer: bool = False,
                offload_param: bool = False, overlap_comm: bool = True, groups: int = 1,
                ddp_bucket_bytes: int = 25 * 2**20, reduce_bucket_bytes: int | None = None,
                allgather_bucket_bytes: int | None = None, hybrid: bool = False,
                gpus_per_node: int | None = None) -> list[Collective]:
    """What one rank moves in an optimizer step (module docstring).

    Args:
        strategy: ddp, fsdp, zero1, zero2 or zero3.
        world_size: ranks in all.
        param_bytes: all parameters in the dtype they are gathered in (FSDP2's `param_dtype` or their own;
            DeepSpeed's model dtype).
        grad_bytes: the trainable parameters' gradients in the dtype they are reduced in.
        reshard_after_forward: FSDP2: free the parameters after the forward (all-gather them again in the backward).
        cpu_offload: FSDP2 `CPUOffloadPolicy`.
        offload_optimizer: ZeRO `offload_optimizer.device = cpu`.
        offload_param: ZeRO-3 `offload_param.device = cpu`.
        overlap_comm: ZeRO `overlap_comm`.
        groups: FSDP2's groups (each block and the root) / ZeRO-3's fetch units: calls per parameter all-gather.
        ddp_bucket_bytes: DDP's bucket cap (calls: one per bucket, after a first bucket of 1 MiB).
        reduce_bucket_bytes: ZeRO `reduce_bucket_size` in bytes (None: one call).
        allgather_bucket_bytes: ZeRO-1/2 `allgather_bucket_size` in bytes (None: one call).
        hybrid: FSDP2 HSDP or ZeRO-3 hpZ within each node of `gpus_per_node` GPUs (module docstring).
        gpus_per_node: GPUs of one node (with `hybrid`).
    """
    n = world_size
    if n <= 1:
        return []
    bwd = BACKWARD_FRACTION
    if strategy == "ddp":
        calls = 1 + _buckets(max(0, grad_bytes - 2**20), ddp_bucket_bytes) if grad_bytes > 2**20 else 1
        return [_c("all-reduce of the gradients (DDP buckets)", "all_reduce", grad_bytes, n, False, bwd, calls)]
    out: list[Collective] = []
    g = gpus_per_node or n
    if hybrid and not (1 < g < n and n % g == 0 and (strategy == "fsdp" or strategy == "zero3")):
        raise ValueError(f"hybrid sharding needs fsdp or zero3 over several nodes of several GPUs, not {strategy} "
                         f"with {g} of {n}")
    if strategy == "fsdp" and hybrid:  # HSDP: module docstring
        m = n // g
        out.append(_c("all-gather of the parameters, forward (in the node)", "all_gather", param_bytes, g, True, 1.0,
                      groups, "node"))
        if reshard_after_forward:
            out.append(_c("all-gather of the parameters, backward (in the node)", "all_gather", param_bytes, g, True,
                          1.0, groups, "node"))
        out.append(_c("reduce-scatter of the gradients (in the node)", "reduce_scatter", grad_bytes, g, True, bwd,
                      groups, "node"))
        out.append(_c("all-reduce of the gradient shard (across nodes)", "all_reduce", -(-grad_bytes // g), m, True,
                      bwd, groups, "across_nodes", g))
        return out
    if strategy == "fsdp":
        gathers = 2 if reshard_after_forward else 1
        out.append(_c("all-gather of the parameters, forward", "all_gather", param_bytes, n, True, 1.0, groups))
        if reshard_after_forward:
            out.append(_c("all-gather of the parameters, backward", "all_gather", param_bytes, n, True, 1.0, groups))
        out.append(_c("reduce-scatter of the gradients", "reduce_scatter", grad_bytes, n, True, bwd, groups))
        if cpu_offload:
            for i in range(gathers):
                out.append(_c(f"parameter shard host -> GPU ({'forward' if i == 0 else 'backward'})",
                              "host_to_device", -(-param_bytes // n), n, True, 0.0))
            out.append(_c("gradient shard GPU -> host", "device_to_host", -(-grad_bytes // n), n, True, 0.0))
        return out
    stage = int(strategy[-1])
    reduce_overlap = bwd if overlap_comm else 0.0
    rs_calls = _buckets(grad_bytes, reduce_bucket_bytes) if reduce_bucket_bytes else 1
    out.append(_c("reduce-scatter of the gradients", "reduce_scatter", grad_bytes, n, stage >= 2, reduce_overlap,
                  rs_calls))
    if stage < 3:
        ag_calls = _buckets(param_bytes, allgather_bucket_bytes) if allgather_bucket_bytes else 1
        out.append(_c("all-gather of the updated parameters", "all_gather", param_bytes, n, False, 0.0, ag_calls))
    else:
        gather_overlap = 1.0 if overlap_comm else 0.0
        out.append(_c("all-gather of the parameters, forward", "all_gather", param_bytes, n, True, gather_overlap,
                      groups))
        if hybrid:  # hpZ: the backward gathers the secondary partition within the node
            out.append(_c("all-gather of the parameters, backward (hpZ, in the node)", "all_gather", param_bytes, g,
                          True, gather_overlap, groups, "node"))
        else:
            out.append(_c("all-gather of the parameters, backward", "all_gather", param_bytes, n, True,
                          gather_overlap, groups))
        if offload_param:
            for phase in ("forward", "backward"):
                out.append(_c(f"parameter partition host -> GPU ({phase})", "host_to_device", -(-param_bytes // n),
                              n, True, 0.0))
    if offload_optimizer:
        out.append(_c("gradient partition GPU -> host", "device_to_host", -(-grad_bytes // n), n, stage >= 2, 0.0))
        if not offload_param:
            out.append(_c("updated parameter partition host -> GPU", "host_to_device", -(-param_bytes // n), n,
                          False, 0.0))
    return out


def gpu_link_bytes_per_s(ic: Interconnect, nodes: int) -> float:
    """Achieved bytes/s of a rank's collectives: its link in the node, bounded by the network across nodes."""
    bw = ic.intra_node_gbps * 1e9
    if nodes > 1:
        bw = min(bw, ic.network_gbps * 1e9 / 8)
    return bw * NCCL_EFFICIENCY


def host_link_bytes_per_s(ic: Interconnect) -> float:
    """Achieved bytes/s of a host copy over the GPU's PCIe link."""
    return ic.host_gbps * 1e9 * HOST_COPY_EFFICIENCY


@dataclass(frozen=True)
class StepTime:
    """Modelled seconds of one optimizer step of one rank."""

    compute_s: float  #: forward + backward of every micro-step
    optimizer_s: float  #: the optimizer's pass (on the GPU, or on the CPU with offload)
    comm_s: float  #: every collective, as if nothing overlapped (latency included)
    exposed_comm_s: float  #: the collectives' time compute does not hide, and their latency
    host_copy_s: float  #: host <-> GPU copies (offload), exposed
    total_s: float  #: compute + optimizer + exposed collectives + host copies

    def to_json(self) -> dict:
        return {k: round(v, 6) for k, v in asdict(self).items()}


def comm_step_time(colls: list[Collective], *, micro_compute_s: float, accumulation: int, optimizer_s: float,
                   ic: Interconnect, nodes: int) -> StepTime:
    """The step time of a rank (module docstring: overlap with compute).

    Args:
        colls: the step's transfers (`collectives`).
        micro_compute_s: compute of one micro-step (forward + backward, no optimizer).
        accumulation: micro-steps per optimizer step.
        optimizer_s: the optimizer's pass.
        ic: the rank's links.
        nodes: nodes the ranks span.
    """
    gpu_bw, host_bw = gpu_link_bytes_per_s(ic, nodes), host_link_bytes_per_s(ic)
    node_bw = gpu_link_bytes_per_s(ic, 1)

    def link(c: Collective) -> float:
        if c.scope == "node":
            return node_bw
        if c.scope == "across_nodes":  # the node's network, shared by its concurrent groups
            return ic.network_gbps * 1e9 / 8 / max(1, c.concurrent) * NCCL_EFFICIENCY
        return gpu_bw

    comm = exposed = host = 0.0
    for i in range(accumulation):
        last = i == accumulation - 1
        hidden_s, window = 0.0, 0.0
        for c in colls:
            if not (c.every_micro_step or last):
                continue
            if c.on_host_link:
                host += c.bytes_per_call / host_bw
                continue
            t = c.bytes_per_call / link(c)
            latency = c.launches * COLLECTIVE_LATENCY_S
            comm += t + latency
            exposed += latency
            if c.overlap > 0:
                hidden_s += t
                window = max(window, min(1.0, c.overlap))
            else:
                exposed += t
        exposed += max(0.0, hidden_s - window * micro_compute_s)
    compute = accumulation * micro_compute_s
    return StepTime(compute, optimizer_s, comm, exposed, host, compute + optimizer_s + exposed + host)
