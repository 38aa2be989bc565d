"""A documented speed model for ranking plans: relative time of one optimizer step.

Only ratios between plans of one model on one GPU are used, so constant factors cancel.

Step time = micro-steps x (compute time of a micro-batch) + optimizer pass.

* Training FLOPs per token: 6 N for the dense parameters (2 N forward, 4 N backward:
  Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1) plus attention
  12 n_layer d L per token (same source, C_forward = 2N + 2 n_layer n_ctx d_attn, x3 for
  training). Frozen parameters (LoRA, frozen embeddings) skip the weight-gradient GEMM:
  4 N instead of 6 N (the input gradient is still computed). Gradient checkpointing
  recomputes the forward: + 2 N (+ the attention forward) per token, the 4/3 rule of
  Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost".
* Rate: the GPU's dense tensor-core rate for fp16/bf16 autocast, its fp32 rate for fp32
  (PyTorch leaves TF32 off for matmuls by default since 1.12,
  `torch.backends.cuda.matmul.allow_tf32 = False`), from memfit.gpus.catalog.
* Achieved fraction of the peak rate: 0.35 on tensor cores (fp16/bf16), 0.75 on fp32 CUDA
  cores. Assumptions, not measurements: transformer fine-tuning typically reaches 30-50%
  MFU with AMP, and NVIDIA's V100 mixed-precision BERT results show 2-4x (not the 8x of the
  peak-rate ratio) over fp32.
* Small-batch inefficiency: a micro-batch of T tokens reaches the fraction
  T / (T + T_HALF) of that rate. T_HALF = 512 tokens is an assumption (GEMMs with a few
  hundred rows leave SMs idle), used only to rank micro-batch sizes; it is not fitted to
  measurements.
* Optimizer pass, memory-bound: bytes read and written per trainable parameter
  (AdamW fp32: param, grad, two states read + param, two states written = 28 B; 8-bit
  AdamW: 4+4+2 read, 4+2 written = 16 B; Adafactor: ~16 B; SGD without momentum: 12 B)
  divided by the memory bandwidth, once per optimizer step.
* Quantized base weights (bitsandbytes 4/8-bit, memfit.remedies.qlora): every quantized
  matmul dequantizes its weight before the GEMM (bitsandbytes `MatMul4Bit`: `dequantize_4bit` in the
  forward and again in the backward for the input gradient; memfit.sim.kernels.bnb), a memory-bound
  pass reading the packed weight (bits/8 bytes per parameter) and writing it in 16 bits (2 bytes):
  per micro-step 2 passes (3 with gradient checkpointing's recomputed forward), divided by the memory
  bandwidth. The quantized parameters are taken as the frozen ones (the LM head and embeddings, which
  stay unquantized, are counted too: an overestimate of a few percent of the pass). An assumption
  from the kernels' data movement, not a measurement; FlashAttention and Liger are modelled as
  costing no time (their authors measure them as faster, which is not credited).
* Host transfers, over the GPU's host link (`host_link_gbps`: PCIe x16 of the card's generation,
  per direction, times `_PCIE_EFFICIENCY`), added to the step, not overlapped with compute:
  - checkpoint offload (`gradient_checkpointing_kwargs={"offload": True}`): transformers 5.24
    `_activation_checkpointing_enable` wraps each checkpointed layer in `save_on_cpu(pin_memory=True)`, so
    every checkpointed input goes device -> host in the forward and host -> device in the backward; its
    docstring: "Both copies run on the compute stream, so the step gets slower". Per micro-step 2 x
    `host_offload_bytes` (memfit.planner.ranking `StepTimer.offload_bytes`, checked against the simulation).
  - paged optimizers (bitsandbytes `paged_*`): the state lives in CUDA managed memory; while the GPU has room
    it stays there and costs nothing (assumption: no traffic when it fits). When the run's own memory leaves
    less room than the state, the part that does not fit is evicted to host memory and paged back for each
    update: bitsandbytes optim/optimizer.py `Optimizer8bit.step` calls `prefetch_state` (`F.prefetch_tensor`,
    cudaMemPrefetchAsync to the GPU) before every parameter's update, and the next forward's allocations evict
    it again (Dettmers et al. 2023, "QLoRA", sec. 2 "Paged Optimizers": states "automatically evicted to CPU
    RAM when the GPU runs out-of-memory and paged back into GPU memory when the memory is needed in the
    optimizer update step"). Per optimizer step 2 x the evicted bytes (`paged_traffic_bytes`). An assumption
    from that mechanism, not a measurement: page-fault granularity and driver eviction policy are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.gpus.catalog import GpuSpec

__all__ = ["StepCost", "step_time_s", "T_HALF_TOKENS", "host_link_gbps", "paged_traffic_bytes"]

T_HALF_TOKENS = 512  # assumption, see module docstring
_TENSOR_CORE_FRACTION = 0.35  # assumption, see module docstring
_FP32_FRACTION = 0.75  # assumption, see module docstring
_OPT_BYTES_PER_PARAM = {
    "adamw_torch": 28, "adamw_torch_fused": 28, "adamw_bnb_8bit": 16, "adamw_8bit": 16,
    "adafactor": 16, "sgd": 12, "adagrad": 20, "rmsprop": 20,
    # bitsandbytes: AdamW 32-bit as adamw_torch, 8-bit as adamw_bnb_8bit; Lion keeps one state:
    # 32-bit param, grad, state read + param, state written = 20 B; 8-bit 4+4+1 read, 4+1 written = 14 B
    "paged_adamw_32bit": 28, "paged_adamw_8bit": 16, "lion_32bit": 20, "lion_8bit": 14,
    "paged_lion_32bit": 20, "paged_lion_8bit": 14,
}

#: PCIe x16 per direction, GB/s (PCI-SIG): 8 / 16 / 32 GT/s x 16 lanes x 128/130 encoding / 8 bits.
_PCIE_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}
#: Fraction of that a pinned-memory cudaMemcpy reaches. Assumption, not a measurement: CUDA's bandwidthTest
#: sample typically reports ~12-13 GB/s on gen3 and ~25 GB/s on gen4 hosts (~0.8).
_PCIE_EFFICIENCY = 0.8
#: The PCIe generation of each catalog GPU's host interface (NVIDIA / AMD product datasheets: V100, T4, P100,
#: RTX 20 gen3; Ampere and Ada (A100, A10, L4, L40/L40S, RTX 30/40, RTX A6000 / 6000 Ada) gen4; Hopper
#: (H100 SXM/PCIe/NVL, H200, H20), Blackwell (B200, RTX 5090), MI300X gen5; MI250/MI250X gen4).
_PCIE_GEN = {
    "V100-16GB": 3, "V100-32GB": 3, "T4": 3, "P100-16GB": 3, "RTX-2080Ti": 3,
    "H100-80GB": 5, "H100-PCIe": 5, "H100-NVL": 5, "H200": 5, "H20": 5, "B200": 5, "RTX-5090": 5, "MI300X": 5,
}


def host_link_gbps(gpu: GpuSpec) -> float:
    """Achieved host <-> GPU bandwidth per direction, GB/s: the card's PCIe generation (`_PCIE_GEN`; other
    entries and sizes: gen3 before compute capability 8.0, gen4 for 8.x, gen5 from 9.0) x `_PCIE_EFFICIENCY`."""
    gen = _PCIE_GEN.get(gpu.name)
    if gen is None:
        cc = tuple(gpu.compute_capability)
        gen = 3 if cc < (8, 0) else 4 if cc < (9, 0) else 5
    return _PCIE_GBPS[gen] * _PCIE_EFFICIENCY


def paged_traffic_bytes(paged_bytes: int, room_bytes: int) -> int:
    """Bytes a paged optimizer moves over the host link per optimizer step (see module docstring): the part of
    its state that does not fit in the `room_bytes` the run leaves free, paged in for the update and evicted
    again, so twice that; 0 when it fits.

    Args:
        paged_bytes: the optimizer state in CUDA managed memory (memfit.estimator.MemoryReport.paged_bytes).
        room_bytes: GPU memory the run's own peak leaves free (may be negative: then all of it is evicted).
    """
    return 2 * max(0, paged_bytes - max(0, room_bytes))


@dataclass(frozen=True)
class StepCost:
    params: int
    trainable_params: int
    n_layer: int
    d_model: int
    seq_len: int
    micro_batch: int
    accumulation: int
    precision: str
    checkpointing: bool
    optim: str
    quantized_params: int = 0  #: base parameters stored quantized (dequantized in every matmul)
    quantized_bits: int = 4
    #: checkpointed inputs offloaded to the host per micro-step (each way), and a paged optimizer's
    #: page traffic per optimizer step (both ways); see the module docstring
    host_offload_bytes: int = 0
    paged_traffic_bytes: int = 0


def _rate_flops(gpu: GpuSpec, precision: str) -> float:
    if precision == "bf16" and gpu.bf16_tflops:
        return gpu.bf16_tflops * 1e12 * _TENSOR_CORE_FRACTION
    if precision in ("fp16", "bf16"):
        return gpu.fp16_tflops * 1e12 * _TENSOR_CORE_FRACTION
    return gpu.fp32_tflops * 1e12 * _FP32_FRACTION


def step_time_s(cost: StepCost, gpu: GpuSpec) -> float:
    """Modelled seconds for one optimizer step (see module docstring)."""
    tokens = cost.micro_batch * cost.seq_len
    frozen = cost.params - cost.trainable_params
    dense = 6 * cost.trainable_params + 4 * frozen
    attention = 12 * cost.n_layer * cost.d_model * cost.seq_len
    per_token = dense + attention
    if cost.checkpointing:
        per_token += 2 * cost.params + attention / 3
    efficiency = tokens / (tokens + T_HALF_TOKENS)
    micro_s = per_token * tokens / (_rate_flops(gpu, cost.precision) * efficiency)
    if cost.quantized_params:
        passes = 3 if cost.checkpointing else 2
        micro_s += passes * cost.quantized_params * (cost.quantized_bits / 8 + 2) / (gpu.memory_bandwidth_gbps * 1e9)
    opt_s = _OPT_BYTES_PER_PARAM.get(cost.optim, 28) * cost.trainable_params / (gpu.memory_bandwidth_gbps * 1e9)
    if cost.host_offload_bytes or cost.paged_traffic_bytes:
        link = host_link_gbps(gpu) * 1e9
        micro_s += 2 * cost.host_offload_bytes / link  # device -> host in the forward, back in the backward
        opt_s += cost.paged_traffic_bytes / link
    return cost.accumulation * micro_s + opt_s
