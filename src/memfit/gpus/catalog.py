"""GPU catalog: memory as PyTorch sees it, compute capability, peak rates, bandwidth.

`total_bytes` is `torch.cuda.get_device_properties(i).total_memory` (cudaDeviceProp
`totalGlobalMem`), the "total capacity" in PyTorch's OOM message. It is below the
marketing size (ECC, driver-reserved memory) and varies by a few hundred MiB with
driver version, ECC mode and OS (Windows/WDDM prints the round marketing size, e.g.
`12.00 GiB` for an RTX 3060 that Linux reports as `11.76 GiB`); values below are taken
from OOM messages quoted in GitHub issues (cited per entry) and rebuilt as bytes from the
two-decimal GiB figure (accurate to ~5 MiB), except where the exact byte count is known.

Peak rates are dense (no 2:4 sparsity) tensor-core rates from NVIDIA / AMD datasheets and
architecture whitepapers (fp16/bf16 with FP32 accumulate, as PyTorch matmuls use:
GeForce cards run FP32 accumulate at half their FP16-accumulate rate); `None` where the
precision has no hardware support (e.g. bf16 before Ampere, where PyTorch emulates it;
TF32 on CDNA2). Datasheets quote sparse figures with an asterisk; dense is half of those.

Names: one table (`_NAME_TABLE`) maps what users type (`a100-80gb`, `rtx 4090`, `4090`) and
what `torch.cuda.get_device_name()` / `nvidia-smi` print (`NVIDIA A100-SXM4-80GB`,
`Tesla V100-SXM2-16GB`, `AMD Instinct MI300X`) to catalog entries; `resolve_gpu` and the
`auto` detection (`spec_from_device`) both use it. A name that fits several entries
(`a100`, `v100`, `h100`, `rtx 3080`) is an error listing the choices, never a silent pick;
detection settles it from the device's own memory and SM count.

AMD (ROCm): torch reports the gfx architecture as major/minor compute capability
(gfx90a -> (9, 0), gfx942 -> (9, 4); hipDeviceProp_t major/minor). memfit's SDPA and
kernel-selection rules are CUDA's (sdp_utils.cpp); on ROCm they are only an approximation,
and `vendor` says which rules a caller is applying. MI250/MI250X are two GCDs per board
and PyTorch sees each GCD as one device of 64 GB: their entries are per GCD.

Known limitations:

* Memory sizes marked "unverified" in `total_bytes_source` are estimates (derived as the
  source says) that were not confirmed from a PyTorch message.
* SXM vs PCIe variants of V100/A100 share an entry (SXM clocks and bandwidth); H100 has
  separate SXM (`H100-80GB`), PCIe and NVL entries because their rates differ by 30-50 %.
* MIG slices, laptop GPUs and multi-GPU boards are not in the catalog; pass a size (`12GiB`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any

from memfit.errors import MemfitError
from memfit.units import GiB, MiB, format_bytes, format_size_torch, parse_size

__all__ = ["GpuSpec", "CATALOG", "resolve_gpu", "as_gpu_spec", "catalog_names", "spec_from_device",
           "FALLBACK_SM_COUNT"]


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
    vendor: str = "nvidia"  #: "nvidia" (CUDA) or "amd" (ROCm/HIP)
    sm_count: int | None = None  #: SMs (NVIDIA) or compute units (AMD), as props.multi_processor_count
    #: memfit.testing.memory_budget's GPU: a budget on the CPU's tensors, where no cuBLAS workspace is allocated
    emulated: bool = False

    @property
    def supports_bf16(self) -> bool:
        """Native bf16 (tensor cores, `torch.cuda.is_bf16_supported()`) from sm_80 on (and CDNA2+)."""
        return self.compute_capability >= (8, 0)


def _gib(printed: float) -> int:
    """Bytes for a `format_size` figure such as 14.75 (GiB), aligned to 1 MiB."""
    return round(printed * GiB / MiB) * MiB


#: SMs assumed wherever the GPU is unknown (a size such as `24GiB`, a generic detected device, a setup
#: with a compute capability but no GPU): the A100's 108 ("NVIDIA A100 Tensor Core GPU Architecture"
#: whitepaper: 108 of the GA100's 128 SMs enabled), the GPU whose rates `_generic` assumes too.
FALLBACK_SM_COUNT = 108

_ROCM_NOTE = ("ROCm: torch reports the gfx arch as compute capability; memfit's SDPA/kernel rules are "
              "CUDA's and only approximate on AMD GPUs")

_SPECS = (
    # V100: datasheet "NVIDIA Tesla V100 GPU Accelerator" (SXM2: 15.7 FP32, 125 tensor, 900 GB/s)
    GpuSpec("V100-16GB", 16945512448, (7, 0), 15.7, None, 125.0, None, 900.0,
            "15.78 GiB total capacity (PyTorch OOM messages on V100-SXM2-16GB; exact bytes)", sm_count=80),
    GpuSpec("V100-32GB", _gib(31.74), (7, 0), 15.7, None, 125.0, None, 900.0,
            "31.74 GiB total capacity: haotian-liu/LLaVA#812", sm_count=80),
    # T4: "NVIDIA T4 Tensor Core GPU" datasheet: 8.1 FP32, 65 FP16 tensor, 320 GB/s
    GpuSpec("T4", _gib(14.75), (7, 5), 8.1, None, 65.0, None, 320.0,
            "14.75 GiB total capacity: hpcaitech/Open-Sora#697 (Colab); newer drivers show "
            "14.56-14.58 GiB (Zheng-Chong/CatVTON#133, QwenLM/Qwen3-VL#1046)", sm_count=40),
    # P100 PCIe 16GB datasheet: 9.3 FP32, 18.7 FP16 (no tensor cores), 732 GB/s
    GpuSpec("P100-16GB", _gib(15.90), (6, 0), 9.3, None, 18.7, None, 732.0,
            "15.90 GiB: unverified (Kaggle P100 recollection)", sm_count=56),
    # Turing whitepaper, RTX 2080 Ti reference: 13.4 FP32, 53.8 FP16 tensor w/ FP32 acc, 616 GB/s
    GpuSpec("RTX-2080Ti", _gib(10.76), (7, 5), 13.4, None, 53.8, None, 616.0,
            "10.76 GiB total capacity: RenYurui/StructureFlow#35", sm_count=68),
    # GA102 (Ampere) whitepaper, RTX 3090: 35.6 FP32, 35.6 TF32, 71 FP16/BF16 w/ FP32 acc, 936 GB/s
    GpuSpec("RTX-3090", _gib(23.69), (8, 6), 35.6, 35.6, 71.0, 71.0, 936.0,
            "23.69 GiB: unverified (23.68-23.70 GiB commonly reported)", sm_count=82),
    # Ada whitepaper, RTX 4090: 82.6 FP32, 82.6 TF32, 165.2 FP16/BF16 w/ FP32 acc, 1008 GB/s
    GpuSpec("RTX-4090", _gib(23.65), (8, 9), 82.6, 82.6, 165.2, 165.2, 1008.0,
            "23.65 GiB total capacity: MotrixLab/AiOS#29, TRI-ML/packnet-sfm#250; "
            "23.64 GiB: ali-vilab/VGen#104", sm_count=128),
    # "NVIDIA A10 Tensor Core GPU" datasheet: 31.2 FP32, 62.5 TF32, 125 FP16/BF16, 600 GB/s
    GpuSpec("A10", _gib(22.06), (8, 6), 31.2, 62.5, 125.0, 125.0, 600.0,
            "22.06 GiB: unverified (nvidia-smi 22731 MiB class)", sm_count=72),
    # AWS g5 A10G: GA102 with GeForce-class tensor rates (approx. 35 TF32, 70 FP16), 600 GB/s
    GpuSpec("A10G", _gib(21.99), (8, 6), 31.2, 35.0, 70.0, 70.0, 600.0,
            "21.99 GiB: unverified (AWS g5 recollection)", ("tensor rates approximate",), sm_count=80),
    # "NVIDIA L4 Tensor Core GPU" datasheet: 30.3 FP32, 60 TF32, 121 FP16/BF16 (dense), 300 GB/s
    GpuSpec("L4", _gib(22.17), (8, 9), 30.3, 60.0, 121.0, 121.0, 300.0,
            "22.17 GiB: unverified (Colab L4 recollection)", sm_count=58),
    # "NVIDIA A100 Tensor Core GPU" datasheet: 19.5 FP32, 156 TF32, 312 FP16/BF16, 1555 / 2039 GB/s
    GpuSpec("A100-40GB", _gib(39.50), (8, 0), 19.5, 156.0, 312.0, 312.0, 1555.0,
            "39.50 GiB total capacity: TianheWu/CoSeR#10 (39.39-39.59 GiB by board and driver)", sm_count=108),
    GpuSpec("A100-80GB", _gib(79.14), (8, 0), 19.5, 156.0, 312.0, 312.0, 2039.0,
            "79.14 GiB total capacity: lianqi1008/Control-GIC#6", sm_count=108),
    # "NVIDIA H100 Tensor Core GPU" datasheet, SXM: 67 FP32, 494.5 TF32, 989.5 FP16/BF16, 3350 GB/s
    GpuSpec("H100-80GB", _gib(79.11), (9, 0), 67.0, 494.5, 989.5, 989.5, 3350.0,
            "79.11 GiB total capacity: vllm-project/vllm#27508", ("H100 SXM5 (nvidia-smi `NVIDIA H100 80GB HBM3`)",),
            sm_count=132),
    # Same datasheet, H100 PCIe column: 51 FP32, 756* TF32, 1513* FP16/BF16 (*sparse: dense is half), 2 TB/s
    GpuSpec("H100-PCIe", _gib(79.11), (9, 0), 51.0, 378.0, 756.5, 756.5, 2000.0,
            "79.11 GiB: unverified (nvidia-smi shows 81559 MiB for the H100 PCIe, the same as the SXM "
            "H100 whose 81559 MiB prints as 79.11 GiB in vllm-project/vllm#27508)", sm_count=114),
    # Same datasheet, H100 NVL column (per GPU): 60 FP32, 835* TF32, 1671* FP16/BF16, 3.9 TB/s, 94 GB
    GpuSpec("H100-NVL", _gib(93.00), (9, 0), 60.0, 417.5, 835.5, 835.5, 3900.0,
            "93.00 GiB total capacity: ali-vilab/VACE#56 (RunPod H100 NVL 94GB)", sm_count=132),
    # "NVIDIA H200 Tensor Core GPU" datasheet, SXM: H100 compute, 141 GB HBM3e, 4800 GB/s
    GpuSpec("H200", _gib(139.81), (9, 0), 67.0, 494.5, 989.5, 989.5, 4800.0,
            "139.81 GiB: unverified (nvidia-smi 143771 MiB class)", sm_count=132),
    # H20 (Hopper, China export part): no public NVIDIA datasheet; NVIDIA's product brief figures as
    # reported: 44 FP32, 74 TF32, 148 FP16/BF16 (dense), 96 GB HBM3 at 4.0 TB/s; 78 SMs (Geekbench listing)
    GpuSpec("H20", _gib(95.00), (9, 0), 44.0, 74.0, 148.0, 148.0, 4000.0,
            "95.00 GiB total capacity: modelscope/DiffSynth-Studio#1238 (H20 96G)",
            ("rates from NVIDIA's H20 product brief as reported; no public datasheet",), sm_count=78),
    # "NVIDIA HGX B200" spec table, individual GPU: 75 FP32, 2.2 PF* TF32, 4.5 PF* FP16/BF16, 180 GB, 7.7 TB/s
    GpuSpec("B200", _gib(178.35), (10, 0), 75.0, 1100.0, 2250.0, 2250.0, 7700.0,
            "178.35 GiB total capacity: stas00/ml-engineering debug/pytorch.md (B200 OOM transcript)",
            sm_count=148),
    # "NVIDIA L40 GPU" datasheet: 90.5 FP32, 90.5 TF32 (181*), 181.05 FP16/BF16 (362.1*), 864 GB/s
    GpuSpec("L40", _gib(44.40), (8, 9), 90.5, 90.5, 181.05, 181.05, 864.0,
            "44.40 GiB total capacity: QwenLM/Qwen3-VL#2097 (single L40)", sm_count=142),
    # "NVIDIA L40S GPU" datasheet: 91.6 FP32, 183 TF32 (366*), 362.05 FP16/BF16 (733*), 864 GB/s
    GpuSpec("L40S", _gib(44.42), (8, 9), 91.6, 183.0, 362.05, 362.05, 864.0,
            "44.42 GiB total capacity: stepfun-ai/Step-Video-T2V#8 (8x L40S); "
            "44.53 GiB: Wan-Video/Wan2.1#205", sm_count=142),
    # "NVIDIA RTX A6000" datasheet: 38.7 FP32, 309.7* tensor (FP16 sparse -> 154.8 dense, full-rate FP32
    # accumulate on this professional GA102, cf. the GA102 whitepaper appendix), 77.4 TF32, 768 GB/s
    GpuSpec("RTX-A6000", _gib(47.54), (8, 6), 38.7, 77.4, 154.8, 154.8, 768.0,
            "47.54 GiB total capacity: vllm-project/vllm#1201 (nvidia-smi `NVIDIA RTX A6000` 49140MiB, ECC off)",
            ("with ECC enabled the card reports about 3 GiB less; pass the size if so",), sm_count=84),
    # "NVIDIA RTX 6000 Ada Generation" datasheet: 91.1 FP32, 1457.0* tensor (FP8 sparse; FP16/BF16 dense
    # with FP32 accumulate = 1457.0 / 4 = 364.2, TF32 182.1), 960 GB/s
    GpuSpec("RTX-6000-Ada", _gib(44.43), (8, 9), 91.1, 182.1, 364.2, 364.2, 960.0,
            "44.43 GiB total capacity: DINGYANB/MTVCrafter#21 (nvidia-smi `NVIDIA RTX 6000 Ada Gene...` 46068MiB, "
            "ECC on)", ("with ECC off the card reports about 3 GiB more; pass the size if so",), sm_count=142),
    # RTX 3060 (GA106) spec page: 3584 cores at 1.777 GHz -> 12.7 FP32; 15 Gbps x 192-bit = 360 GB/s.
    # Tensor rates derived per GA10x GeForce SM (GA102 whitepaper: the RTX 3090's 71 FP16 w/ FP32 acc =
    # 82 SMs x 1.695 GHz x 512 FLOP/clk): 28 SMs x 1.777 GHz x 512 = 25.5, TF32 half of that.
    GpuSpec("RTX-3060", _gib(11.76), (8, 6), 12.7, 12.7, 25.5, 25.5, 360.0,
            "11.76 GiB total capacity: TencentARC/PhotoMaker#47 (RTX 3060 12GB, Linux); Windows prints "
            "12.00 GiB (ToTheBeginning/PuLID#13)",
            ("the 12 GB RTX 3060; an 8 GB RTX 3060 (2022, 128-bit, 240 GB/s) exists: for it pass `--gpu 8GiB` "
             "or `auto`",), sm_count=28),
    # GA102 whitepaper, RTX 3080 (10 GB): 29.8 FP32, 29.8 TF32, 59.5 FP16/BF16 w/ FP32 acc, 760 GB/s
    GpuSpec("RTX-3080-10GB", _gib(9.78), (8, 6), 29.8, 29.8, 59.5, 59.5, 760.0,
            "9.78 GiB total capacity: zai-org/CogVideo#34 (Linux); Windows prints 10.00 GiB "
            "(victordibia/peacasso#3)", sm_count=68),
    # RTX 3080 12 GB spec page: 8960 cores (70 SMs) at 1.71 GHz -> 30.6 FP32; 19 Gbps x 384-bit = 912 GB/s;
    # tensor rates derived as for the 10 GB card (70 x 1.71 GHz x 512 = 61.3 FP16 w/ FP32 acc)
    GpuSpec("RTX-3080-12GB", _gib(11.76), (8, 6), 30.6, 30.6, 61.3, 61.3, 912.0,
            "11.76 GiB: unverified (assumed equal to the 12 GB RTX 3060's 11.76 GiB, TencentARC/PhotoMaker#47)",
            sm_count=70),
    # Ada whitepaper, RTX 4080 (16 GB): 48.7 FP32, 48.7 TF32, 97.5 FP16/BF16 w/ FP32 acc, 716.8 GB/s
    GpuSpec("RTX-4080", _gib(15.99), (8, 9), 48.7, 48.7, 97.5, 97.5, 716.8,
            "15.99 GiB total capacity: aigc-apps/sd-webui-EasyPhoto#281 (a Windows figure; Linux reports "
            "less, about 15.7 GiB, unverified)", sm_count=76),
    # Blackwell RTX (GB202) whitepaper, RTX 5090: 104.8 FP32, 104.8 TF32, 209.5 FP16/BF16 w/ FP32 acc,
    # 1792 GB/s, 170 SMs, compute capability 12.0
    GpuSpec("RTX-5090", _gib(31.36), (12, 0), 104.8, 104.8, 209.5, 209.5, 1792.0,
            "31.36 GiB total capacity: TrajectoryCrafter/TrajectoryCrafter#20; 31.37 GiB: Wan-Video/Wan2.1#465",
            sm_count=170),
    # "NVIDIA A40" datasheet: 37.4 FP32, 74.8 TF32 (149.6*), 149.7 FP16/BF16 (299.4*), 48 GB GDDR6 with ECC,
    # 696 GB/s; GA102 with 10752 CUDA cores = 84 SMs
    GpuSpec("A40", _gib(44.43), (8, 6), 37.4, 74.8, 149.7, 149.7, 696.0,
            "44.43 GiB: unverified (the A40 runs with ECC on: 46068 MiB in nvidia-smi, as the ECC-on RTX 6000 "
            "Ada that prints 44.43 GiB in DINGYANB/MTVCrafter#21)",
            ("with ECC off the card reports about 3 GiB more; pass the size if so",), sm_count=84),
    # "NVIDIA A800 Tensor Core GPU" datasheet (80GB SXM): the A100's rates (19.5 FP32, 156 TF32, 312 FP16/BF16),
    # 80 GB HBM2e at 2039 GB/s; NVLink cut to 400 GB/s (China export part)
    GpuSpec("A800-80GB", _gib(79.14), (8, 0), 19.5, 156.0, 312.0, 312.0, 2039.0,
            "79.14 GiB: unverified (the same 80 GB HBM2e as the A100-80GB, lianqi1008/Control-GIC#6)",
            ("NVLink 400 GB/s (the A100's is 600 GB/s)",), sm_count=108),
    # "NVIDIA H800 Tensor Core GPU" datasheet (SXM): the H100 SXM's 67 FP32, 989* TF32, 1979* FP16/BF16 (*sparse:
    # dense is half), 80 GB HBM3 at 3.35 TB/s; FP64 and NVLink (400 GB/s) cut (China export part); 132 SMs
    GpuSpec("H800", _gib(79.11), (9, 0), 67.0, 494.5, 989.5, 989.5, 3350.0,
            "79.11 GiB: unverified (nvidia-smi 81559 MiB, as the H100 SXM that prints 79.11 GiB in "
            "vllm-project/vllm#27508)", ("H800 SXM (nvidia-smi `NVIDIA H800`); NVLink 400 GB/s",), sm_count=132),
    # "NVIDIA GH200 Grace Hopper Superchip" datasheet: H100 GPU (132 SMs) at 67 FP32, 494 TF32, 990 FP16/BF16,
    # 96 GB HBM3 at 4 TB/s (a 144 GB HBM3e, 4.9 TB/s version exists)
    GpuSpec("GH200", _gib(94.88), (9, 0), 67.0, 494.5, 989.5, 989.5, 4000.0,
            "94.88 GiB total capacity: Lightning-AI/litgpt#1892 (nvidia-smi 97871 MiB)",
            ("the 96 GB HBM3 GH200 (nvidia-smi `NVIDIA GH200 480GB`); the Grace CPU's LPDDR5X is not GPU memory "
             "to PyTorch's allocator; for the 144 GB HBM3e version pass its size",), sm_count=132),
    # "NVIDIA GB200 NVL72" spec table / 72 GPUs: 5760 / 72 = 80 FP32, 180 PF* TF32 -> 1250 dense, 360 PF* FP16/BF16
    # -> 2500 dense, 13.4 TB HBM3e -> 186 GB per GPU at 8 TB/s; compute capability 10.0 (sgl-project/sglang#11208)
    GpuSpec("GB200", _gib(184.30), (10, 0), 80.0, 1250.0, 2500.0, 2500.0, 8000.0,
            "184.30 GiB: unverified (the B200's 180 GB prints as 178.35 GiB; scaled to the GB200's 186 GB)",
            ("one Blackwell GPU of a GB200 superchip (nvidia-smi `NVIDIA GB200`); SM count assumed the B200's 148",),
            sm_count=148),
    # L20 (Ada AD102, China export part): no public NVIDIA datasheet; product brief figures as reported: 59.8 FP32,
    # 59.8 TF32 (119.5*), 119.5 FP16/BF16 (239*), 48 GB GDDR6 with ECC at 864 GB/s, 92 SMs
    GpuSpec("L20", _gib(44.42), (8, 9), 59.8, 59.8, 119.5, 119.5, 864.0,
            "44.42 GiB: unverified (the same 48 GB GDDR6 with ECC as the L40S, stepfun-ai/Step-Video-T2V#8)",
            ("rates from NVIDIA's L20 product brief as reported; no public datasheet",), sm_count=92),
    # "NVIDIA RTX PRO 6000 Blackwell" datasheet / RTX Blackwell whitepaper (Workstation Edition): GB202 with 188 SMs,
    # 125 FP32, 4000 AI TOPS (FP4, sparse) -> FP16/BF16 dense with FP32 accumulate 500, TF32 250; 96 GB GDDR7
    # (ECC) at 1792 GB/s; compute capability 12.0. The RTX Blackwell whitepaper's table of 188 SMs is quoted in
    # NVIDIA/cudnn-frontend#1164.
    GpuSpec("RTX-PRO-6000", _gib(94.97), (12, 0), 125.0, 250.0, 500.0, 500.0, 1792.0,
            "94.97 GiB: CUDA's total of the 97887 MiB card in antirez/ds4#431 (Linux); WSL2 prints 95.59 GiB "
            "(pytorch/pytorch#182286)",
            ("RTX PRO 6000 Blackwell Workstation / Server Edition (the 300 W Max-Q edition runs lower clocks)",),
            sm_count=188),
    # RTX 4060 Ti (AD106) spec page: 4352 cores (34 SMs) at 2.535 GHz -> 22.1 FP32; 18 Gbps x 128-bit = 288 GB/s.
    # Tensor rates derived per Ada GeForce SM (Ada whitepaper: the RTX 4090's 165.2 FP16 w/ FP32 acc =
    # 128 SMs x 2.52 GHz x 512 FLOP/clk): 34 x 2.535 GHz x 512 = 44.1, TF32 half of that.
    GpuSpec("RTX-4060Ti-8GB", _gib(7.80), (8, 9), 22.1, 22.1, 44.1, 44.1, 288.0,
            "7.80 GiB: unverified (an 8192 MiB card prints 7.80 GiB on Linux: CompVis/stable-diffusion#485, "
            "Quadro RTX 4000); Windows prints 8.00 GiB", sm_count=34),
    GpuSpec("RTX-4060Ti-16GB", _gib(15.70), (8, 9), 22.1, 22.1, 44.1, 44.1, 288.0,
            "15.70 GiB: unverified (Linux figure of a 16 GB GeForce card, as for the RTX-4080); Windows prints "
            "16.00 GiB", sm_count=34),
    # RTX 4070 (AD104) spec page: 5888 cores (46 SMs) at 2.475 GHz -> 29.1 FP32; 21 Gbps x 192-bit = 504 GB/s;
    # tensor rates derived as for the RTX 4060 Ti (46 x 2.475 GHz x 512 = 58.3 FP16 w/ FP32 acc)
    GpuSpec("RTX-4070", _gib(11.76), (8, 9), 29.1, 29.1, 58.3, 58.3, 504.0,
            "11.76 GiB: unverified (assumed equal to the 12 GB RTX 3060's 11.76 GiB, TencentARC/PhotoMaker#47)",
            sm_count=46),
    # "AMD Instinct MI250X" datasheet (per OAM, two GCDs): 47.9 FP32 vector, 95.7 FP32 matrix, 383 FP16/BF16,
    # 3.2768 TB/s. Per GCD (what PyTorch sees): half. fp32 = the matrix rate (rocBLAS fp32 GEMMs use MFMA);
    # CDNA2 has no TF32. gfx90a -> (9, 0) (hipDeviceProp_t major/minor).
    GpuSpec("MI250X", _gib(63.98), (9, 0), 47.85, None, 191.5, 191.5, 1638.4,
            "63.98 GiB total capacity: ROCm/ROCm#3579 (4x MI250X = 8 GCD devices)",
            ("per GCD: one MI250X board is two 64 GB devices", _ROCM_NOTE), vendor="amd", sm_count=110),
    # "AMD Instinct MI250" datasheet: 45.3 FP32 vector, 90.5 FP32 matrix, 362.1 FP16/BF16, 3.2768 TB/s; per GCD half
    GpuSpec("MI250", _gib(63.98), (9, 0), 45.25, None, 181.05, 181.05, 1638.4,
            "63.98 GiB: unverified (same 64 GB HBM2e per GCD as the MI250X, ROCm/ROCm#3579)",
            ("per GCD: one MI250 board is two 64 GB devices", _ROCM_NOTE), vendor="amd", sm_count=104),
    # "AMD Instinct MI300X" datasheet: 81.7 FP32 vector, 163.4 FP32 matrix, 653.7 TF32, 1307.4 FP16/BF16 (dense),
    # 192 GB HBM3 at 5.3 TB/s, 304 CUs. gfx942 -> (9, 4), as torch/_inductor/template_heuristics/triton.py
    # tests `capability >= (9, 4)  # gfx942 (MI300X/MI325X)`.
    GpuSpec("MI300X", _gib(191.98), (9, 4), 163.4, 653.7, 1307.4, 1307.4, 5300.0,
            "191.98 GiB total capacity: vllm-project/vllm#7951 (MI300X x8)",
            (_ROCM_NOTE,), vendor="amd", sm_count=304),
)

CATALOG: dict[str, GpuSpec] = {g.name.lower(): g for g in _SPECS}

#: The one name table: compact name (see `_compact`) -> catalog name, or a tuple of names when
#: the name fits several entries. Checked in order with re.fullmatch. It holds what users type
#: and what torch.cuda.get_device_name() / nvidia-smi print (e.g. `Tesla V100-SXM2-16GB`,
#: `NVIDIA A100-SXM4-80GB`, `NVIDIA A100 80GB PCIe`, `NVIDIA H100 80GB HBM3`, `NVIDIA H100 PCIe`,
#: `NVIDIA H100 NVL`, `NVIDIA RTX 6000 Ada Generation`, `AMD Instinct MI250X/MI250`,
#: `AMD Instinct MI300X`, `NVIDIA A800-SXM4-80GB`, `NVIDIA H800`, `NVIDIA GH200 480GB`, `NVIDIA GB200`,
#: `NVIDIA RTX PRO 6000 Blackwell Workstation Edition`, `NVIDIA GeForce RTX 4060 Ti`). Variants with other
#: memory or clocks (RTX 3060 Ti, 4070 Ti, 4080 SUPER, 4090 D, V100S, P100 12GB, H800 PCIe, RTX PRO 6000
#: Max-Q) deliberately do not match.
_NAME_TABLE: tuple[tuple[str, str | tuple[str, ...]], ...] = (
    (r"v100", ("V100-16GB", "V100-32GB")),
    (r"v100(sxm[23]|pcie|fhhl|dgxs)?16gb?", "V100-16GB"),
    (r"v100(sxm[23]|pcie|dgxs)?32gb?", "V100-32GB"),
    (r"t4", "T4"),
    (r"p100((sxm2|pcie)?16gb?)?", "P100-16GB"),
    (r"(rtx)?2080ti", "RTX-2080Ti"),
    (r"(rtx)?3090", "RTX-3090"),
    (r"(rtx)?4090", "RTX-4090"),
    (r"a10", "A10"),
    (r"a10g", "A10G"),
    (r"l4", "L4"),
    (r"a100", ("A100-40GB", "A100-80GB")),
    (r"a100(sxm4?|pcie)?40gb?(pcie|sxm4?)?", "A100-40GB"),
    (r"a100(sxm4?|pcie)?80gb?(pcie|sxm4?)?", "A100-80GB"),
    (r"h100", ("H100-80GB", "H100-PCIe", "H100-NVL")),
    (r"h100(sxm5?(80gb?)?|80gb?(hbm3|sxm5?)?)", "H100-80GB"),
    (r"h100(80gb?)?pcie(80gb?)?", "H100-PCIe"),
    (r"h100(94gb?)?nvl(94gb?)?", "H100-NVL"),
    (r"h200(sxm)?(141gb?)?", "H200"),
    (r"h20(96gb?)?", "H20"),
    (r"b200(180gb?)?", "B200"),
    (r"l40", "L40"),
    (r"l40s", "L40S"),
    (r"(rtx)?a6000", "RTX-A6000"),
    (r"(rtx)?6000ada(generation)?", "RTX-6000-Ada"),
    (r"rtx6000", ("RTX-6000-Ada", "RTX-PRO-6000")),  # also the Turing Quadro RTX 6000 (24 GB)
    (r"(rtx)?pro6000(blackwell)?(workstation|server)?(edition)?(96gb?)?", "RTX-PRO-6000"),
    (r"(rtx)?3060(12gb?)?", "RTX-3060"),
    (r"(rtx)?3080", ("RTX-3080-10GB", "RTX-3080-12GB")),
    (r"(rtx)?308010gb?", "RTX-3080-10GB"),
    (r"(rtx)?308012gb?", "RTX-3080-12GB"),
    (r"(rtx)?4080(16gb?)?", "RTX-4080"),
    (r"(rtx)?5090(32gb?)?", "RTX-5090"),
    (r"a40(48gb?)?", "A40"),
    (r"a800", ("A800-80GB",)),  # also the A800 40GB PCIe
    (r"a800(sxm4?|pcie)?80gb?(pcie|sxm4?)?", "A800-80GB"),
    (r"h800(sxm5?)?(80gb?)?(hbm3)?", "H800"),
    (r"gh200(480gb?)?(96gb?)?(hbm3)?", "GH200"),
    (r"gb200(186gb?)?", "GB200"),
    (r"l20(48gb?)?", "L20"),
    (r"(rtx)?4060ti", ("RTX-4060Ti-8GB", "RTX-4060Ti-16GB")),
    (r"(rtx)?4060ti8gb?", "RTX-4060Ti-8GB"),
    (r"(rtx)?4060ti16gb?", "RTX-4060Ti-16GB"),
    (r"(rtx)?4070(12gb?)?", "RTX-4070"),
    (r"mi250x", "MI250X"),
    (r"mi250", "MI250"),
    (r"mi250xmi250", ("MI250X", "MI250")),  # ROCm names both boards `AMD Instinct MI250X/MI250`
    (r"mi300x(vf|oam)?", "MI300X"),
)

#: What tells choices apart where the catalog name does not say it.
_CHOICE_LABELS = {"H100-80GB": "SXM"}

#: Extra words for an ambiguous name whose other meanings are not in the catalog.
_AMBIGUOUS_HINTS = {
    ("RTX-6000-Ada", "RTX-PRO-6000"): "pass one of them; the Turing Quadro RTX 6000 (24 GB) is not in the catalog: "
                                      "for it pass a size such as `24GiB`",
    ("A800-80GB",): "the A800 40GB PCIe is not in the catalog: for it pass a size such as `39.50GiB`",
}

# Vendor and product-line words that nvidia-smi / torch print but users leave out ("Quadro" is kept:
# `Quadro RTX 6000` is a different card from the RTX 6000 Ada).
_VENDOR_WORDS = re.compile(r"\b(nvidia|geforce|tesla|amd|instinct)\b")
_BARE_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*$")
# Relative tolerance for settling an ambiguous detected name by memory: variants of one
# family differ by >= 17 % (A100 40/80, V100 16/32, RTX 3080 10/12, H100 80/94).
_DETECT_MEMORY_TOLERANCE = 0.03


def catalog_names() -> list[str]:
    return [g.name for g in _SPECS]


def _compact(text: str) -> str:
    """`NVIDIA GeForce RTX 4090` -> `rtx4090`: lower case, vendor words and punctuation dropped."""
    return re.sub(r"[^a-z0-9]", "", _VENDOR_WORDS.sub(" ", text.lower()))


def _lookup(text: str) -> str | tuple[str, ...] | None:
    """The catalog name (or the tuple of candidates) `_NAME_TABLE` gives for a typed or printed name."""
    key = _compact(text)
    for pattern, target in _NAME_TABLE:
        if re.fullmatch(pattern, key):
            return target
    return None


def _kind_outside_catalog(text: str) -> str | None:
    """`laptop` or `MIG slice` for device names the catalog deliberately does not hold."""
    low = text.lower()
    if re.search(r"\b(laptop|mobile)\b", low) or (re.search(r"\bmax-q\b", low) and "workstation" not in low):
        return "laptop GPU"
    if re.search(r"\bmig\b", low):
        return "MIG slice"
    return None


def _ambiguous_error(text: str, choices: tuple[str, ...]) -> MemfitError:
    def describe(name: str) -> str:
        printed = format_size_torch(CATALOG[name.lower()].total_bytes)
        label = _CHOICE_LABELS.get(name)
        return f"{name} ({label}, {printed})" if label else f"{name} ({printed})"

    described = [describe(n) for n in choices]
    listed = described[0] if len(described) == 1 else ", ".join(described[:-1]) + " or " + described[-1]
    hint = _AMBIGUOUS_HINTS.get(choices)
    if hint:
        return MemfitError(f"GPU `{text}` is ambiguous: {listed}; {hint}")
    return MemfitError(f"GPU `{text}` is ambiguous: {listed}; pass one of them (or `auto` on that machine)")


def _generic(total_bytes: int, label: str, cc: tuple[int, int] = (8, 0), note: str = "",
             source: str = "given by the user") -> GpuSpec:
    base = CATALOG["a100-40gb"]
    return GpuSpec(
        f"generic-{label}", total_bytes, cc, base.fp32_tflops, base.tf32_tflops, base.fp16_tflops,
        base.bf16_tflops, base.memory_bandwidth_gbps, source,
        (note or f"generic GPU of {format_bytes(total_bytes)}: compute capability {cc[0]}.{cc[1]} "
         "and A100-40GB rates assumed",),
    )


def spec_from_device(name: str, total_bytes: int, compute_capability: tuple[int, int],
                     sm_count: int | None = None) -> GpuSpec:
    """The GpuSpec of a detected device: its catalog entry with the device's own memory and capability.

    Args:
        name: `torch.cuda.get_device_properties(i).name` (what nvidia-smi prints).
        total_bytes: the device's `total_memory`.
        compute_capability: the device's (major, minor); on ROCm the gfx arch, e.g. (9, 4).
        sm_count: `multi_processor_count`; settles names that fit several entries
            (`NVIDIA H100` SXM vs PCIe, `AMD Instinct MI250X/MI250`).

    A name outside the catalog (or a laptop GPU or MIG slice) gives a generic spec of the
    device's memory and capability with A100-40GB rates, saying so in `notes`.
    """
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    outside = _kind_outside_catalog(name)
    target = None if outside else _lookup(name)
    if isinstance(target, tuple):
        near = [CATALOG[n.lower()] for n in target
                if abs(CATALOG[n.lower()].total_bytes - total_bytes) <= _DETECT_MEMORY_TOLERANCE * total_bytes]
        if len(near) > 1 and sm_count is not None:
            near = [g for g in near if g.sm_count == sm_count] or near
        target = near[0].name if len(near) == 1 else None
    if isinstance(target, str):
        spec = CATALOG[target.lower()]
        return dataclasses.replace(spec, total_bytes=int(total_bytes), compute_capability=cc,
                                   sm_count=sm_count if sm_count is not None else spec.sm_count,
                                   total_bytes_source=f"detected: {name}")
    why = f"a {outside}" if outside else "not in the catalog"
    return _generic(int(total_bytes), name.replace(" ", "-"), cc,
                    f"detected {name} ({why}); rates unknown, A100-40GB assumed", source=f"detected: {name}")


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
    return spec_from_device(props.name, int(props.total_memory), (props.major, props.minor),  # pragma: no cover
                            int(props.multi_processor_count))


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


def _no_unit_error(text: str, number: str) -> MemfitError:
    value = float(number)
    if value >= 256 * MiB:  # a byte count, e.g. 16945512448
        guess = f"`{number}B` ({format_bytes(value)})"
    elif value >= 1024:
        guess = f"`{number}MiB`"
    else:
        guess = f"`{number}GiB`"
    return MemfitError(f"GPU memory `{text.strip()}` has no unit; did you mean {guess}? "
                       "Write the unit: GiB, GB (10**9 bytes), MiB, or B for bytes")


def resolve_gpu(text: str | None) -> GpuSpec:
    """A catalog name or alias (`A100-80GB`, `rtx 4090`, `T4`), a name nvidia-smi prints
    (`NVIDIA A100-SXM4-80GB`), a size (`12GiB`, `16GB`), or `auto` (None too).

    A name that fits several entries (`a100`, `v100`, `h100`) is an error listing them;
    a bare number (`24`) is an error asking for its unit.
    """
    if text is None or text.strip().lower() == "auto":
        return _detect()
    if not text.strip():
        raise MemfitError("GPU `` is empty; pass a catalog name such as `A100-80GB`, a size such as `24GiB`, "
                          "or `auto`")
    if text.strip().lower() in CATALOG:
        return CATALOG[text.strip().lower()]
    outside = _kind_outside_catalog(text)
    if outside:
        raise MemfitError(f"GPU `{text}` is a {outside}, which the catalog does not hold (its memory differs from "
                          "the full card); give its memory such as `--gpu 8GiB`, or `auto` on that machine")
    target = _lookup(text)
    if isinstance(target, tuple):
        raise _ambiguous_error(text, target)
    if target is not None:
        return CATALOG[target.lower()]
    bare = _BARE_NUMBER.match(text)
    if bare:
        raise _no_unit_error(text, bare.group(1))
    try:
        size = parse_size(text, what="GPU memory")
    except MemfitError:
        close = difflib.get_close_matches(_compact(text), [_compact(n) for n in catalog_names()], n=3, cutoff=0.6)
        by_key = {_compact(n): n for n in catalog_names()}
        hint = f" (closest: {', '.join(by_key[c] for c in close)})" if close else ""
        raise MemfitError(
            f"GPU `{text}` is not in the catalog{hint}; use one of {', '.join(catalog_names())}, "
            "`auto`, or a memory size such as `24GiB`"
        ) from None
    if size < 256 * MiB:
        raise MemfitError(f"GPU memory `{text}` is too small to train on; give a size such as `16GiB`")
    return _generic(size, text.strip().replace(" ", ""))
