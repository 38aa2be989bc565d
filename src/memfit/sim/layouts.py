"""Fake outputs laid out as the CUDA kernel lays them out, where torch's meta kernel lays them out otherwise.

A FakeTensor's strides come from the op's meta kernel. Most meta kernels allocate what the device kernel
allocates; a few are Python decompositions whose elementwise arithmetic keeps the strides of an input the
device kernel ignores. Where a later op copies a non-contiguous tensor (a `view` that must become a `reshape`,
a `.contiguous()`), a wrong stride is a wrong allocation: the fake run would allocate a copy the GPU does not.

`native_layer_norm_backward`: CUDA (aten/src/ATen/native/cuda/layer_norm_kernel.cu `layer_norm_backward_cuda`)
and CPU (aten/src/ATen/native/layer_norm.cpp `layer_norm_backward_cpu`) allocate the input's gradient as
`at::native::empty_like(*X, ..., LEGACY_CONTIGUOUS_MEMORY_FORMAT)` of the contiguous input: always
contiguous. The meta kernel is torch/_decomp/decompositions.py `native_layer_norm_backward`, whose
`(rstd / N) * inner` keeps the strides of `grad_out`: a transposed gradient (Gemma 3's projector transposes the
SigLIP tower's output, so the tower's `post_layernorm` gets a transposed gradient) gives a transposed input
gradient, and the next `view` in the tower's backward (the fc2 Linear's `ViewBackward0`) copies it.

`CudaLayouts` is a dispatch mode entered just above the fake mode (below the StorageTracker, which records
only the re-laid output): for each op of `CONTIGUOUS_OUTPUTS` it replaces a non-contiguous output by a
contiguous FakeTensor of the same shape and dtype. A real run needs nothing: its CPU kernels lay out their
outputs as CUDA's do (tests/sim/test_layouts.py checks both).
"""

from __future__ import annotations

import torch

from memfit.sim import _torch_adapter as adapter

__all__ = ["CONTIGUOUS_OUTPUTS", "CudaLayouts"]

#: op -> the positions of its outputs the device kernel always allocates contiguous (sources in the docstring).
CONTIGUOUS_OUTPUTS = {
    torch.ops.aten.native_layer_norm_backward.default: (0,),
}


class CudaLayouts(adapter.TorchDispatchMode):
    """Enter it right above the FakeTensorMode (before the StorageTracker): see the module docstring."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        positions = CONTIGUOUS_OUTPUTS.get(func)
        if positions is None:
            return out
        out = list(out)
        for i in positions:
            t = out[i]
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                out[i] = torch.empty_like(t, memory_format=torch.contiguous_format)  # below this mode: fake
        return tuple(out)
