"""GPU catalog: memory as PyTorch sees it, compute capability, peak rates, bandwidth.

`total_bytes` is `torch.cuda.get_device_properties(i).total_memory` (cudaDeviceProp
`totalGlobalMem`), the "total capacity" in PyTorch's OOM message. It is below the
marketing size (ECC, driver-reserved memory) and varies by a few hundred MiB with
driver version, ECC mode and OS; values below are taken from OOM messages quoted in
GitHub issues (cited per entry) and rebuilt as bytes from the two-decimal GiB figure
(accurate to ~5 MiB), except where the exact byte count is known.

Peak rates are dense (no 2:4 sparsity) tensor-core rates from NVIDIA datasheets and
architecture whitepapers (fp16/bf16 with FP32 accumulate, as PyTorch matmuls use);
`None` where the precision has no hardware support (e.g. bf16 before Ampere, where
PyTorch emulates it).

Known limitations:

* Memory sizes marked "unverified" in `total_bytes_source` are estimates (nvidia-smi
  totals or recollection) that were not confirmed from a PyTorch message.
* One entry per GPU model: SXM vs PCIe variants differ in clocks and bandwidth
  (SXM figures are used for V100/A100/H100/H200).
* MIG slices and multi-GPU boards are not in the catalog; pass a size (`12GiB`).
"""

from __future__ import annotations

from typing import Any

import re
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.units import GiB, MiB, format_bytes, parse_size

__all__ = ["GpuSpec", "CATALOG", "resolve_gpu", "as_gpu_spec", "catalog_names"]


@dataclass(frozen=True)
class GpuSpec:
    name: str
    total_bytes: int  #: what torch.cuda.get_device_properties().total_memory reports
    compute_capability: tuple[int, int]
    fp32_tflops: float
    tf32_tflops: float | None
    fp16_tflops: float
    bf16_tflops: float | None
    memory_bandwidth_gbps: float  #: GB/s (10**9 bytes per second)
    total_bytes_source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def supports_bf16(self) -> bool:
        """Native bf16 (tensor cores, `torch.cuda.is_bf16_supported()`) from sm_80 on."""
        return self.compute_capability >= (8, 0)


def _gib(printed: float) -> int:
    """Bytes for a `format_size` figure such as 14.75 (GiB), aligned to 1 MiB."""
    return round(printed * GiB / MiB) * MiB


