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
* Quantized base weights (bitsandbytes 4/8-bit, memfit.remedies.quantization): every quantized
  matmul dequantizes its weight before the GEMM (bitsandbytes `MatMul4Bit`: `dequantize_4bit` in the
  forward and again in the backward for the input gradient; memfit.sim.kernels.bnb), a memory-bound
  pass reading the packed weight (bits/8 bytes per parameter) and writing it in 16 bits (2 bytes):
  per micro-step 2 passes (3 with gradient checkpointing's recomputed forward), divided by the memory
  bandwidth. The quantized parameters are taken as the frozen ones (the LM head and embeddings, which
  stay unquantized, are counted too: an overestimate of a few percent of the pass). An assumption
  from the kernels' data movement, not a measurement; FlashAttention and Liger are modelled as
  costing no time (their authors measure them as faster, which is not credited).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.gpus.catalog import GpuSpec

__all__ = ["StepCost", "step_time_s", "T_HALF_TOKENS"]

T_HALF_TOKENS = 512  # assumption, see module docstring
_TENSOR_CORE_FRACTION = 0.35  # assumption, see module docstring
_FP32_FRACTION = 0.75  # assumption, see module docstring
_OPT_BYTES_PER_PARAM = {
    "adamw_torch": 28, "adamw_torch_fused": 28, "adamw_bnb_8bit": 16, "adamw_8bit": 16,
    "adafactor": 16, "sgd": 12, "adagrad": 20, "rmsprop": 20,
}


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
    return cost.accumulation * micro_s + opt_s
