"""GPU memory a training process holds outside PyTorch's caching allocator.

`nvidia-smi` shows more than `torch.cuda.memory_reserved()`; the difference is the
CUDA context and libraries. PyTorch's OOM message calls it "non-PyTorch memory". The
estimate here is a sum of parts:

* driver/runtime base: context bookkeeping, page tables, the default stream, events
  (estimate 110 MiB, from measured contexts of 300-500 MiB minus the parts below);
* per-thread local-memory (stack) reservation: the driver backs the stack of every
  resident thread, `SMs x max resident threads per SM x cudaLimitStackSize` (default
  1 KiB, CUDA Runtime API `cudaDeviceSetLimit`); this is why H100 contexts are larger
  than T4 ones;
* loaded kernels (fatbins of libtorch_cuda, cuBLAS, cuBLASLt, NCCL ...): with lazy
  loading (`CUDA_MODULE_LOADING=LAZY`, CUDA >= 11.7, set by default by torch >= 1.13)
  only the kernels a run touches are loaded (estimate 200 MiB for a fine-tuning step);
  with eager loading everything is loaded up front: the Hugging Face guide
  "Model training anatomy" (docs/transformers/model_memory_anatomy) measured 1343 MB
  in use after creating a 1-element CUDA tensor, "the kernels alone take up 1.3GB".
* cuBLAS / cuBLASLt workspaces are NOT here: torch allocates them through the caching
  allocator (aten/src/ATen/cuda/CublasHandlePool.cpp, `getNewWorkspace` ->
  `CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())`), one per
  (handle, stream), so they appear in `memory_reserved`. Default size
  (`parseChosenWorkspaceSize`): 4096 KiB x 8 = 32 MiB on sm_90, else
  4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB; `CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT` overrides.
  `cublas_workspace_bytes` gives that size so a trace can include it (the autograd
  engine's backward thread uses its own handle, hence its own workspace).
* cuDNN: transformer fine-tuning rarely touches cuDNN (no convolutions); when it does,
  its handle and kernels add roughly 100-300 MiB that is not included.

Known limitations:

* The base and kernel figures are estimates (+-150 MiB): they vary with driver, CUDA
  and torch versions. Prefer `measure_non_pytorch_bytes()` on the target machine.
* NCCL buffers (multi-GPU), CUDA graphs and other processes are not included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from memfit.gpus.catalog import FALLBACK_SM_COUNT, GpuSpec
from memfit.units import KiB, MiB

__all__ = ["NonPytorchEstimate", "non_pytorch_bytes", "measure_non_pytorch_bytes", "cublas_workspace_bytes",
           "gpu_processes"]

_BASE_BYTES = 110 * MiB  # estimate: driver/runtime structures of a primary context
_LAZY_KERNELS_BYTES = 200 * MiB  # estimate: kernels touched by a fine-tuning step
_EAGER_KERNELS_BYTES = 1024 * MiB  # HF "Model training anatomy": ~1.3 GB total with eager loading
_STACK_PER_THREAD_BYTES = 1 * KiB  # cudaLimitStackSize default

#: "Maximum number of resident threads per SM" (CUDA C Programming Guide, table "Technical
#: Specifications per Compute Capability"); 2048 for the others (6.x, 7.0, 8.0, 9.0, 10.0) and for
#: AMD CDNA compute units (32 waves of 64, an assumption: ROCm's context is not modelled from source).
_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536, (12, 0): 1536}


@dataclass(frozen=True)
class NonPytorchEstimate:
    total_bytes: int
    breakdown: dict[str, int]
    notes: tuple[str, ...]


def cublas_workspace_bytes(gpu: GpuSpec, environ: Mapping[str, str] | None = None) -> int:
    """One cuBLAS (hipBLAS) workspace as torch sizes it; it lives in PyTorch's cache.

    aten/src/ATen/cuda/CublasHandlePool.cpp `parseChosenWorkspaceSize` (pytorch main, 2026):
    `CUBLAS_WORKSPACE_CONFIG` (`:SIZE_KiB:COUNT` pairs, summed) when set; else on CUDA
    `:4096:2:16:8` (8 MiB + 128 KiB), or 32 MiB for compute capability major 9, 10, 11 and 12
    (Hopper, Blackwell); on ROCm `HIPBLAS_WORKSPACE_CONFIG` / `ROCBLAS_WORKSPACE_CONFIG` are read
    too, and the default is 32 MiB, 128 MiB on gfx942 / gfx950 (MI300 / MI350: (9, 4), (9, 5)). None on an
    emulated GPU (`GpuSpec.emulated`).
    """
    if gpu.emulated:  # a memory budget on the CPU (memfit.testing.memory_budget): no cuBLAS
        return 0
    env = os.environ if environ is None else environ
    names = ("CUBLAS_WORKSPACE_CONFIG",) + (("HIPBLAS_WORKSPACE_CONFIG", "ROCBLAS_WORKSPACE_CONFIG")
                                             if gpu.vendor == "amd" else ())
    config = next((env[n] for n in names if env.get(n)), None)
    if config:
        import re

        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * KiB * int(count) for size, count in pairs)
    if gpu.vendor == "amd":
        return 128 * MiB if tuple(gpu.compute_capability) in ((9, 4), (9, 5)) else 32 * MiB
    if gpu.compute_capability[0] in (9, 10, 11, 12):
        return 4096 * KiB * 8
    return 4096 * KiB * 2 + 16 * KiB * 8


def non_pytorch_bytes(gpu: GpuSpec, *, lazy_loading: bool | None = None) -> NonPytorchEstimate:
    """Estimate the CUDA context and library memory of one training process on `gpu`."""
    if lazy_loading is None:
        lazy_loading = os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() != "EAGER"
    sms = gpu.sm_count or FALLBACK_SM_COUNT
    threads = _THREADS_PER_SM.get(gpu.compute_capability, 2048)
    stack = sms * threads * _STACK_PER_THREAD_BYTES
    kernels = _LAZY_KERNELS_BYTES if lazy_loading else _EAGER_KERNELS_BYTES
    breakdown = {"driver_runtime_base": _BASE_BYTES, "thread_stacks": stack, "kernels": kernels}
    notes = [
        f"thread stacks: {sms} SMs x {threads} threads x 1 KiB (cudaLimitStackSize default)",
        "kernels: lazy loading (CUDA_MODULE_LOADING=LAZY)" if lazy_loading
        else "kernels: eager loading, ~1.3 GB measured in the HF 'Model training anatomy' guide",
        "cuBLAS workspaces are allocated by PyTorch's cache and counted there, not here",
        "estimate +-150 MiB; measure with memfit.gpus.outside_pytorch.measure_non_pytorch_bytes() on the GPU",
    ]
    if not gpu.sm_count:
        notes.append(f"SM count of `{gpu.name}` unknown; assumed {FALLBACK_SM_COUNT} (A100)")
    if gpu.vendor == "amd":
        notes.append("ROCm: the HIP context is estimated with CUDA's figures (not measured on AMD GPUs)")
    return NonPytorchEstimate(sum(breakdown.values()), breakdown, tuple(notes))


def measure_non_pytorch_bytes(device: int = 0) -> int | None:
    """This process's GPU memory per NVML minus `torch.cuda.memory_reserved()`; None without a GPU."""
    try:
        import pynvml  # nvidia-ml-py
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # pragma: no cover - needs a GPU
    try:  # pragma: no cover
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        pid = os.getpid()
        used = 0
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                used += int(proc.usedGpuMemory)
        pynvml.nvmlShutdown()
    except Exception:  # pragma: no cover - NVML missing or no permission (containers)
        return None
    if used == 0:  # pragma: no cover - per-process accounting unavailable
        return None
    return used - int(torch.cuda.memory_reserved(device))  # pragma: no cover


def gpu_processes() -> list[tuple[int, int, int]] | None:
    """(NVML device index, pid, bytes) of every compute process on every GPU now.

    None when nvidia-ml-py, the driver or a GPU is missing. NVML numbers devices in PCI order,
    which differs from CUDA's when `CUDA_VISIBLE_DEVICES` reorders them.
    """
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:  # not installed, no driver, no GPU
        return None
    out = []
    try:  # pragma: no cover - needs a GPU
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                out.append((i, int(proc.pid), int(proc.usedGpuMemory or 0)))
    except Exception:  # pragma: no cover - no permission (containers)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # pragma: no cover
            pass
    return out
