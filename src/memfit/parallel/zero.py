"""DeepSpeed ZeRO-1/2/3 per rank, emulated from DeepSpeed's source (0.19.8; each rule cites it).

ZeRO cannot run under fake tensors (its optimizers flatten, pin and narrow real storages, and its
hooks read `param.ds_status`), so its model states and communication buffers are written from
the rules below as buffers with a lifetime; `memfit.parallel.rank` puts them into the simulated
trace in place of the single-GPU weights, gradients and optimizer state. Symbols: P all
parameters, T the trainable ones (the optimizer's), N ranks, b the bytes of DeepSpeed's dtype
(`fp16`/`bf16` 2, else 4; the engine casts the module to it: engine.py `_configure_distributed_model`).

Stage 1 / 2 (deepspeed/runtime/zero/stage_1_and_2.py, `DeepSpeedZeroOptimizer`):

* the bit16 parameters are flattened per group (`bit16_groups_flat`, `flatten_dense_tensors_aligned`)
  and the module's params become views: b*P on every rank, as the model itself;
* the fp32 master partition `single_partition_of_fp32_groups` (4*T/N) is made at construction, on
  the host with `offload_optimizer` (`weights_partition = ...cpu()`), else on the GPU;
* Adam's exp_avg / exp_avg_sq: 8*T/N, created at the first step (torch's lazy `_init_group`; DeepSpeed's
  `initialize_optimizer_states` only gives the partition a gradient);
* ZeRO-2 `grads_in_partition`: b*T/N here, made at the first reduced gradient (`copy_grads_in_partition`,
  `torch.empty(total_size, dtype=self.dtype)`) and kept; its real size differs by rank (`total_size` counts the
  whole parameters a partition cuts): `zero2_rank_layouts`, applied per rank by memfit.parallel.rank; ZeRO-1 keeps the full bit16 gradients
  (b*T) until the step (`reduce_gradients` at the boundary);
* `setup_buckets`: with `contiguous_gradients`, one ipg buffer of `reduce_bucket_size` elements per
  dtype (ZeRO-1 in the fp32 accumulation dtype, ZeRO-2 in b: `_gradient_reduction_buffer_dtype`), two
  with `overlap_comm` ("double buffers"), made as a backward starts and dropped by `_release_ipg_buffers`
  at its epilogue (`independent_gradient_partition_epilogue`), which drops `grads_in_partition` too
  (`averaged_gradients` holds it until the step);
* step: the rank's gradient partition flattened (`flat_grad_partition = self.flatten(self.averaged_gradients[i])`:
  `averaged_gradients` is the list of views `get_flat_partition(..., return_tensor_list=True)` gave, so
  this is a copy, b*T/N) and as fp32 (`.to(fp32)`: 4*T/N when b is 2; with fp32 `.to` returns the
  same tensor);
* with `optimizer.params.torch_adam`, torch's Adam steps the flat fp32 partition: one temporary of
  its size (torch/optim/adam.py: `denom = exp_avg_sq.sqrt() / ...`); DeepSpeed's FusedAdam, and the
  Trainer's fused AdamW, step in place;
* with `offload_optimizer`: `temp_grad_buffer_for_gpu_offload` (largest parameter, b bytes each) on
  the GPU; master, gradient (`single_partition_of_fp32_groups[i].grad`, pinned) and Adam state on the host.

Stage 3 (stage3.py `DeepSpeedZeroOptimizer_Stage3`, partition_parameters.py `Init`):

* every parameter is partitioned: b*P/N per rank (on the host with `offload_param`), except those
  with `ds_numel <= stage3_param_persistence_threshold` (`Init._convert_to_deepspeed_param`:
  `param.ds_persist = True`), which stay whole on every rank;
* forward and backward all-gather each module's parameters before it runs and release them after
  (partitioned_param_coordinator.py `fetch_sub_module`, `release_sub_module`). In the first
  optimizer step the module trace is being recorded (no prefetch) and every module's parameters are released
  after it: a working set of b * min(largest module + prefetch bucket, max live, P), alive through
  forward and backward (a bound: the real set rises and falls module by module). Once the trace is
  complete, `__params_to_release` keeps any parameter that is used again within
  `stage3_max_reuse_distance` elements (a forward module at x elements from the start is used again
  in the backward 2*(P - x) elements later, so distance / 2 elements stay gathered from the forward into the
  backward), and any parameter whose later use the prefetcher has already passed; the prefetcher gathers at
  least one parameter (up to `stage3_prefetch_bucket_size` elements) at every module fetch, parameterless modules
  included, so it runs ahead until `__n_available_params` reaches `stage3_max_live_parameters`, which gates the
  prefetch only. Kept: b * min(P, max(distance / 2 + largest module + bucket, max live)) (max live only with a
  prefetch bucket); measured in real runs (tests/parallel/test_parallel_deepspeed.py: peaks unmoved by distance 0
  or 40000, or max live 30000 alone);
* the ipg bucket: `reduce_bucket_size` elements of b, made at construction (`bucket.buffer = torch.empty(
  self.reduce_bucket_size, ...)` when `contiguous_gradients`);
* `grad_partitions_flat_buffer`: T/N elements of the accumulation dtype (b), on `self.device` (the host
  with `offload_optimizer`);
* fp32 master partitions 4*T/N and Adam 8*T/N (host with `offload_optimizer`); the step converts each
  sub-group's gradient to fp32 (`_prepare_fp32_grad_for_sub_group`): 4*min(T/N, sub_group_size).

ZeRO++ (stage 3 only):

* hpZ, `zero_hpz_partition_size` = h > 1: every partitioned parameter also keeps a secondary partition of
  `_aligned_size(param) // num_ranks_in_param_group` elements in its dtype (partition_parameters.py
  `_partition_param_sec`: `torch.empty(secondary_partition_size, dtype=param.dtype, device=self.remote_device)`),
  made when a gathered parameter is released (at `zero.Init` and in each forward), so backward all-gathers stay
  within the h ranks of a node (`zero_param_process_group`); dropped after each step (stage3.py `_post_step` ->
  `invalidate_secondary_tensor`): b * P/h per rank (on the host with `offload_param`), from the forward to the
  end of the step;
* qwZ, `zero_quantized_weights`: each all-gather moves int8 (partition_parameters.py `_all_gather_coalesced`:
  `flat_tensor = torch.empty(partition_sz * world_size, dtype=torch.int8)` and a float32
  `quant_scale_buffer` of `scales.numel() * world_size`, CUDAQuantizer groups of at most 8000 elements) before
  dequantizing into the bit16 parameters: 1 byte + 4/8000 bytes per gathered element while gathers are in flight;
* qgZ, `zero_quantized_gradients`: each bucket of n gradient elements is reduced by
  `all_to_all_quant_reduce` (runtime/comm/coalesced_collectives.py): an int4 swizzled copy and its all-to-all
  output (n/2 bytes each), the intra-node reduction and its output (n/(2g) bytes each, g GPUs per node) and
  the dequantized fp16 result (2n/g bytes), during the backward.

Known limitations: padding of the flat groups to a multiple of the world size (< 2N elements per
group) is left out; the stage-3 working set is a bound, not module by module; the parameter
flattening at construction (a transient second copy of one group) is not in the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.parallel.setup import ZeroSettings

__all__ = ["ZeroBuffer", "zero_buffers", "ParamInventory", "deepspeed_model_states_bytes", "Zero2RankLayout",
           "zero2_rank_layouts"]

_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class ParamInventory:
    """What ZeRO's rules need to know of a model."""

    total_params: int
    trainable_params: int
    largest_layer_params: int
    """Largest `sum(p.numel() for p in m.parameters(recurse=False))` over modules (stage3.py `model_to_params`)."""
    largest_param_numel: int
    persistent_params: int
    """Parameters at or under the persistence threshold (stage 3 keeps them whole)."""