_SPECS = (
    # V100: datasheet "NVIDIA Tesla V100 GPU Accelerator" (SXM2: 15.7 FP32, 125 tensor, 900 GB/s)
    GpuSpec("V100-16GB", 16945512448, (7, 0), 15.7, None, 125.0, None, 900.0,
            "15.78 GiB total capacity (PyTorch OOM messages on V100-SXM2-16GB; exact bytes)"),
    GpuSpec("V100-32GB", _gib(31.74), (7, 0), 15.7, None, 125.0, None, 900.0,
            "31.74 GiB total capacity: haotian-liu/LLaVA#812"),
    # T4: "NVIDIA T4 Tensor Core GPU" datasheet: 8.1 FP32, 65 FP16 tensor, 320 GB/s
    GpuSpec("T4", _gib(14.75), (7, 5), 8.1, None, 65.0, None, 320.0,
            "14.75 GiB total capacity: hpcaitech/Open-Sora#697 (Colab); newer drivers show "
            "14.56-14.58 GiB (Zheng-Chong/CatVTON#133, QwenLM/Qwen3-VL#1046)"),
    # P100 PCIe 16GB datasheet: 9.3 FP32, 18.7 FP16 (no tensor cores), 732 GB/s
    GpuSpec("P100-16GB", _gib(15.90), (6, 0), 9.3, None, 18.7, None, 732.0,
            "15.90 GiB: unverified (Kaggle P100 recollection)"),
    # Turing whitepaper, RTX 2080 Ti reference: 13.4 FP32, 53.8 FP16 tensor w/ FP32 acc, 616 GB/s
    GpuSpec("RTX-2080Ti", _gib(10.76), (7, 5), 13.4, None, 53.8, None, 616.0,
            "10.76 GiB total capacity: RenYurui/StructureFlow#35"),
    # GA102 (Ampere) whitepaper, RTX 3090: 35.6 FP32, 35.6 TF32, 71 FP16/BF16 w/ FP32 acc, 936 GB/s
    GpuSpec("RTX-3090", _gib(23.69), (8, 6), 35.6, 35.6, 71.0, 71.0, 936.0,
            "23.69 GiB: unverified (23.68-23.70 GiB commonly reported)"),
    # Ada whitepaper, RTX 4090: 82.6 FP32, 82.6 TF32, 165.2 FP16/BF16 w/ FP32 acc, 1008 GB/s
    GpuSpec("RTX-4090", _gib(23.65), (8, 9), 82.6, 82.6, 165.2, 165.2, 1008.0,
            "23.65 GiB total capacity: MotrixLab/AiOS#29, TRI-ML/packnet-sfm#250; "
            "23.64 GiB: ali-vilab/VGen#104"),
    # "NVIDIA A10 Tensor Core GPU" datasheet: 31.2 FP32, 62.5 TF32, 125 FP16/BF16, 600 GB/s
    GpuSpec("A10", _gib(22.06), (8, 6), 31.2, 62.5, 125.0, 125.0, 600.0,
            "22.06 GiB: unverified (nvidia-smi 22731 MiB class)"),
    # AWS g5 A10G: GA102 with GeForce-class tensor rates (approx. 35 TF32, 70 FP16), 600 GB/s
    GpuSpec("A10G", _gib(21.99), (8, 6), 31.2, 35.0, 70.0, 70.0, 600.0,
            "21.99 GiB: unverified (AWS g5 recollection)", ("tensor rates approximate",)),
    # "NVIDIA L4 Tensor Core GPU" datasheet: 30.3 FP32, 60 TF32, 121 FP16/BF16 (dense), 300 GB/s
    GpuSpec("L4", _gib(22.17), (8, 9), 30.3, 60.0, 121.0, 121.0, 300.0,
            "22.17 GiB: unverified (Colab L4 recollection)"),
    # "NVIDIA A100 Tensor Core GPU" datasheet: 19.5 FP32, 156 TF32, 312 FP16/BF16, 1555 / 2039 GB/s
    GpuSpec("A100-40GB", _gib(39.50), (8, 0), 19.5, 156.0, 312.0, 312.0, 1555.0,
            "39.50 GiB total capacity: TianheWu/CoSeR#10 (39.39-39.59 GiB by board and driver)"),
    GpuSpec("A100-80GB", _gib(79.14), (8, 0), 19.5, 156.0, 312.0, 312.0, 2039.0,
            "79.14 GiB total capacity: lianqi1008/Control-GIC#6"),
    # "NVIDIA H100 Tensor Core GPU" datasheet, SXM: 67 FP32, 494.5 TF32, 989.5 FP16/BF16, 3350 GB/s
    GpuSpec("H100-80GB", _gib(79.11), (9, 0), 67.0, 494.5, 989.5, 989.5, 3350.0,
            "79.11 GiB total capacity: vllm-project/vllm#27508"),
    # "NVIDIA H200 Tensor Core GPU" datasheet, SXM: H100 compute, 141 GB HBM3e, 4800 GB/s
    GpuSpec("H200", _gib(139.81), (9, 0), 67.0, 494.5, 989.5, 989.5, 4800.0,
            "139.81 GiB: unverified (nvidia-smi 143771 MiB class)"),
)

CATALOG: dict[str, GpuSpec] = {g.name.lower(): g for g in _SPECS}

_ALIASES = {
    "v100": "v100-16gb", "v100-16g": "v100-16gb", "v100-32g": "v100-32gb", "tesla-t4": "t4",
    "p100": "p100-16gb", "2080ti": "rtx-2080ti", "rtx2080ti": "rtx-2080ti", "3090": "rtx-3090",
    "rtx3090": "rtx-3090", "4090": "rtx-4090", "rtx4090": "rtx-4090", "a100": "a100-80gb",
    "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "h100": "h100-80gb", "h100-80g": "h100-80gb",
    "h200-141gb": "h200",
}

