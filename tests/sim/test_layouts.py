"""memfit.sim.layouts: a fake op's output laid out as the device kernel lays it out.

The reference is the real CPU kernel, run here on the same inputs: `layer_norm_backward_cpu` allocates the input
gradient as CUDA's `layer_norm_backward_cuda` does (contiguous, whatever the strides of the incoming gradient).
"""

from __future__ import annotations

import torch

from memfit.sim import _torch_adapter as adapter
from memfit.sim.layouts import CudaLayouts


def _layer_norm_backward():
    x = torch.randn(2, 16, 32)
    w, b = torch.ones(32), torch.zeros(32)
    grad = torch.randn(2, 32, 16).transpose(1, 2)  # a transposed gradient, as a transpose's backward gives
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [32], w, b, 1e-6)
    return torch.ops.aten.native_layer_norm_backward(grad, x, [32], mean, rstd, w, b, [True, True, True])


def test_layer_norm_input_gradient_is_contiguous_as_the_real_kernel_makes_it():
    real = _layer_norm_backward()
    with adapter.new_fake_mode():
        plain = _layer_norm_backward()
    with adapter.new_fake_mode(), CudaLayouts():
        fixed = _layer_norm_backward()
    assert real[0].is_contiguous() and not plain[0].is_contiguous()  # what the meta decomposition gets wrong
    assert [(t.shape, t.stride(), t.dtype) for t in fixed] == [(t.shape, t.stride(), t.dtype) for t in real]


def test_other_ops_pass_through():
    with adapter.new_fake_mode(), CudaLayouts():
        t = torch.randn(4, 8).t()
        assert t.stride() == (1, 8) and (t * 2).stride() == (1, 8)
