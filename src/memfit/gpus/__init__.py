"""GPUs: the catalog of cards (catalog) and the memory a process holds outside PyTorch (outside_pytorch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.gpus.catalog import GpuSpec, CATALOG, resolve_gpu, as_gpu_spec, catalog_names
    from memfit.gpus.outside_pytorch import NonPytorchEstimate, non_pytorch_bytes, measure_non_pytorch_bytes, cublas_workspace_bytes, gpu_processes

__all__ = ["GpuSpec", "CATALOG", "resolve_gpu", "as_gpu_spec", "catalog_names", "NonPytorchEstimate", "non_pytorch_bytes", "measure_non_pytorch_bytes", "cublas_workspace_bytes", "gpu_processes"]

_LAZY = {"GpuSpec": "catalog", "CATALOG": "catalog", "resolve_gpu": "catalog", "as_gpu_spec": "catalog", "catalog_names": "catalog", "NonPytorchEstimate": "outside_pytorch", "non_pytorch_bytes": "outside_pytorch", "measure_non_pytorch_bytes": "outside_pytorch", "cublas_workspace_bytes": "outside_pytorch", "gpu_processes": "outside_pytorch"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.gpus.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