# torch.cuda.get_device_name() patterns -> catalog names (checked in order)
_DEVICE_PATTERNS = (
    (r"H200", "H200"), (r"H100", "H100-80GB"), (r"A100.*80", "A100-80GB"), (r"A100", "A100-40GB"),
    (r"A10G", "A10G"), (r"\bA10\b", "A10"), (r"\bL4\b", "L4"), (r"4090", "RTX-4090"),
    (r"3090", "RTX-3090"), (r"2080 Ti", "RTX-2080Ti"), (r"T4", "T4"), (r"P100", "P100-16GB"),
    (r"V100.*32", "V100-32GB"), (r"V100", "V100-16GB"),
)


def catalog_names() -> list[str]:
    return [g.name for g in _SPECS]


def _generic(total_bytes: int, label: str, cc: tuple[int, int] = (8, 0), note: str = "") -> GpuSpec:
    base = CATALOG["a100-40gb"]
    return GpuSpec(
        f"generic-{label}", total_bytes, cc, base.fp32_tflops, base.tf32_tflops, base.fp16_tflops,
        base.bf16_tflops, base.memory_bandwidth_gbps, "given by the user",
        (note or f"generic GPU of {format_bytes(total_bytes)}: compute capability {cc[0]}.{cc[1]} "
         "and A100-40GB rates assumed",),
    )


def _detect() -> GpuSpec:
    try:
        import torch
        available = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        available = False
    if not available:
        raise MemfitError(
            "`auto` found no CUDA GPU on this machine; name one with --gpu, e.g. "
            f"{', '.join(catalog_names())}, or give its memory such as `24GiB`"
        )
    props = torch.cuda.get_device_properties(0)  # pragma: no cover - needs a GPU
    for pattern, name in _DEVICE_PATTERNS:  # pragma: no cover
        if re.search(pattern, props.name):
            spec = CATALOG[name.lower()]
            return GpuSpec(spec.name, int(props.total_memory), (props.major, props.minor), spec.fp32_tflops,
                           spec.tf32_tflops, spec.fp16_tflops, spec.bf16_tflops, spec.memory_bandwidth_gbps,
                           f"detected: {props.name}")
    return _generic(int(props.total_memory), props.name.replace(" ", "-"),  # pragma: no cover
                    (props.major, props.minor), f"detected {props.name}; rates unknown, A100-40GB assumed")


def as_gpu_spec(gpu: Any, *, required: bool = False) -> GpuSpec | None:
    """A GpuSpec from a catalog name, a size string, `auto` or a GpuSpec; a clear error for anything else.

    None stays None unless `required` (the planner needs a GPU to plan for).
    """
    if isinstance(gpu, GpuSpec):
        return gpu
    if isinstance(gpu, str):
        return resolve_gpu(gpu)
    if gpu is None and not required:
        return None
    raise MemfitError(f"gpu `{gpu!r}` is not a GPU; pass a catalog name such as 'V100-16GB', a size such as "
                      "'24GiB', or 'auto'")


def resolve_gpu(text: str | None) -> GpuSpec:
    """A catalog name or alias (`v100`, `A100-80GB`, `h100`, `T4`), a size (`12GiB`, `16GB`), or `auto`."""
    if text is None or text.strip().lower() == "auto":
        return _detect()
    key = text.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    try:
        size = parse_size(text, what="GPU memory")
    except MemfitError:
        raise MemfitError(
            f"GPU `{text}` is not in the catalog; use one of {', '.join(catalog_names())}, "
            "`auto`, or a memory size such as `24GiB`"
        ) from None
    if size < 256 * MiB:
        raise MemfitError(f"GPU memory `{text}` is too small to train on; give a size such as `16GiB`")
    return _generic(size, text.strip().replace(" ", ""))