@dataclass(frozen=True)
class ZeroBuffer:
    """One model-state tensor or buffer of one rank."""

    name: str
    size_bytes: int
    device: str
    """`gpu` or `host`."""
    lifetime: str
    """`setup` (made at construction, kept), `step` (made at the first optimizer step, kept), `step_temp` (only
    during the step), `fwd_bwd` (from each forward to the end of its backward), `backward` (during each backward),
    `backward_to_step` (from the first backward of an optimizer step to that step), `forward_to_step_end` (made at
    setup and again at the first forward after each step, freed at the end of the step: ZeRO++ hpZ)."""
    category: str
    rule: str


def zero_buffers(z: ZeroSettings, inv: ParamInventory, world_size: int,
                 gpus_per_node: int | None = None) -> list[ZeroBuffer]:
    """The per-rank model states and buffers of ZeRO stage `z.stage` (module docstring for the rules).

    Args:
        z: the resolved ZeRO settings.
        inv: the model's parameter counts.
        world_size: ranks the data-parallel group has.
        gpus_per_node: GPUs on each node (qgZ's intra-node step; default: all ranks on one node).
    """
    if z.stage not in (1, 2, 3):
        raise MemfitError(f"ZeRO stage `{z.stage}` is not 1, 2 or 3")
    b = _DTYPE_BYTES[z.dtype]
    n = world_size
    P, T = inv.total_params, inv.trainable_params
    t_part = -(-T // n)  # partition_size: ceil, the last rank's partition is padded to the same size
    opt_dev = "host" if z.offload_optimizer else "gpu"
    out: list[ZeroBuffer] = []
    if z.stage in (1, 2):
        out.append(ZeroBuffer("bit16 parameters (flat groups)", b * P, "gpu", "setup", "weights",
                              "stage_1_and_2.py bit16_groups_flat: the module's params become views of it"))
        out.append(ZeroBuffer("fp32 master partition", 4 * t_part, opt_dev, "setup", "optimizer_state",
                              "stage_1_and_2.py single_partition_of_fp32_groups"))
        out.append(ZeroBuffer("Adam exp_avg + exp_avg_sq", 8 * t_part, opt_dev, "step", "optimizer_state",
                              "torch Adam _init_group at the first step, on the fp32 partition"))
        if z.stage == 2:
            out.append(ZeroBuffer("grads_in_partition", b * t_part, "host" if z.offload_optimizer else "gpu",
                                  "backward_to_step", "gradients",
                                  "stage_1_and_2.py copy_grads_in_partition; _release_ipg_buffers drops the name at the "
                                  "backward epilogue, averaged_gradients keeps it until step() sets it None"))
        else:
            out.append(ZeroBuffer("bit16 gradients (until the step)", b * T, "gpu", "backward_to_step", "gradients",
                                  "stage_1_and_2.py reduce_gradients: ZeRO-1 reduces at the boundary"))
        if z.contiguous_gradients:
            ipg_b = 4 if z.stage == 1 else b  # _gradient_reduction_buffer_dtype
            count = 2 if z.overlap_comm else 1
            out.append(ZeroBuffer(f"ipg buffer x{count}", count * ipg_b * z.reduce_bucket_size, "gpu", "backward",
                                  "temporaries", "stage_1_and_2.py setup_buckets (double with overlap_comm); freed by "
                                  "_release_ipg_buffers at the backward epilogue"))
        if z.offload_optimizer:
            out.append(ZeroBuffer("temp_grad_buffer_for_gpu_offload", b * inv.largest_param_numel, "gpu", "setup",
                                  "temporaries", "stage_1_and_2.py __init__ (cpu_offload)"))
            out.append(ZeroBuffer("fp32 gradient partition (pinned)", 4 * t_part, "host", "setup", "gradients",
                                  "stage_1_and_2.py initialize_optimizer_states (kept with cpu_offload)"))
        else:
            out.append(ZeroBuffer("flat gradient partition", b * t_part, "gpu", "step_temp", "temporaries",
                                  "stage_1_and_2.py step: flat_grad_partition = self.flatten(averaged_gradients[i])"))
            if b != 4:
                out.append(ZeroBuffer("fp32 gradient partition", 4 * t_part, "gpu", "step_temp", "temporaries",
                                      "stage_1_and_2.py step: single_grad_partition = flat.to(fp32)"))
            if z.torch_adam:
                out.append(ZeroBuffer("torch Adam temporary", 4 * t_part, "gpu", "step_temp", "temporaries",
                                      "torch/optim/adam.py: denom = exp_avg_sq.sqrt() / ..."))
        return out
    # stage 3
    part = -(-(P - inv.persistent_params) // n)
    param_dev = "host" if z.offload_param else "gpu"
    out.append(ZeroBuffer("bit16 parameter partitions", b * part, param_dev, "setup", "weights",
                          "partition_parameters.py Init: ds_tensor of numel ceil(P/N)"))
    if inv.persistent_params:
        out.append(ZeroBuffer("persistent parameters (whole)", b * inv.persistent_params, "gpu", "setup", "weights",
                              "partition_parameters.py: ds_numel <= stage3_param_persistence_threshold -> ds_persist"))
    gathered = P - inv.persistent_params
    first = min(inv.largest_layer_params + z.prefetch_bucket_size, z.max_live_parameters, gathered)
    # trace complete (partitioned_param_coordinator.py, DeepSpeed 0.19.8):
    # * `__params_to_release` keeps what is used again within stage3_max_reuse_distance elements; this retention
    #   does not look at `__n_available_params`, so stage3_max_live_parameters does not cap it;
    # * stage3_max_live_parameters gates only the prefetch (`_fetch_sub_module_impl`: `max_params_to_prefetch =
    #   min(__max_n_available_params - __n_available_params, __prefetch_bucket_sz)`), and the prefetcher runs ahead:
    #   every module fetch (containers, dropouts and activations too) pops the parameter queue until one bucket of
    #   not-yet-gathered parameters (at least one parameter) is gathered, so it gathers faster than the modules
    #   use, and `__params_to_release` keeps each parameter whose later use it has passed
    #   (`__most_recent_step_id_param_fetched_for[param] > step_id`). With prefetching on, the gathered set grows to
    #   max_live_parameters (measured in real 2-process runs: tests/parallel/test_parallel_deepspeed.py).
    kept = z.max_reuse_distance // 2 + inv.largest_layer_params + z.prefetch_bucket_size
    ahead = z.max_live_parameters if z.prefetch_bucket_size > 0 else 0
    later = min(max(first, kept, ahead), gathered)
    out.append(ZeroBuffer("all-gathered parameters (trace being recorded)", b * first, "gpu", "fwd_bwd_first",
                          "weights", "partitioned_param_coordinator.py fetch_sub_module: largest module + prefetch "
                          "bucket, at most stage3_max_live_parameters"))
    out.append(ZeroBuffer("all-gathered parameters (trace complete)", b * later, "gpu", "fwd_bwd", "weights",
                          "partitioned_param_coordinator.py __params_to_release: reused within "
                          "stage3_max_reuse_distance, or passed by the prefetcher (up to stage3_max_live_parameters) "
                          "-> kept"))
    if z.contiguous_gradients:
        out.append(ZeroBuffer("ipg bucket", b * z.reduce_bucket_size, "gpu", "setup", "temporaries",
                              "stage3.py __init__: bucket.buffer = torch.empty(reduce_bucket_size)"))
    out.append(ZeroBuffer("grad_partitions_flat_buffer", b * t_part, opt_dev, "setup", "gradients",
                          "stage3.py __init__: zeros(sum partition_numel), on self.device"))
    out.append(ZeroBuffer("fp32 master partitions", 4 * t_part, opt_dev, "setup", "optimizer_state",
                          "stage3.py fp32_partitioned_groups_flat"))
    out.append(ZeroBuffer("Adam exp_avg + exp_avg_sq", 8 * t_part, opt_dev, "step", "optimizer_state",
                          "torch Adam / DeepSpeedCPUAdam state on the fp32 partitions"))
    hpz = min(z.hpz_partition_size, n)  # groups._create_zero_param_parallel_group: min(group_size, world_size)
    if hpz > 1:
        out.append(ZeroBuffer(f"hpZ secondary partitions (1/{hpz})", b * -(-gathered // hpz), param_dev,
                              "forward_to_step_end", "weights",
                              "partition_parameters.py _partition_param_sec; stage3.py _post_step -> "
                              "invalidate_secondary_tensor"))
    if z.quantized_weights:
        gather = min(inv.largest_layer_params + z.prefetch_bucket_size, gathered)
        out.append(ZeroBuffer("qwZ int8 all-gather buffers", gather + 4 * -(-gather // 8000), "gpu", "fwd_bwd",
                              "temporaries", "partition_parameters.py _all_gather_coalesced (quantize): int8 flat_tensor "
                              "+ fp32 quant_scale_buffer (CUDAQuantizer target_group_size 8000)"))
    if z.quantized_gradients:
        g = max(1, gpus_per_node or n)
        bucket = z.reduce_bucket_size
        out.append(ZeroBuffer("qgZ int4 all-to-all buffers", bucket + bucket // g + 2 * bucket // g, "gpu", "backward",
                              "temporaries", "coalesced_collectives.py all_to_all_quant_reduce: int4 copy + output, "
                              "intra-node reduction + output, fp16 dequantized result"))
    if not z.offload_optimizer:
        sub = min(t_part, z.sub_group_size)
        out.append(ZeroBuffer("flat gradient of a sub-group", b * sub, "gpu", "step_temp", "temporaries",
                              "stage3.py _prepare_fp32_grad_for_sub_group: self.flatten(averaged_gradients)"))
        if b != 4:
            out.append(ZeroBuffer("fp32 gradient of a sub-group", 4 * sub, "gpu", "step_temp", "temporaries",
                                  "stage3.py _prepare_fp32_grad_for_sub_group: .to(fp32)"))
        if z.torch_adam:
            out.append(ZeroBuffer("torch Adam temporary", 4 * sub, "gpu", "step_temp", "temporaries",
                                  "torch/optim/adam.py: denom = exp_avg_sq.sqrt() / ..."))
    return out


def deepspeed_model_states_bytes(stage: int, inv: ParamInventory, *, gpus_per_node: int, nodes: int,
                                 offload_optimizer: bool, offload_param: bool = False, zero_init: bool = True,
                                 additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) per DeepSpeed's own estimators, the same formulas:

    stage 1/2: stage_1_and_2.py `estimate_zero2_model_states_mem_needs` (DeepSpeed has none for stage 1);
    stage 3: stage3.py `estimate_zero3_model_states_mem_needs`. They count all parameters as trained
    (as `..._all_live` does) and leave activations and buffers out.

    Args:
        stage: 1, 2 or 3.
        inv: the parameter counts (total_params, largest_layer_params are used).
        gpus_per_node: GPUs on each node.
        nodes: nodes.
        offload_optimizer: `cpu_offload` in DeepSpeed's names.
        offload_param: `cpu_offload_params` (stage 3).
        zero_init: `zero.Init` used (stage 3).
        additional_buffer_factor: DeepSpeed's default 1.5 (host side only).
    """
    total = inv.total_params
    total_gpus = nodes * gpus_per_node
    if stage in (1, 2):
        if offload_optimizer:
            gpu = 2 * total
            cpu = total * max(4 * total_gpus, 16) * additional_buffer_factor
        else:
            gpu = 2 * total + int(18 * total / total_gpus)
            cpu = total * 4 * gpus_per_node * additional_buffer_factor
        return int(cpu), int(gpu)
    gpus_factor = 1 / nodes
    largest = 4 * inv.largest_layer_params
    if offload_optimizer:
        if offload_param:
            gpu = largest
            cpu = (total * 18 * gpus_factor if zero_init else total * max(4 * gpus_per_node, 18 * gpus_factor))
        else:
            gpu = largest + int(2 * total / total_gpus)
            cpu = (total * 16 * gpus_factor if zero_init else total * max(4 * gpus_per_node, 16 * gpus_factor))
        cpu *= additional_buffer_factor
    else:
        gpu = largest + int(18 * total / total_gpus)
        cpu = (inv.largest_layer_params if zero_init else total) * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


# -- ZeRO-2 per rank : what differs between ranks --------------------------------------------------
@dataclass(frozen=True)
class Zero2RankLayout:
    """One rank's ZeRO-2 gradient partition buffer."""

    rank: int
    grads_in_partition_numel: int
    """stage_1_and_2.py `copy_grads_in_partition`: `total_size` sums the *whole* numel of every parameter in
    `params_in_partition` (a parameter cut by a partition boundary counts fully on both ranks)."""


def zero2_rank_layouts(groups: list[list[int]], world_size: int) -> list[Zero2RankLayout]:
    """Each rank's ZeRO-2 `grads_in_partition` size (DeepSpeed 0.19.8 stage_1_and_2.py).

    Each optimizer param group is flattened in order and padded to a multiple of 2 * world_size elements
    (`flatten_dense_tensors_aligned(..., self.nccl_start_alignment_factor * dp_size)`, the factor 2), then split
    into equal partitions (`get_data_parallel_partitions`); rank r's `params_in_partition` are the parameters
    overlapping [r*size, (r+1)*size) (`get_partition_info`), and its buffer holds all of them whole.

    Args:
        groups: the numel of each trainable parameter, per optimizer param group, in group order.
        world_size: ranks of the data-parallel group.
    """
    sizes = [0] * world_size
    for numels in groups:
        align = 2 * world_size
        part = -(-sum(numels) // align) * align // world_size
        offset = 0
        for n in numels:
            if n:
                first, last = offset // part, (offset + n - 1) // part
                for r in range(first, min(last, world_size - 1) + 1):
                    sizes[r] += n
            offset += n
    return [Zero2RankLayout(r, sizes[r]) for r in range(world_size)]
