"""Non-PyTorch memory estimate."""

from memfit.gpus.catalog import resolve_gpu
from memfit.gpus.outside_pytorch import cublas_workspace_bytes, measure_non_pytorch_bytes, non_pytorch_bytes
from memfit.units import KiB, MiB


def test_breakdown_sums_and_scales_with_sms():
    t4 = non_pytorch_bytes(resolve_gpu("T4"), lazy_loading=True)
    h100 = non_pytorch_bytes(resolve_gpu("H100-80GB"), lazy_loading=True)
    assert t4.total_bytes == sum(t4.breakdown.values())
    # stacks: 40 SMs x 1024 threads x 1 KiB = 40 MiB; 132 x 2048 x 1 KiB = 264 MiB
    assert t4.breakdown["thread_stacks"] == 40 * MiB
    assert h100.breakdown["thread_stacks"] == 264 * MiB
    assert 250 * MiB < t4.total_bytes < h100.total_bytes < 800 * MiB
    assert t4.notes


def test_eager_loading_costs_about_a_gigabyte_more():
    v100 = resolve_gpu("V100-16GB")
    eager = non_pytorch_bytes(v100, lazy_loading=False).total_bytes
    lazy = non_pytorch_bytes(v100, lazy_loading=True).total_bytes
    assert eager - lazy > 700 * MiB
    assert 1.1e9 < eager < 1.6e9  # HF guide: 1343 MB in use after the first CUDA tensor


def test_generic_gpu_is_handled():
    est = non_pytorch_bytes(resolve_gpu("24GiB"), lazy_loading=True)
    assert any("assumed 108" in n for n in est.notes)


def test_cublas_workspace_sizes():
    # parseChosenWorkspaceSize: sm_90 -> 4096 KiB x 8, else 4096 KiB x 2 + 16 KiB x 8
    assert cublas_workspace_bytes(resolve_gpu("H100-80GB"), {}) == 32 * MiB
    assert cublas_workspace_bytes(resolve_gpu("A100-80GB"), {}) == 8 * MiB + 128 * KiB
    assert cublas_workspace_bytes(resolve_gpu("A100-80GB"), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes(resolve_gpu("A100-80GB"), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * KiB
    # memfit.fit's emulated GPU is a budget on the CPU's tensors: no cuBLAS, so no workspace in its prediction
    from memfit.fitting.preflight_check import budget_spec

    assert cublas_workspace_bytes(budget_spec(800 * MiB), {}) == 0
    assert cublas_workspace_bytes(budget_spec(800 * MiB), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 0


def test_measure_without_gpu_returns_none():
    assert measure_non_pytorch_bytes() is None


def test_cublas_workspace_follows_torch_for_new_architectures():
    # CublasHandlePool.cpp parseChosenWorkspaceSize: 32 MiB for major 9/10/11/12; ROCm 32 MiB, 128 MiB on gfx942
    assert cublas_workspace_bytes(resolve_gpu("B200"), {}) == 32 * MiB
    assert cublas_workspace_bytes(resolve_gpu("RTX-5090"), {}) == 32 * MiB
    assert cublas_workspace_bytes(resolve_gpu("L40S"), {}) == 8 * MiB + 128 * KiB
    assert cublas_workspace_bytes(resolve_gpu("MI300X"), {}) == 128 * MiB
    assert cublas_workspace_bytes(resolve_gpu("MI250X"), {}) == 32 * MiB
    assert cublas_workspace_bytes(resolve_gpu("MI250X"), {"HIPBLAS_WORKSPACE_CONFIG": ":1024:2"}) == 2 * MiB


def test_thread_stacks_use_the_catalog_sm_count():
    est = non_pytorch_bytes(resolve_gpu("RTX-5090"), lazy_loading=True)
    assert est.breakdown["thread_stacks"] == 170 * 1536 * KiB
    assert not any("unknown" in n for n in est.notes)
