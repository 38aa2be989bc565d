"""The one module that touches private or unstable PyTorch APIs.

Everything memfit needs from torch internals goes through here, so a torch upgrade
breaks (at most) this file:

- `torch._subclasses.fake_tensor.FakeTensorMode`: tensors with shapes and dtypes but no data;
  `unset_fake_temporarily`: a meta tensor made inside the mode that stays a plain meta tensor.
- `torch.utils._python_dispatch.TorchDispatchMode`: seeing every aten op below autograd.
- `torch.library.Library(..., "IMPL")` at the `AutocastCPU` dispatch key: replacing the CPU
  autocast policy by CUDA's while a simulation runs (see `cuda_autocast`).
- `torch._C._ExcludeDispatchKeyGuard`: re-dispatching below the autocast key.
- `torch._C._current_autograd_node`, `torch._C._autograd._get_sequence_nr`: which backward
  node is running, and the autograd node counter (layer splicing).
- `torch.utils.weak.WeakIdKeyDictionary`: storages as weak keys.
- `Tensor._is_view`, `OpOverload._schema`: autocast's cache rule and argument names.
- `torch._foreach_norm`, `torch._foreach_mul_`, `torch._amp_foreach_non_finite_check_and_unscale_`,
  `torch._amp_update_scale_`: the kernels `clip_grad_norm_` and `GradScaler` call on CUDA.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "new_fake_mode",
    "outside_fake_mode",
    "exclude_autocast_cpu",
    "override_autocast_cpu",
    "current_autograd_node_name",
    "autocast_cpu_op_names",
    "WeakIdKeyDictionary",
    "current_autograd_node",
    "autograd_sequence_nr",
    "node_sequence_nr",
    "is_view",
    "op_argument_names",
    "foreach_norm",
    "foreach_mul_",
    "amp_unscale_",
    "amp_update_scale_",
]


def new_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that accepts real (e.g. meta-built) tensors as inputs."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def outside_fake_mode() -> contextlib.AbstractContextManager:
    """Leave the active FakeTensorMode for the enclosed code (a meta model's dtype change before it is sharded)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


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


def current_autograd_node():
    """The autograd Node the engine is executing now (None outside a backward)."""
    return torch._C._current_autograd_node()


def node_sequence_nr(node) -> int:
    """The creation number of an autograd Node (`Node._sequence_nr`)."""
    return node._sequence_nr()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd Node created on this thread will get."""
    return torch._C._autograd._get_sequence_nr()


def is_view(t: torch.Tensor) -> bool:
    return t._is_view()


def op_argument_names(op) -> list[str]:
    return [a.name for a in op._schema.arguments]


def foreach_norm(tensors, ord: float = 2.0):
    return torch._foreach_norm(tensors, ord)


def foreach_mul_(tensors, scalar) -> None:
    torch._foreach_mul_(tensors, scalar)


def amp_unscale_(grads, found_inf, inv_scale) -> None:
    """GradScaler._unscale_grads_'s kernel (torch/amp/grad_scaler.py)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval) -> None:
    """GradScaler.update's kernel (torch/amp/grad_scaler.py)."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
