"""The one module that touches private or unstable PyTorch APIs.

Everything memfit needs from torch internals goes through here, so a torch upgrade
breaks (at most) this file:

- `torch._subclasses.fake_tensor.FakeTensorMode`: tensors with shapes and dtypes but no data.
- `torch.utils._python_dispatch.TorchDispatchMode`: seeing every aten op below autograd.
- `torch.library.Library(..., "IMPL")` at the `AutocastCPU` dispatch key: replacing the CPU
  autocast policy by CUDA's while a simulation runs (see `cuda_autocast`).
- `torch._C._ExcludeDispatchKeyGuard`: re-dispatching below the autocast key.
- `torch._C._current_autograd_node`: which backward node is running.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "new_fake_mode",
    "exclude_autocast_cpu",
    "override_autocast_cpu",
    "current_autograd_node_name",
    "autocast_cpu_op_names",
]


def new_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that accepts real (e.g. meta-built) tensors as inputs."""
    return FakeTensorMode(allow_non_fake_inputs=True)


_AUTOCAST_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def exclude_autocast_cpu() -> contextlib.AbstractContextManager:
    """Re-dispatch below the AutocastCPU key (what autocast kernels do internally)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU_KEYSET)


def autocast_cpu_op_names() -> list[str]:
    """Ops that have a CPU autocast kernel in this torch build (to be neutralised)."""
    return [
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")
    ]


@contextlib.contextmanager
def override_autocast_cpu(kernels: dict[str, object]) -> Iterator[None]:
    """Register Python kernels at AutocastCPU for `{"aten::op.overload": fn}`, undo on exit."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.library")
        for name, fn in kernels.items():
            lib.impl(name.removeprefix("aten::"), fn, "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


def current_autograd_node_name() -> str:
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else ""
